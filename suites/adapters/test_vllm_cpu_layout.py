"""vllm-cpu adapter: the canonical inputs become exactly what vLLM's CPU op reads, on
every ISA path, on any host (the layout conversion runs without the ISA).

The read-back below follows the layouts vLLM documents, written here with explicit
offsets, independently of the adapter's views: for token ``t`` of a sequence, block ``b =
block_table[t // block_size]`` and offset ``o = t % block_size``, channel ``c`` of KV head
``h`` is element :func:`offsets` ``(o, c)`` of K's and of V's ``(b, h)`` region (the
backend's ``kv_cache.view(num_blocks, num_kv_heads, 2 * block_size, head_dim).chunk(2,
dim=2)``). ``vec``/``vec16`` (``csrc/cpu/cpu_attn_vec.hpp``: "reshape K as column-major and
V as row-major"): K at ``c * block_size + o``, V at ``o * head_dim + c``. ``amx``
(``reshape_and_cache`` of ``AttentionImpl<ISA::AMX>`` in ``csrc/cpu/cpu_attn_amx.hpp``:
K as 32-bit pairs of channels in groups of 16 tokens, V as pairs of tokens in groups of
16 channels, 16-bit elements).

Needs no vLLM except the tests marked ``vllm`` (skipped, with the reason, without it);
vLLM's own writer (``cpu_attn_reshape_and_cache``) is plain stores for every ISA, so it is
compared on any host whose build has it.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from itertools import accumulate

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from pagedbench.adapters.vllm_cpu import (
    HEAD_DIMS,
    ISAS,
    attention_isa,
    library_for_cpu,
    loaded_library,
    soft_cap_fast_exp,
    to_vllm_cpu_cache,
)
from pagedbench.reference import PagedCase, gather_kv, materialize
from pagedbench.reference.inputs import TAIL_POISONS
from pagedbench.suites.adapters.vllm_cpu_cases import ADAPTER, needs_vllm, vllm_cases


def offsets(isa: str, block_size: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Where element ``[o, c]`` (token offset, channel) of one (block, head) sits in vLLM's
    K and V regions for ``isa``: two int64 ``[block_size, head_dim]`` tensors."""
    o = torch.arange(block_size)[:, None]
    c = torch.arange(head_dim)[None, :]
    if isa == "amx":
        key = (o // 16) * 16 * head_dim + (c // 2) * 32 + (o % 16) * 2 + c % 2
        value = (c // 16) * 16 * block_size + (o // 2) * 32 + (c % 16) * 2 + o % 2
        return key, value
    return c * block_size + o, o * head_dim + c


def isas_for(case: PagedCase) -> list[str]:
    """The ISA layouts ``case``'s shape can be written in: vec/vec16 always; amx for 16-bit
    elements with block_size and head_dim multiples of 16."""
    amx = (case.kv_cache_dtype == "auto" and case.torch_dtype.itemsize == 2
           and case.block_size % 16 == 0 and case.head_dim % 16 == 0)
    return ["vec", "amx"] if amx else ["vec"]


def _bits(x: torch.Tensor) -> torch.Tensor:
    """Bit-comparable form (NaN payloads included): the elements as integers."""
    return x.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[x.element_size()])


def unpack(key_cache: torch.Tensor, value_cache: torch.Tensor, isa: str) -> torch.Tensor:
    """The canonical ``[num_blocks, 2, block_size, num_kv_heads, head_dim]`` cache read
    back from vLLM's ``isa`` layout, every element (used or not), by :func:`offsets`."""
    num_blocks, hkv, bs, d = key_cache.shape
    out = []
    for cache, where in zip((key_cache, value_cache), offsets(isa, bs, d)):
        regions = cache.flatten(2)  # [nb, hkv, bs * d]: one region per (block, head)
        out.append(regions[:, :, where].permute(0, 2, 1, 3))  # [nb, bs, hkv, d]
    return torch.stack(out, dim=1)


def gather_vllm(key_cache: torch.Tensor, value_cache: torch.Tensor, inputs, isa: str):
    """Per sequence (k, v) ``[kv_len, num_kv_heads, head_dim]``, read vLLM's way."""
    case = inputs.case
    bs = case.block_size
    k_at, v_at = offsets(isa, bs, case.head_dim)
    k_regions = key_cache.flatten(2)  # [num_blocks, hkv, bs * d]: one region per (b, h)
    v_regions = value_cache.flatten(2)
    out = []
    for table, kv_len in zip(inputs.block_tables.tolist(), case.kv_lens):
        ks, vs = [], []
        for t in range(kv_len):
            b, o = table[t // bs], t % bs
            ks.append(k_regions[b, :, k_at[o]])  # [hkv, d]
            vs.append(v_regions[b, :, v_at[o]])
        out.append((torch.stack(ks), torch.stack(vs)))
    return out


@given(vllm_cases(), st.sampled_from(TAIL_POISONS))
@example(PagedCase(kv_lens=(1, 48, 49), num_q_heads=2, num_kv_heads=2, head_dim=96,
                   block_size=48, dtype="bfloat16", kv_cache_dtype="fp8_e4m3", k_scale=0.5,
                   name="fp8-bs48"), "nan")
@example(PagedCase(kv_lens=(16, 17, 3), q_lens=(16, 2, 3), num_q_heads=4, num_kv_heads=1,
                   head_dim=64, block_size=16, dtype="float32", name="mqa"), "stale")
@example(PagedCase(kv_lens=(1, 32, 33, 160), num_q_heads=8, num_kv_heads=2, head_dim=128,
                   block_size=32, dtype="bfloat16", name="amx-tails"), "stale")
def test_conversion_reads_back_the_canonical_cache_poison_included(case: PagedCase,
                                                                   tail_poison: str) -> None:
    """Every ISA layout, unpacked again, is the canonical cache bit for bit: live tokens,
    NaN and stale tails, unused blocks; and the live tokens read vLLM's way are the
    logical K and V."""
    inputs = materialize(case, tail_poison=tail_poison)
    nb, hkv, d = inputs.kv_cache.shape[0], case.num_kv_heads, case.head_dim
    expected_dtype = torch.uint8 if case.kv_cache_dtype != "auto" else case.torch_dtype
    canonical = inputs.kv_cache.view(torch.uint8) if expected_dtype == torch.uint8 else \
        inputs.kv_cache
    for isa in isas_for(case):
        key_cache, value_cache = to_vllm_cpu_cache(inputs, isa)
        for cache in (key_cache, value_cache):
            assert cache.shape == (nb, hkv, case.block_size, d)
            assert cache.dtype == expected_dtype
        # vLLM reads V with K's strides (one packed tensor, K then V along dim 2).
        assert key_cache.stride() == value_cache.stride()
        assert value_cache.data_ptr() - key_cache.data_ptr() == \
            case.block_size * d * key_cache.element_size()
        assert torch.equal(_bits(unpack(key_cache, value_cache, isa)), _bits(canonical)), isa
        for (k, v), (k_ref, v_ref) in zip(gather_vllm(key_cache, value_cache, inputs, isa),
                                          gather_kv(inputs)):
            assert torch.equal(_bits(k), _bits(k_ref.view(k.dtype))), isa
            assert torch.equal(_bits(v), _bits(v_ref.view(v.dtype))), isa


def test_the_unpacking_is_a_permutation_of_each_region() -> None:
    """The explicit offsets name every element of a region once, for every ISA (so the
    bitwise round trip above cannot pass by reading one element twice)."""
    for isa in ISAS:
        for block_size, head_dim in ((16, 64), (32, 128), (64, 80)):
            for where in offsets(isa, block_size, head_dim):
                assert sorted(where.flatten().tolist()) == list(range(block_size * head_dim))


@pytest.mark.parametrize("block_size, kv_lens", [
    (16, (1, 15, 16, 17, 32, 33)),
    (32, (1, 31, 32, 33, 64, 65)),
    (48, (48, 47, 49, 96, 1, 2)),
])
@needs_vllm
def test_metadata_at_block_multiples_and_partial_blocks(block_size, kv_lens) -> None:
    q_lens = (1, 3, 1, 5, 1, 2)
    case = PagedCase(kv_lens=kv_lens, q_lens=q_lens, num_q_heads=8, num_kv_heads=2,
                     head_dim=64, block_size=block_size, dtype="bfloat16", name="meta")
    inputs = materialize(case)
    prepared = ADAPTER.prepare(inputs)
    args = prepared.call.keywords
    for name in ("query_start_loc", "seq_lens", "block_table"):
        assert args[name].dtype == torch.int32, name
    assert args["query_start_loc"].tolist() == [0, *accumulate(q_lens)]
    assert args["seq_lens"].tolist() == list(kv_lens)
    table = args["block_table"].tolist()
    assert len(table[0]) == math.ceil(max(kv_lens) / block_size)
    slots = inputs.slot_mapping.tolist()
    start = 0
    for i, kv_len in enumerate(kv_lens):
        # Token t of sequence i sits in block table[i][t // bs] at offset t % bs.
        assert slots[start:start + kv_len] == [
            table[i][t // block_size] * block_size + t % block_size for t in range(kv_len)]
        # Entries past the last block point at the all-NaN padding block.
        assert set(table[i][math.ceil(kv_len / block_size):]) <= {inputs.padding_block}
        start += kv_len
    assert args["sliding_window"] == -1 and args["softcap"] == 0.0
    assert args["alibi_slopes"] is None and args["s_aux"] is None
    # vLLM's rule for bfloat16 and head_dim 64: amx where the host has AMX tiles.
    block_isa = "amx" if torch.cpu._is_amx_tile_supported() else "vec"
    assert prepared.facts["isa"] == ("vec16" if block_size % 32 else block_isa)
    assert args["output"] is prepared.out
    assert bool(prepared.out.isnan().all()), "the output buffer is not poisoned"


@needs_vllm
def test_feature_arguments_reach_the_call() -> None:
    case = PagedCase(kv_lens=(40, 7), q_lens=(4, 1), num_q_heads=6, num_kv_heads=2,
                     head_dim=64, block_size=32, dtype="float16", sliding_window=9,
                     logits_soft_cap=30.0, alibi=True, sinks=True, kv_cache_dtype="fp8_e5m2",
                     k_scale=0.5, v_scale=2.0, name="args")
    if ADAPTER.why_unsupported(case, "cpu"):  # no fp8 on this host's ISA: take the
        case = case.with_(kv_cache_dtype="auto", k_scale=1.0, v_scale=1.0)  # cache as is
    inputs = materialize(case)
    args = ADAPTER.prepare(inputs).call.keywords
    assert args["sliding_window"] == 9 and args["softcap"] == 30.0
    assert args["scale"] == 1 / 8
    assert args["alibi_slopes"].dtype == torch.float32
    assert torch.equal(args["alibi_slopes"], inputs.alibi_slopes)
    assert args["s_aux"].dtype == torch.float32 and torch.equal(args["s_aux"], inputs.sinks)
    assert (args["k_scale"], args["v_scale"]) == (case.k_scale, case.v_scale)
    assert args["kv_cache_dtype"] == case.kv_cache_dtype
    fp8 = case.kv_cache_dtype != "auto"
    assert args["key_cache"].dtype == (torch.uint8 if fp8 else torch.float16)


def write_with_vllm(inputs, isa: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The live tokens of ``inputs`` (``kv_cache_dtype`` ``"auto"``) written by vLLM's own
    ``cpu_attn_reshape_and_cache`` for ``isa`` into a NaN-filled packed cache: ``key_cache,
    value_cache`` as :func:`to_vllm_cpu_cache` returns them."""
    from vllm import _custom_ops as ops

    bs = inputs.case.block_size
    slot = inputs.slot_mapping
    key = inputs.kv_cache[slot // bs, 0, slot % bs]  # [sum(kv_lens), hkv, d]
    value = inputs.kv_cache[slot // bs, 1, slot % bs]
    num_blocks, _, _, hkv, d = inputs.kv_cache.shape
    packed = inputs.kv_cache.new_full((num_blocks, hkv, 2 * bs, d), float("nan"))
    key_cache, value_cache = packed.chunk(2, dim=2)  # [nb, hkv, bs, d] each
    ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slot, isa)
    return key_cache, value_cache


@pytest.mark.parametrize("isa, block_size, head_dim, dtype", [
    *((isa, bs, d, dtype) for isa, bs, d in (("vec", 32, 64), ("vec16", 16, 64),
                                             ("vec16", 48, 80), ("vec16", 32, 128))
      for dtype in ("float32", "bfloat16")),
    ("amx", 32, 64, "bfloat16"), ("amx", 64, 128, "bfloat16"), ("amx", 32, 96, "bfloat16")])
@needs_vllm
def test_our_layout_equals_vllms_own_writer(isa, block_size, head_dim, dtype) -> None:
    """vLLM's ``cpu_attn_reshape_and_cache`` lays out the same live tokens exactly where
    the adapter's copy puts them, and leaves the same slots NaN: bit for bit. Its amx
    writer is plain stores, no AMX instruction: it runs on a CPU without AMX, checked on
    the ``_C`` build."""
    if isa == "amx" and loaded_library() != "_C":
        pytest.skip(f"vLLM's amx writer is checked on its _C build; {loaded_library()} "
                    "loaded here")
    case = PagedCase(kv_lens=(1, block_size, 2 * block_size + 3), num_q_heads=4,
                     num_kv_heads=2, head_dim=head_dim, block_size=block_size, dtype=dtype,
                     name="writer")
    inputs = materialize(case)  # NaN in every unused slot, as the writer leaves them
    for ours, theirs in zip(to_vllm_cpu_cache(inputs, isa), write_with_vllm(inputs, isa)):
        assert torch.equal(_bits(ours), _bits(theirs)), isa


_VLLM_ISA_SCRIPT = """
import json, sys, torch
from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
out = []
for dtype, block_size, head_dim, kv_cache_dtype in json.loads(sys.argv[1]):
    try:
        out.append(_get_attn_isa(getattr(torch, dtype), block_size, head_dim, kv_cache_dtype))
    except NotImplementedError as exc:
        out.append("error: " + str(exc))
print(json.dumps(out))
"""


@needs_vllm
def test_isa_is_the_one_vllms_backend_picks() -> None:
    """``attention_isa`` against vLLM's own ``_get_attn_isa``, in a separate process
    (importing vLLM's backend module switches its Triton support off process-wide);
    slow: that import takes 10-30 s."""
    grid = [(dtype, bs, hd, kv) for dtype in ("float32", "float16", "bfloat16")
            for bs in (16, 32, 48, 64) for hd in (48, 64, 80, 128)
            for kv in ("auto", "fp8_e4m3")]
    done = subprocess.run([sys.executable, "-c", _VLLM_ISA_SCRIPT, json.dumps(grid)],
                          capture_output=True, text=True, timeout=600, check=True)
    vllm_isas = json.loads(done.stdout.strip().splitlines()[-1])
    for (dtype, bs, hd, kv), vllm_isa in zip(grid, vllm_isas):
        case = PagedCase(kv_lens=(1,), num_q_heads=1, num_kv_heads=1, head_dim=hd,
                         block_size=bs, dtype=dtype, kv_cache_dtype=kv, name="isa")
        if vllm_isa.startswith("error"):
            assert ADAPTER.why_unsupported(case, "cpu"), (case.case_id, vllm_isa)
        else:
            assert attention_isa(case) == vllm_isa, case.case_id


@needs_vllm
def test_declared_head_dims_and_block_sizes_are_what_the_build_runs() -> None:
    """Every multiple of 16 up to 512 as head_dim, and block sizes 8..64: the op runs
    exactly the declared ones and raises (never aborts) on the others."""
    for head_dim in range(16, 513, 16):
        for block_size in (16, 32):
            case = PagedCase(kv_lens=(3, block_size), num_q_heads=2, num_kv_heads=1,
                             head_dim=head_dim, block_size=block_size, dtype="float32",
                             name="sweep")
            _expect_runs(case, head_dim in HEAD_DIMS)
    for block_size in (8, 16, 24, 32, 48, 64):
        case = PagedCase(kv_lens=(3, block_size), num_q_heads=2, num_kv_heads=1,
                         head_dim=64, block_size=block_size, dtype="float32", name="sweep")
        _expect_runs(case, block_size % 16 == 0)


def _expect_runs(case: PagedCase, declared: bool) -> None:
    assert bool(ADAPTER.why_unsupported(case, "cpu")) != declared, case.case_id
    inputs = materialize(case)
    if declared:
        ADAPTER.run(ADAPTER.prepare(inputs))
    else:
        with pytest.raises(RuntimeError):
            ADAPTER.run(ADAPTER.prepare(inputs))


def test_the_library_follows_vllms_rule_for_every_flag_combination() -> None:
    """vLLM's import_kernels: AVX-512 with AVX512_BF16 loads _C, AVX-512 alone _C_AVX512,
    anything else _C_AVX2 (checked against the loaded library where vLLM is installed:
    test_vllm_cpu_features.py)."""
    assert library_for_cpu(True, True) == "_C"
    assert library_for_cpu(True, False) == "_C_AVX512"
    assert library_for_cpu(False, True) == library_for_cpu(False, False) == "_C_AVX2"


@pytest.mark.parametrize("library", ["_C", "_C_AVX512", "_C_AVX2"])
def test_the_soft_cap_nan_is_declared_on_the_avx512_builds_only(library: str) -> None:
    """The cases the AVX-512 builds' fast_exp tanh turns NaN are declared there, on any
    host: the edge probe (cap 0.05, qk_magnitude 30: logits of thousands) and the
    search's case (cap 30, logit_offset 1e4: |x| = 333); cap 1 on unit draws (|x| under
    12) and logits of 1e3 under cap 50 (|x| = 20) stay; _C_AVX2 (std::tanh) takes all."""
    def case(**fields) -> PagedCase:
        return PagedCase(kv_lens=(17, 35), num_q_heads=2, num_kv_heads=2, head_dim=64,
                         block_size=16, dtype="float16", name="cap", **fields)
    fast_exp = library != "_C_AVX2"
    for nan in (case(logits_soft_cap=0.05, qk_magnitude=30.0),
                case(logits_soft_cap=30.0, logit_offset=1e4)):
        reasons = soft_cap_fast_exp(nan, library)
        assert bool(reasons) == fast_exp, (nan.case_id, reasons)
        assert all(library in r and "fast_exp" in r for r in reasons)
    for finite in (case(logits_soft_cap=1.0), case(logits_soft_cap=50.0, logit_offset=1e3),
                   case(logit_offset=1e4)):
        assert soft_cap_fast_exp(finite, library) == [], finite.case_id


@pytest.mark.parametrize("library", ["_C", "_C_AVX512", "_C_AVX2"])
def test_the_float32_soft_cap_cancellation_is_declared_on_the_avx512_builds_only(
        library: str) -> None:
    """The search's case on a _C host (float32, d64, bs16, 1/1 heads, kv_len 15, cap 1e4:
    11299 ulps against 256) and every float32 cap above 100 are declared on the AVX-512
    builds; caps up to 100, and 16-bit cases, stay; _C_AVX2 (std::tanh) takes all."""
    search = PagedCase(kv_lens=(15,), num_q_heads=1, num_kv_heads=1, head_dim=64,
                       block_size=16, dtype="float32", logits_soft_cap=1e4, name="hyp")
    for cap, declared in ((1e4, True), (101.0, True), (100.0, False), (30.0, False)):
        reasons = soft_cap_fast_exp(search.with_(logits_soft_cap=cap), library)
        assert bool(reasons) == (declared and library != "_C_AVX2"), (cap, reasons)
        assert all("cancels" in r for r in reasons)
    assert soft_cap_fast_exp(search.with_(dtype="bfloat16"), library) == []
