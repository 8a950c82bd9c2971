"""FlashInfer's modules for the GPU lane, compiled ahead of time for sm_90a here
(``make gpu-carry``), so that the GPU machine loads them instead of compiling them there.

FlashInfer compiles one module per variant (dtypes, head dims, features) at its first use,
28-31 s each and up to about 120 s (flashinfer-ai/flashinfer#1038); it loads
``flashinfer/data/aot/<name>/<name>.so`` of its own package instead where that file exists
(``flashinfer/jit/env.py``, ``get_aot_artifacts``), which is where ``scripts/gpu_lane.sh``
puts the carry's ``flashinfer-aot/<name>/`` folders after installing the wheel.

- :func:`compiler_venv`: a virtual environment under ``build/`` holding the CUDA 13.0
  compiler from PyPI (:data:`CUDA_COMPILER`: the GPU machine's CUDA is 13.0),
  flashinfer-python (:data:`FLASHINFER`) and this interpreter's packages through a
  ``.pth`` line (torch, apache-tvm-ffi, ninja); ``lib64`` and ``libcudart.so`` links as a
  CUDA install has them, and a stub ``libcuda.so`` (FlashInfer links ``-lcuda``; the GPU
  machine's driver is the real one).
- :func:`decode_module_args`: the variant ``adapters/flashinfer.py``'s decode ``plan()``
  loads for a case (``flashinfer/decode.py``, ``get_batch_decode_module``).
- :func:`build_modules`: each variant compiled there for sm_90a (``FLASHINFER_CUDA_ARCH_LIST
  =9.0a``), its ``.so`` copied to ``<out>/<name>/``, with ``MANIFEST.json`` (versions,
  target, sha256 and seconds of each).

The lane's one decode variant is bf16, head_dim 128; its build time and size are in
docs/gpu-lane.md ("The compile check and the carry, measured").
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import time
import venv
from pathlib import Path

from pagedbench.adapters.flashinfer import TENSOR_CORE_DECODE_MIN_RATIO
from pagedbench.reference import PagedCase

#: The CUDA compiler FlashInfer's JIT runs, from PyPI, at the GPU machine's CUDA (13.0).
CUDA_COMPILER = ("nvidia-cuda-nvcc==13.0.88", "nvidia-cuda-runtime==13.0.96",
                 "nvidia-cuda-cccl==13.0.85", "nvidia-cuda-crt==13.0.88",
                 "nvidia-nvvm==13.0.88")
#: FlashInfer, and the NVML bindings its import needs beyond torch and what this
#: interpreter has (apache-tvm-ffi, requests, tqdm, packaging).
FLASHINFER = ("flashinfer-python==0.7.0.post1", "nvidia-ml-py==13.615.71")
#: The target: Hopper's architecture-specific sm_90a (wgmma), which H100 and H200 run.
CUDA_ARCH = "9.0a"
MANIFEST = "MANIFEST.json"
BUILD_TIMEOUT_S = 1800

_BUILD = r"""
import hashlib, json, shutil, sys, time
from pathlib import Path
import torch
import flashinfer
from flashinfer.jit.attention.modules import gen_batch_decode_module

out = Path(sys.argv[1])
built = []
for args in json.loads(sys.argv[2]):
    dtypes = [getattr(torch, name) for name in args[:4]]
    spec = gen_batch_decode_module(*dtypes, *args[4:])
    start = time.monotonic()
    spec.build()
    seconds = round(time.monotonic() - start, 1)
    target = out / spec.name / f"{spec.name}.so"
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(spec.jit_library_path, target)
    built.append({"name": spec.name, "args": args, "seconds": seconds,
                  "bytes": target.stat().st_size,
                  "sha256": hashlib.sha256(target.read_bytes()).hexdigest()})
print(json.dumps({"flashinfer": flashinfer.__version__, "modules": built}))
"""


def decode_module_args(case: PagedCase) -> list | None:
    """The arguments of FlashInfer's ``gen_batch_decode_module`` that the decode wrapper's
    ``plan()`` passes for ``case`` as adapters/flashinfer.py plans it (q, kv and o in the
    case dtype, int32 indices, ``head_dim`` for QK and VO, no positional encoding, sliding
    window and soft cap as the case has them); None for a case that does not take that
    module (not decode, or a GQA ratio that takes the tensor-core path)."""
    if case.mode != "decode" or case.gqa_ratio >= TENSOR_CORE_DECODE_MIN_RATIO:
        return None
    dtype = case.dtype
    return [dtype, dtype, dtype, "int32", case.head_dim, case.head_dim, 0,
            case.sliding_window is not None, case.logits_soft_cap is not None]


def compiler_venv(folder: Path, timeout_s: float = BUILD_TIMEOUT_S) -> Path:
    """Make (or reuse) :func:`compiler_venv`'s environment in ``folder``; its CUDA_HOME.

    Raises
    ------
    subprocess.CalledProcessError, subprocess.TimeoutExpired
        If pip cannot install the compiler (no network) or the stub cannot be linked.
    """
    python = folder / "bin" / "python"
    if not python.exists():
        venv.EnvBuilder(with_pip=True, symlinks=True).create(folder)
    purelib = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig."
                                   "get_paths()['purelib'])"], capture_output=True,
                                  text=True, check=True).stdout.strip())
    (purelib / "host_site.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([str(python), "-m", "pip", "install", "--quiet", "--no-deps",
                    *CUDA_COMPILER, *FLASHINFER], check=True, timeout=timeout_s)
    cuda_home = purelib / "nvidia" / "cu13"
    lib = cuda_home / "lib"
    for link, target in ((cuda_home / "lib64", "lib"), (lib / "libcudart.so", "libcudart.so.13")):
        if not link.is_symlink():
            link.symlink_to(target)
    (lib / "stubs").mkdir(exist_ok=True)
    subprocess.run(["cc", "-shared", "-o", str(lib / "stubs" / "libcuda.so"),
                    "-Wl,-soname,libcuda.so.1", "-x", "c", os.devnull], check=True,
                   timeout=60)
    return cuda_home


def build_modules(cases: list[PagedCase], out: Path, venv_dir: Path,
                  timeout_s: float = BUILD_TIMEOUT_S) -> dict:
    """Compile the decode modules ``cases`` need (:func:`decode_module_args`, each once)
    for sm_90a into ``out/<name>/<name>.so``; write and return ``out/MANIFEST.json``
    (FlashInfer's version, the target, each module's arguments, seconds, bytes and
    sha256). ``out`` is made afresh.

    Raises
    ------
    subprocess.CalledProcessError, subprocess.TimeoutExpired
        If the environment cannot be made or a module does not compile.
    """
    variants = list({json.dumps(a): a for c in cases
                     if (a := decode_module_args(c)) is not None}.values())
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    cuda_home = compiler_venv(venv_dir, timeout_s)
    workspace = venv_dir / "workspace"
    env = {**os.environ, "CUDA_HOME": str(cuda_home), "FLASHINFER_CUDA_ARCH_LIST": CUDA_ARCH,
           "FLASHINFER_WORKSPACE_BASE": str(workspace),
           "PATH": f"{venv_dir / 'bin'}{os.pathsep}{Path(sys.executable).parent}"
                   f"{os.pathsep}{os.environ.get('PATH', '')}"}
    start = time.monotonic()
    done = subprocess.run([str(venv_dir / "bin" / "python"), "-c", _BUILD, str(out),
                           json.dumps(variants)], env=env, capture_output=True, text=True,
                          timeout=timeout_s)
    if done.returncode != 0:
        raise subprocess.CalledProcessError(done.returncode, "flashinfer AOT build",
                                            done.stdout, done.stderr[-4000:])
    manifest = json.loads(done.stdout.splitlines()[-1]) | {
        "cuda_arch": CUDA_ARCH, "compiler": list(CUDA_COMPILER),
        "seconds": round(time.monotonic() - start, 1)}
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


__all__ = ["CUDA_ARCH", "CUDA_COMPILER", "FLASHINFER", "MANIFEST", "build_modules",
           "compiler_venv", "decode_module_args"]
