"""The kernel compiles for NVIDIA GPUs, even on a machine without one.

The CPU runs exercise the interpreter, which accepts code the GPU compiler rejects
(``tl.dot`` shapes under 16, mixed operand dtypes, ...). Here a fresh process without
``TRITON_INTERPRET`` plans real launches and compiles them ahead of time to a cubin for
sm_80 and sm_90 with the ``ptxas`` that ships in the triton wheel. Also checked in the
PTX: 16-bit dots use tensor cores (``mma``), and float32 dots do not (``ieee``
precision, not TF32, which would miss the float32 tolerance by orders of magnitude).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

_SCRIPT = r"""
import json, sys
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from pagedbench.kernels import paged_decode as pd
from pagedbench.reference import PagedCase, materialize

assert not pd.kernel_is_interpreted()
POINTER = {torch.float32: "*fp32", torch.float16: "*fp16", torch.bfloat16: "*bf16",
           torch.int32: "*i32"}
results = []
for dtype, head_dim, num_q_heads, block_size, window, cap in json.loads(sys.argv[1]):
    case = PagedCase(kv_lens=(3, 40), num_q_heads=num_q_heads, num_kv_heads=1,
                     head_dim=head_dim, block_size=block_size, dtype=dtype)
    inputs = materialize(case)
    plan = pd.plan_paged_decode(inputs.q, inputs.kv_cache, inputs.block_tables,
                                inputs.kv_lens, inputs.scale, sliding_window=window,
                                logits_soft_cap=cap)
    kernel = pd._paged_decode_kernel
    runtime = [n for n in kernel.arg_names if n not in plan.constexprs]
    signature = {n: POINTER[a.dtype] if isinstance(a, torch.Tensor)
                 else "fp32" if isinstance(a, float) else "i32"
                 for n, a in zip(runtime, plan.args)}
    signature.update({n: "constexpr" for n in plan.constexprs})
    for capability in (80, 90):
        compiled = triton.compile(ASTSource(kernel, signature, plan.constexprs),
                                  target=GPUTarget("cuda", capability, 32),
                                  options={"num_warps": plan.num_warps})
        results.append([dtype, capability, len(compiled.asm["cubin"]) > 0,
                        "mma" in compiled.asm["ptx"]])
print(json.dumps(results))
"""

#: (dtype, head_dim, num_q_heads over one KV head, block_size, sliding_window, soft cap)
CONFIGS = [
    ("bfloat16", 128, 4, 16, None, None),
    ("float16", 256, 8, 1, 64, 30.0),
    ("float32", 80, 5, 48, 9, None),
]


def test_kernel_compiles_for_sm80_and_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # triton 3.9's default, said aloud
    done = subprocess.run([sys.executable, "-c", _SCRIPT, json.dumps(CONFIGS)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    results = json.loads(done.stdout.splitlines()[-1])
    assert len(results) == 2 * len(CONFIGS)
    for dtype, capability, has_cubin, uses_mma in results:
        assert has_cubin, (dtype, capability)
        assert uses_mma == (dtype != "float32"), (dtype, capability, uses_mma)
