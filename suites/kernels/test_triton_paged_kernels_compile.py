"""The split-decode, merge and prefill kernels compile for NVIDIA GPUs, pipelined, on a
machine without one.

A fresh process without ``TRITON_INTERPRET`` plans real launches and compiles them ahead
of time for sm_80 and sm_90 with the ``ptxas`` in the triton wheel, specializing the
arguments as a launch would (integers equal to 1 become constants, multiples of 16 and
aligned pointers get ``tt.divisibility``: the alignment the copy engine needs). Checked:
a cubin; tensor cores (``mma``) for 16-bit and fp8 caches and none for float32
(``ieee`` dots); and software pipelining at the table's ``num_stages`` (3): the key loop
holds at least two K/V buffers in shared memory and waits for its copies with newer ones
still in flight (``ttg.async_wait {num > 0}``). At ``num_stages`` 2 the same loop waits
for everything (``num = 0``), which is why the table asks for 3. fp8 E4M3 does not
compile for sm_80 (the adapters refuse it below compute capability 8.9).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

_SCRIPT = r"""
import json, re, sys
from pagedbench.kernels import paged_prefill as pp, paged_split_decode as sd
from pagedbench.kernels.paged_features import kernels_are_interpreted
from pagedbench.reference import PagedCase, materialize
from pagedbench.harness.lane.compile_check import compile_like_launch

assert not kernels_are_interpreted()


results = []
for name, kernel, dtype, kv, head_dim, bs, q_lens, capability, stages in json.loads(
        sys.argv[1]):
    case = PagedCase(kv_lens=(3, 300), q_lens=q_lens, num_q_heads=4, num_kv_heads=1,
                     head_dim=head_dim, block_size=bs, dtype=dtype, kv_cache_dtype=kv,
                     alibi=True, sinks=True)
    x = materialize(case)
    features = dict(sliding_window=64, logits_soft_cap=30.0, alibi_slopes=x.alibi_slopes,
                    sinks=x.sinks)
    if kernel == "prefill":
        plan = pp.plan_paged_prefill(x.q, x.kv_cache, x.block_tables, x.kv_lens,
                                     x.cu_seqlens_q, x.scale, **features)
        jit, args, constexprs = pp._prefill_kernel, plan.args, plan.constexprs
    else:
        plan = sd.plan_paged_split_decode(x.q, x.kv_cache, x.block_tables, x.kv_lens,
                                          x.scale, batch_invariant=True, **features)
        jit, args, constexprs = sd._split_decode_kernel, plan.args, plan.constexprs
        if kernel == "merge":
            jit, args, constexprs = sd._merge_kernel, plan.merge_args, plan.merge_constexprs
    config = plan.plan.config
    options = {"num_warps": sd.MERGE_NUM_WARPS if kernel == "merge" else config.num_warps,
               "num_stages": stages or config.num_stages}
    try:
        compiled = compile_like_launch(jit, args, {**constexprs, **options}, capability)
    except Exception as exc:
        results.append({"name": name, "error": str(exc)[-300:]})
        continue
    ttgir, ptx = compiled.asm["ttgir"], compiled.asm["ptx"]
    buffers = [int(n) for n in re.findall(r"memdesc<(\d+)x\d+x\d+x", ttgir)]
    results.append({"name": name, "cubin": len(compiled.asm["cubin"]) > 0,
                    "mma": "mma" in ptx, "stages": options["num_stages"],
                    "waits": [int(n) for n in re.findall(r"async_wait.*?num = (\d+)", ttgir)],
                    "buffers": max(buffers, default=0)})
print(json.dumps(results))
"""

#: (id, kernel, dtype, kv_cache_dtype, head_dim, block_size, q_lens, capability, stages
#: or None for the table's).
CONFIGS = [
    ("split-bf16-d128-sm90", "split", "bfloat16", "auto", 128, 16, None, 90, None),
    ("split-fp16-e5m2-d64-bs1-sm80", "split", "float16", "fp8_e5m2", 64, 1, None, 80, None),
    ("split-fp32-d80-bs48-sm90", "split", "float32", "auto", 80, 48, None, 90, None),
    ("split-bf16-e4m3-d256-sm90", "split", "bfloat16", "fp8_e4m3", 256, 16, None, 90, None),
    ("prefill-fp16-e4m3-d64-bs48-sm90", "prefill", "float16", "fp8_e4m3", 64, 48, [1, 40], 90,
     None),
    ("prefill-bf16-d128-sm90", "prefill", "bfloat16", "auto", 128, 16, [3, 200], 90, None),
    ("merge-bf16-d128-sm80", "merge", "bfloat16", "auto", 128, 16, None, 80, None),
    ("prefill-bf16-d128-sm90-2stages", "prefill", "bfloat16", "auto", 128, 16, [3, 200], 90, 2),
    ("split-bf16-e4m3-sm80", "split", "bfloat16", "fp8_e4m3", 128, 16, None, 80, None),
]


@pytest.fixture(scope="module")
def compiled() -> dict[str, dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # triton 3.9's default, said aloud
    done = subprocess.run([sys.executable, "-c", _SCRIPT, json.dumps(CONFIGS)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return {r["name"]: r for r in json.loads(done.stdout.splitlines()[-1])}


@pytest.mark.parametrize("config", CONFIGS[:6], ids=lambda c: c[0])
def test_kernel_compiles_with_tensor_cores_and_a_pipelined_key_loop(compiled, config):
    result = compiled[config[0]]
    assert "error" not in result, result
    assert result["cubin"]
    assert result["mma"] == (config[2] != "float32"), result
    assert result["stages"] == 3
    assert result["buffers"] >= 2, result
    assert max(result["waits"]) > 0, result


def test_merge_kernel_compiles(compiled):
    result = compiled["merge-bf16-d128-sm80"]
    assert result["cubin"] and not result["mma"], result  # no dot: a weighted sum


def test_two_stages_leave_the_copies_unoverlapped(compiled):
    result = compiled["prefill-bf16-d128-sm90-2stages"]
    assert result["cubin"] and result["waits"] and max(result["waits"]) == 0, result


def test_fp8_e4m3_does_not_compile_for_sm80(compiled):
    assert "fp8e4nv not supported in this architecture" in compiled["split-bf16-e4m3-sm80"]["error"]
