"""The GPU MLA peers (``flashinfer-mla``, ``flash-mla``): the canonical inputs become each
library's arguments exactly (CPU, neither library needed); on a GPU, the outputs match
the truth.

Each CPU test computes attention from the converted arguments alone, the way the
library's own reference reads them, and judges it against our float64 truth:

- FlashInfer's MLA wrapper (``tests/attention/test_deepseek_mla.py``, flashinfer-python
  0.7.0.post1's ``mla/_batch_mla``): request ``i`` has queries ``qo_indptr[i]:qo_indptr[i+1]``
  and pages ``kv_indices[kv_indptr[i]:kv_indptr[i+1]]``; token ``t`` is ``kv_cache[page[t
  // page_size], t % page_size]``; logits are ``q_nope . ckv + q_pe . kpe`` (the packed
  576 channels), times ``sm_scale``, causal bottom-right; the output is ``softmax @ ckv``.
- FlashMLA (``tests/test_flash_mla_dense_decoding.py``, ``reference_torch``): request ``i``
  reads blocks ``block_table[i][:ceil(n / 64)]`` of ``k_cache`` for its ``n =
  cache_seqlens[i]`` keys, its ``seq_len_q`` queries under ``tril(n - seq_len_q)``; the
  output is the first ``head_dim_v`` channels of ``softmax @ kv``, 0 where no key is seen.
"""

from __future__ import annotations

import math

import pytest
import torch

from pagedbench.adapters.flash_mla import FlashMla, flash_mla_arguments, uneven_q_lens
from pagedbench.adapters.flashinfer import FlashInferMla, mla_arguments
from pagedbench.harness.verdict.tolerance import assert_matches_truth
from pagedbench.reference import PagedCase, materialize


def _mla(**fields) -> PagedCase:
    return PagedCase(**{"num_q_heads": 8, "num_kv_heads": 1, "head_dim": 576,
                        "head_dim_v": 512, "dtype": "bfloat16", "latent_cache": True,
                        "seed": 3, **fields})


def _softmax_rows(q: torch.Tensor, kv: torch.Tensor, dv: int, scale: float,
                  q_offset: int) -> torch.Tensor:
    """``[q_len, heads, dv]`` float64: query row ``r`` sees keys ``0 .. q_offset + r``."""
    logits = torch.einsum("qhd,kd->hqk", q.double(), kv.double()) * scale
    rows, keys = torch.arange(q.shape[0])[:, None], torch.arange(kv.shape[0])[None, :]
    logits = logits.masked_fill(keys > rows + q_offset, float("-inf"))
    seen = torch.isfinite(logits).any(-1, keepdim=True)
    weights = torch.where(seen, torch.softmax(logits, -1).nan_to_num(0.0), 0.0)
    return torch.einsum("hqk,kd->qhd", weights, kv[:, :dv].double())


def _flashinfer_mla_semantics(case: PagedCase, q: torch.Tensor, args) -> torch.Tensor:
    """What the wrapper computes from ``args``, read as its documentation says."""
    page_size, out = case.block_size, []
    qo, indptr = args.qo_indptr.tolist(), args.kv_indptr.tolist()
    for i, kv_len in enumerate(args.kv_len_arr.tolist()):
        pages = args.kv_indices[indptr[i]:indptr[i + 1]].tolist()
        kv = torch.stack([args.kv_cache[pages[t // page_size], t % page_size]
                          for t in range(kv_len)])  # [kv_len, ckv + kpe]
        rows = q[qo[i]:qo[i + 1]]
        out.append(_softmax_rows(rows, kv, args.head_dim_ckv, case.scale,
                                 kv_len - rows.shape[0]))
    return torch.cat(out).to(case.torch_dtype)


def _flash_mla_semantics(case: PagedCase, args) -> torch.Tensor:
    """What ``flash_mla_with_kvcache`` computes from ``args``, as its test's reference."""
    batch, seq_len_q, heads, _ = args.q.shape
    block_size, out = args.k_cache.shape[1], []
    for i, n in enumerate(args.cache_seqlens.tolist()):
        blocks = args.block_table[i][:math.ceil(n / block_size)]
        kv = args.k_cache[blocks].reshape(-1, args.k_cache.shape[-1])[:n]  # [n, d]
        out.append(_softmax_rows(args.q[i], kv, args.head_dim_v, case.scale, n - seq_len_q))
    return torch.cat(out).to(case.torch_dtype)


# --- FlashInfer's MLA wrapper ------------------------------------------------------------

@pytest.mark.parametrize("case", [
    _mla(kv_lens=(1, 16, 17, 40), block_size=16, name="decode-bs16"),
    _mla(kv_lens=(3, 1, 9), block_size=1, name="decode-token-pool"),
    _mla(kv_lens=(20, 64, 70), q_lens=(5, 1, 16), block_size=64, sm_scale=0.3,
         name="prefill-bs64"),
    _mla(kv_lens=(7, 33), block_size=16, layout="fused_qkv", dtype="float16", name="fused"),
], ids=lambda c: c.name)
def test_flashinfer_mla_arguments_compute_the_truth(case: PagedCase) -> None:
    inputs = materialize(case)
    args = mla_arguments(inputs)
    assert {args.qo_indptr.dtype, args.kv_indptr.dtype, args.kv_indices.dtype,
            args.kv_len_arr.dtype} == {torch.int32}
    assert (args.head_dim_ckv, args.head_dim_kpe) == (512, 64)
    assert args.kv_cache.shape == (inputs.kv_cache.shape[0], case.block_size, 576)
    assert_matches_truth(_flashinfer_mla_semantics(case, inputs.q, args), inputs, case.case_id)


def test_flashinfer_mla_arguments_refuse_a_separate_v() -> None:
    case = _mla(kv_lens=(4,), block_size=16, latent_cache=False)
    with pytest.raises(ValueError, match="latent_cache case with one KV head"):
        mla_arguments(materialize(case))


def _not_the_gpu(reasons: list[str]) -> list[str]:
    """``reasons`` without the GPU's own (its compute capability, where one is visible)."""
    return [r for r in reasons if "compute capability" not in r]


def test_flashinfer_mla_declares_only_the_latent_head() -> None:
    adapter = FlashInferMla()
    assert _not_the_gpu(adapter.why_unsupported(_mla(kv_lens=(4,), block_size=16), "cuda")) == []
    reasons = adapter.why_unsupported(
        PagedCase(kv_lens=(4,), num_q_heads=8, num_kv_heads=2, head_dim=128,
                  dtype="float32", block_size=16), "cuda")
    assert any("head_dim 128" in r for r in reasons)
    assert any("float32" in r for r in reasons)
    assert any("a separate V not supported" in r for r in reasons)


# --- FlashMLA ----------------------------------------------------------------------------

@pytest.mark.parametrize("case", [
    _mla(kv_lens=(1, 64, 65, 200), block_size=64, name="decode"),
    _mla(kv_lens=(2, 70, 130), q_lens=(2, 2, 2), block_size=64, name="mtp-2"),
    _mla(kv_lens=(0, 5, 64), block_size=64, name="empty-kv"),
    _mla(kv_lens=(9, 100), q_lens=(4, 4), block_size=64, layout="fused_qkv",
         dtype="float16", sm_scale=0.05, name="fused-mtp-4"),
], ids=lambda c: c.name)
def test_flash_mla_arguments_compute_the_truth(case: PagedCase) -> None:
    inputs = materialize(case)
    args = flash_mla_arguments(inputs)
    seq_len_q = case.q_lens_or_decode[0]
    assert args.q.shape == (case.batch_size, seq_len_q, case.num_q_heads, 576)
    assert args.q.data_ptr() == inputs.q.data_ptr()  # a view, no copy
    assert args.k_cache.shape == (inputs.kv_cache.shape[0], 64, 1, 576)
    assert {args.block_table.dtype, args.cache_seqlens.dtype} == {torch.int32}
    assert_matches_truth(_flash_mla_semantics(case, args), inputs, case.case_id)


def test_flash_mla_takes_even_q_lens_only() -> None:
    even, uneven = _mla(kv_lens=(8, 9), q_lens=(3, 3), block_size=64), \
        _mla(kv_lens=(8, 9), q_lens=(3, 1), block_size=64)
    assert uneven_q_lens(even) is None
    assert "q_lens [3, 1] not supported" in uneven_q_lens(uneven)
    with pytest.raises(ValueError, match=r"q_lens \[3, 1\] not supported"):
        flash_mla_arguments(materialize(uneven))
    reasons = FlashMla().why_unsupported(uneven.with_(block_size=16), "cuda")
    assert any("q_lens [3, 1]" in r for r in reasons)
    assert any("block_size 16" in r for r in reasons)
    assert _not_the_gpu(FlashMla().why_unsupported(even, "cuda")) == []


# --- on a GPU ----------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("adapter_cls, case", [
    (FlashInferMla, _mla(kv_lens=(1, 16, 17, 300), block_size=16, name="fi-mla-decode")),
    (FlashInferMla, _mla(kv_lens=(20, 64, 70), q_lens=(5, 1, 16), block_size=1,
                         name="fi-mla-prefill")),
    (FlashMla, _mla(kv_lens=(1, 64, 65, 300), block_size=64, name="flash-mla-decode")),
    (FlashMla, _mla(kv_lens=(2, 70, 130), q_lens=(2, 2, 2), block_size=64,
                    name="flash-mla-mtp")),
], ids=lambda value: getattr(value, "name", ""))
def test_mla_peer_matches_truth_and_repeats(adapter_cls, case: PagedCase) -> None:
    """Boundary lengths around the block size: the output passes the tolerance policy, and
    a second run of the same preparation is bit-identical."""
    adapter = adapter_cls()
    availability = adapter.available("cuda")
    if not availability.ok:
        pytest.skip(availability.reason)
    if reasons := adapter.why_unsupported(case, "cuda"):
        pytest.skip("; ".join(reasons))
    prepared = adapter.prepare(materialize(case, "cuda"))
    first = adapter.run(prepared).clone()
    assert_matches_truth(first, materialize(case), case.case_id)
    assert torch.equal(adapter.run(prepared), first)
