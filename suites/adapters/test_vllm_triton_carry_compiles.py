"""vLLM's carried Triton kernels compile for sm_90 as the adapters launch them, on a
machine without a GPU and without vLLM.

A fresh process without ``TRITON_INTERPRET``, where ``import vllm`` fails, loads the kernels
from a carry built here (:mod:`pagedbench.adapters.vllm_triton_carry`), replaces each
``@triton.jit`` kernel's ``run`` so that the adapters' calls at Llama-3-8B decode shapes
(bf16, 32 query / 8 KV heads, head_dim 128) record their launches instead of running,
and compiles each recorded launch ahead of time for sm_90
(:func:`pagedbench.harness.lane.compile_check.compile_like_launch`): every one gives a cubin,
with tensor cores (``mma``) where the kernel has a ``tl.dot``. Run with
``PYTHONPATH=<a triton 3.6 --target folder>`` it checks the GPU lane's Triton. About 20 s.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib.util import find_spec

import pytest

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(find_spec("vllm") is None or find_spec("triton") is None,
                       reason="vllm (the carry's source) or triton is not installed"),
]

_SCRIPT = r"""
import json, sys
sys.modules["vllm"] = None  # as on the device
import triton
from triton.runtime.jit import JITFunction
from pagedbench.adapters import vllm_triton
from pagedbench.reference import PagedCase, materialize
from pagedbench.harness.lane.compile_check import compile_like_launch

kernels, reason = vllm_triton._loaded()
assert kernels is not None, reason
launches = []


def record(namespace):
    for name, obj in namespace.items():
        if isinstance(obj, JITFunction):
            def run(*args, grid, warmup, _name=name, _kernel=obj, **kwargs):
                launches.append((_name, _kernel, args, kwargs))
            obj.run = run


for family in (kernels.unified, kernels.decode, kernels.chunked):
    record(family.entry.__globals__)


llama = dict(num_q_heads=32, num_kv_heads=8, head_dim=128, dtype="bfloat16")
small_batch = PagedCase(kv_lens=(300, 4000), block_size=16, **llama)  # unified: 3D
large_batch = PagedCase(kv_lens=(300,) * 20, block_size=64, **llama)  # unified: 2D
adapters = [(vllm_triton.VllmUnified(), small_batch), (vllm_triton.VllmUnified(), large_batch),
            (vllm_triton.VllmDecode(), small_batch),
            (vllm_triton.VllmChunkedPrefill(), small_batch)]
results = {"source": kernels.source, "triton": triton.__version__, "launches": []}
for adapter, case in adapters:
    launches.clear()
    adapter.run(adapter.prepare(materialize(case, "cpu")))
    for name, kernel, args, kwargs in launches:
        entry = {"id": f"{adapter.name}-bs{case.block_size}-{name}"}
        try:
            compiled = compile_like_launch(kernel, args, kwargs, 90)
            entry |= {"cubin": len(compiled.asm["cubin"]) > 0, "mma": "mma" in compiled.asm["ptx"]}
        except Exception as exc:
            entry["error"] = f"{type(exc).__name__}: {str(exc)[-400:]}"
        results["launches"].append(entry)
print(json.dumps(results))
"""

#: Each launch the four calls make, and whether its kernel multiplies on tensor cores.
EXPECTED = {
    "vllm-unified-bs16-kernel_unified_attention": True,
    "vllm-unified-bs16-reduce_segments": False,
    "vllm-unified-bs64-kernel_unified_attention": True,
    "vllm-decode-bs16-_fwd_grouped_kernel_stage1": True,
    "vllm-decode-bs16-_fwd_kernel_stage2": False,
    "vllm-chunked-prefill-bs16-kernel_paged_attention_2d": True,
}


def test_carried_kernels_compile_for_sm90(tmp_path) -> None:
    from pagedbench.adapters.vllm_triton_carry import CARRY_ENV
    from pagedbench.harness.lane import carry as gpu_carry

    gpu_carry.copy_vllm_triton(tmp_path / "vllm-triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env |= {CARRY_ENV: str(tmp_path / "vllm-triton"), "TRITON_CACHE_DIR": str(tmp_path / "tc")}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # triton 3.9's default, said aloud
    done = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    results = json.loads(done.stdout.splitlines()[-1])
    assert results["source"].startswith("carried vllm ")
    launches = {entry["id"]: entry for entry in results["launches"]}
    assert launches.keys() == EXPECTED.keys(), results
    for name, mma in EXPECTED.items():
        assert "error" not in launches[name], launches[name]
        assert launches[name]["cubin"] and launches[name]["mma"] == mma, launches[name]
