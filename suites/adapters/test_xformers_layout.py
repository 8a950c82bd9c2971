"""xformers adapter: the canonical inputs become xformers' paged BMGHK tensors and
``PagedBlockDiagonalCausalWithOffsetPaddedKeysMask`` exactly (CPU, with xformers' own
bias classes); on a GPU, its triton_splitKF kernel matches the truth.

xformers' kernels are CUDA-only, but its bias objects are plain Python: materialized
(``bias.materialize``, xformers' own dense form of the mask) and applied to the paged
K/V with an ordinary masked softmax, they must give the float64 truth. That checks the
adapter's layout and xformers' mask semantics together, independently of any kernel.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import example, given

from pagedbench.adapters.base import Capabilities
from pagedbench.adapters.xformers import XformersSplitK, paged_bias, xformers_paged
from pagedbench.harness.cases.strategies import paged_cases
from pagedbench.harness.verdict.tolerance import assert_matches_truth
from pagedbench.reference import PagedCase, gather_kv, materialize

pytest.importorskip("xformers", reason="xformers not installed (pip install xformers==0.0.35)")

#: What xformers' paged bias expresses: decode and causal prefill, no window, no soft cap;
#: float32, so that the cast of the float64 result adds no error of note.
BIAS_SPACE = Capabilities(devices=frozenset({"cpu"}), dtypes=frozenset({"float32"}),
                          modes=frozenset({"decode", "prefill"}))
DECODE = PagedCase(kv_lens=(1, 64, 65, 130), num_q_heads=6, num_kv_heads=2, head_dim=64,
                   block_size=64, dtype="float32", name="xf-decode")
PREFILL = PagedCase(kv_lens=(7, 16, 17, 40), q_lens=(1, 16, 5, 9), num_q_heads=4,
                    num_kv_heads=4, head_dim=64, block_size=16, dtype="float32",
                    name="xf-prefill")


def _physical_mask(case: PagedCase, inputs) -> torch.Tensor:
    """xformers' materialized bias over every pool row, ``[total_q, num_blocks * block_size]``
    float32, 0 where a query may attend and -inf elsewhere."""
    bias = paged_bias(xformers_paged(inputs))
    logical = case.batch_size * case.max_blocks_per_seq * case.block_size
    mask = bias.materialize((case.total_q, logical))  # [total_q, (max block id + 1) * bs]
    rows = case.pool_blocks * case.block_size
    padded = torch.full((case.total_q, rows), -math.inf)
    padded[:, : mask.shape[1]] = mask
    return padded


@given(case=paged_cases())
def test_gather_through_xformers_layout_matches_canonical(case: PagedCase) -> None:
    """Token t of sequence b is pool row block_tables[b, t // bs] * bs + t % bs, in every
    query head of its group (the KV head expanded with stride 0)."""
    inputs = materialize(case)
    paged = xformers_paged(inputs)
    bs, ratio = case.block_size, case.gqa_ratio
    assert paged.k.shape == (1, case.pool_blocks * bs, case.num_kv_heads, ratio, case.head_dim)
    if ratio > 1:
        assert paged.k.stride(3) == 0 and paged.v.stride(3) == 0
    tables = paged.block_tables.tolist()
    for b, (k_ref, v_ref) in enumerate(gather_kv(inputs)):
        rows = [tables[b][t // bs] * bs + t % bs for t in range(paged.kv_seqlen[b])]
        for h in range(ratio):
            assert torch.equal(paged.k[0, rows, :, h], k_ref)
            assert torch.equal(paged.v[0, rows, :, h], v_ref)


@given(case=paged_cases())
def test_xformers_queries_and_lengths(case: PagedCase) -> None:
    """Query head g * ratio + h is group g, member h; per-sequence lengths as the case's."""
    inputs = materialize(case)
    paged = xformers_paged(inputs)
    ratio = case.gqa_ratio
    for g in range(case.num_kv_heads):
        for h in range(ratio):
            assert torch.equal(paged.q[0, :, g, h], inputs.q[:, g * ratio + h])
    assert paged.q_seqlen == list(case.q_lens_or_decode)
    assert paged.kv_seqlen == list(case.kv_lens)
    assert paged.block_tables.dtype == torch.int32 and paged.page_size == case.block_size


@example(case=DECODE)
@example(case=PREFILL)
@given(case=paged_cases(BIAS_SPACE))
def test_xformers_bias_allows_exactly_the_visible_slots(case: PagedCase) -> None:
    """Query j of sequence b (position p = kv_len - q_len + j) may attend exactly the pool
    rows of its tokens 0..p: never another sequence's, never a NaN-poisoned slot."""
    inputs = materialize(case)
    allowed = _physical_mask(case, inputs) == 0  # [total_q, pool rows]
    tables, bs = inputs.block_tables.tolist(), case.block_size
    cu = inputs.cu_seqlens_q.tolist()
    for b, (q_len, kv_len) in enumerate(zip(case.q_lens_or_decode, case.kv_lens)):
        for j in range(q_len):
            p = kv_len - q_len + j
            expected = {tables[b][t // bs] * bs + t % bs for t in range(p + 1)}
            got = set(allowed[cu[b] + j].nonzero().flatten().tolist())
            assert got == expected, f"sequence {b}, query {j}"
    live = torch.isfinite(inputs.kv_cache[:, 0]).all(-1).all(-1).flatten()  # [pool rows]
    assert bool(live[allowed.any(0)].all())


@example(case=DECODE)
@example(case=PREFILL)
@given(case=paged_cases(BIAS_SPACE))
def test_xformers_bias_attention_matches_truth(case: PagedCase) -> None:
    """Softmax over the paged K/V with xformers' materialized bias == the float64 truth
    (tolerance policy), for decode and causal prefill alike."""
    inputs = materialize(case)
    paged = xformers_paged(inputs)
    mask = _physical_mask(case, inputs).double()  # [total_q, rows]
    q = paged.q[0].double()  # [total_q, G, H, D]
    k = paged.k[0].double().nan_to_num(0.0)  # [rows, G, H, D]; poison is masked out
    v = paged.v[0].double().nan_to_num(0.0)
    scores = torch.einsum("qghd,kghd->ghqk", q, k) * case.scale + mask  # [G, H, total_q, rows]
    out = torch.einsum("ghqk,kghd->qghd", scores.softmax(-1), v)  # [total_q, G, H, D]
    out = out.reshape(case.total_q, case.num_q_heads, case.head_dim).to(case.torch_dtype)
    assert_matches_truth(out, inputs, case.case_id)


def test_why_unsupported_names_splitk_limits() -> None:
    """triton_splitKF: one query length for all sequences, at most 16, with a causal bias;
    blocks a multiple of 64; fp16/bf16."""
    adapter = XformersSplitK()
    decode = PagedCase(kv_lens=(70, 3), num_q_heads=8, num_kv_heads=2, head_dim=128,
                       block_size=64, dtype="bfloat16")
    assert adapter.why_unsupported(decode, "cuda") == []
    assert adapter.why_unsupported(decode.with_(q_lens=(3, 3)), "cuda") == []
    mixed = adapter.why_unsupported(decode.with_(q_lens=(4, 3)), "cuda")
    assert len(mixed) == 1 and "q_lens [3, 4] differ" in mixed[0]
    long = adapter.why_unsupported(decode.with_(kv_lens=(70, 70), q_lens=(17, 17)), "cuda")
    assert len(long) == 1 and "q_len 17 > 16" in long[0]
    small_blocks = adapter.why_unsupported(decode.with_(block_size=16), "cuda")
    assert len(small_blocks) == 1 and "block_size 16" in small_blocks[0]
    fp32 = adapter.why_unsupported(decode.with_(dtype="float32"), "cuda")
    assert len(fp32) == 1 and "dtype float32" in fp32[0]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the reason given without CUDA")
def test_unavailable_without_cuda_says_why() -> None:
    reason = XformersSplitK().available("cuda").reason
    assert reason.startswith("xformers ") and "sees no CUDA device" in reason
    assert "runs only on CUDA" in XformersSplitK().available("cpu").reason


@pytest.mark.gpu
@pytest.mark.parametrize("q_lens", [None, (4, 4, 4)], ids=["decode", "uniform-q4"])
def test_xformers_matches_truth(q_lens) -> None:
    """Block size 64 with lengths 64, 65 and 130, GQA 3, bf16."""
    adapter = XformersSplitK()
    availability = adapter.available("cuda")
    if not availability.ok:
        pytest.skip(availability.reason)
    case = PagedCase(kv_lens=(64, 65, 130), q_lens=q_lens, num_q_heads=6, num_kv_heads=2,
                     head_dim=128, block_size=64, dtype="bfloat16", name="xf-pinned")
    assert adapter.why_unsupported(case, "cuda") == []
    out = adapter.run(adapter.prepare(materialize(case, "cuda")))
    cpu = materialize(case)
    assert_matches_truth(out, cpu, case.case_id)


def test_cpp_extensions_status_names_why_they_did_not_load(monkeypatch) -> None:
    """Recorded in every result's impl_details: 'loaded', or the loader's own error (the
    0.0.35 wheel's _C.so needs libcudart.so.12, which a CUDA 13 machine lacks)."""
    from xformers import _cpp_lib

    from pagedbench.adapters import xformers as adapter

    monkeypatch.setattr(_cpp_lib, "_cpp_library_load_exception", None)
    assert adapter.cpp_extensions_status() == "loaded"
    try:
        try:
            raise OSError("libcudart.so.12: cannot open shared object file: No such file")
        except OSError as cause:
            raise _cpp_lib.xFormersWasNotBuiltException() from cause
    except _cpp_lib.xFormersWasNotBuiltException as error:
        monkeypatch.setattr(_cpp_lib, "_cpp_library_load_exception", error)
    assert adapter.cpp_extensions_status() == (
        "not loaded: OSError: libcudart.so.12: cannot open shared object file: No such file")
    monkeypatch.setattr(_cpp_lib, "_cpp_library_load_exception", OSError("x" * 1000))
    assert len(adapter.cpp_extensions_status()) == adapter.MAX_STATUS_CHARS
