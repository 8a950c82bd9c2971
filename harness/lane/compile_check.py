"""``make gpu-compile-check``: every Triton kernel the GPU lane runs, compiled for sm_90 with
the GPU machine's Triton, on a machine without a GPU.

    python -m pagedbench.harness.lane.compile_check [--venv build/triton-3.6.0]
        [--triton 3.6.0] [--out FILE] [--impl NAME ...]

The check runs in a virtual environment of its own (:func:`make_venv`: ``triton==3.6.0``,
the version on the lane's GPU machine, over this interpreter's other packages, pagedbench
through ``scripts/gpu_shim.py``), without ``TRITON_INTERPRET``. There, each Triton
implementation of the lane (:data:`LANE_TRITON_IMPLS`: ours, vLLM's from a carry made
here as ``make gpu-carry`` makes it, SGLang's and LMDeploy's from the files ``make`` extracted,
xformers' split-k) prepares and runs a miniature of each of the lane's sweep points and
its conformance cases with ``JITFunction.run`` recording the launches instead of running
them (:func:`record_launches`; xformers' op is applied directly, past its dispatcher's
device check, with an H200's compute capability and SM count), and each distinct launch
is compiled ahead of time for ``GPUTarget("cuda", 90, 32)`` with the ``ptxas`` in the
triton wheel, as ``kernel[grid](...)`` would compile it (:func:`compile_like_launch`).

Writes a JSON report (``--out``) and prints a line per compile; exit 0 when every launch
compiled to a cubin, 1 when one did not (named, with Triton's error) or an implementation
launched nothing, 2 when the Triton found is not ``--triton``'s version. Its compiles,
seconds and memory are measured in docs/gpu-lane.md; CI runs it after ``make test``
(``.ci/run``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import sysconfig
import tempfile
import time
import types
import venv
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from pagedbench.harness.lane import BUILD, ROOT
from pagedbench.harness.run.environment import cache_environment

#: The GPU machine's Triton, and the target compiled for (an H200: sm_90, warp size 32).
DEVICE_TRITON = "3.6.0"
CAPABILITY = 90
#: The lane's implementations whose kernels are Triton's (flex-paged's are TorchInductor's
#: and compile only against a device; FlashInfer's are CUDA, built by ``make gpu-carry``).
LANE_TRITON_IMPLS = ("pagedbench-triton", "pagedbench-triton-split", "pagedbench-triton-prefill",
                     "vllm-unified", "vllm-decode", "vllm-chunked-prefill", "sglang-decode",
                     "sglang-extend", "lmdeploy-decode", "lmdeploy-prefill", "xformers")
#: The GPU the launches are planned for: an H200's SMs (its split heuristics read them).
H200_SM_COUNT = 132


def compile_like_launch(kernel: Any, args: tuple, kwargs: dict, capability: int) -> Any:
    """``kernel`` (a ``JITFunction``) compiled for compute capability ``capability`` (e.g.
    90) as ``kernel[grid](*args, **kwargs)`` would compile it: integers equal to 1 become
    constants, multiples of 16 and aligned pointers get ``tt.divisibility``, through the
    internals ``JITFunction.run`` uses in Triton 3.6 to 3.9 (``triton/runtime/jit.py``);
    ``kwargs`` holds the constexprs and launch options (``num_warps``, ``num_stages``).
    Returns the ``CompiledKernel``; raises what Triton raises."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.compiler import ASTSource
    from triton.runtime.jit import create_function_from_signature

    target = GPUTarget("cuda", capability, 32)
    backend = CUDABackend(target)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound,
                                                              specialization, options)
    return triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=target,
                          options=options.__dict__)


def launch_key(kernel: Any, args: tuple, kwargs: dict) -> str:
    """What makes two launches one compile: the kernel and what Triton compiles it from
    (the signature with its dtypes and constants, the constexprs, the divisibility
    attributes, the options), as :func:`compile_like_launch` derives them."""
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.runtime.jit import create_function_from_signature

    backend = CUDABackend(GPUTarget("cuda", CAPABILITY, 32))
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    packed = kernel._pack_args(backend, kwargs, bound, specialization, options)
    return repr((kernel.fn.__module__, kernel.fn.__qualname__, packed))


@contextlib.contextmanager
def recording() -> Iterator[list[tuple[Any, tuple, dict]]]:
    """Within it, every ``JITFunction`` launch is appended to the list it gives as
    ``(kernel, args, kwargs)`` instead of running; and CUDA and Triton's driver report an
    H200 (compute capability 9.0, :data:`H200_SM_COUNT` SMs) to what asks while planning."""
    import torch
    from triton.backends.compiler import GPUTarget
    from triton.runtime.driver import driver
    from triton.runtime.jit import JITFunction

    launches: list[tuple[Any, tuple, dict]] = []

    def run(self, *args, grid, warmup, **kwargs):
        launches.append((self, args, kwargs))

    saved = (JITFunction.run, torch.cuda.get_device_capability,
             torch.cuda.get_device_properties, torch.cuda.current_device)
    JITFunction.run = run
    torch.cuda.get_device_capability = lambda *a, **k: (CAPABILITY // 10, CAPABILITY % 10)
    torch.cuda.get_device_properties = lambda *a, **k: types.SimpleNamespace(
        multi_processor_count=H200_SM_COUNT, major=CAPABILITY // 10, minor=CAPABILITY % 10,
        name="NVIDIA H200")
    torch.cuda.current_device = lambda: 0
    # Triton's own driver, which LMDeploy asks for the backend, is the H200's too (the
    # attribute is None until a driver is first asked for, so it is put back as it was).
    active = driver._active
    driver.set_active(types.SimpleNamespace(
        get_current_target=lambda: GPUTarget("cuda", CAPABILITY, 32)))
    try:
        yield launches
    finally:
        (JITFunction.run, torch.cuda.get_device_capability, torch.cuda.get_device_properties,
         torch.cuda.current_device) = saved
        driver._active = active


def record_launches(name: str, adapter: Any, inputs: Any) -> list[tuple[Any, tuple, dict]]:
    """The Triton launches of implementation ``name`` (its ``adapter``) on ``inputs``
    (a case's, on the CPU). xformers: ``triton_splitk.FwOp.apply`` on the adapter's
    inputs (its dispatcher refuses CPU tensors before any launch)."""
    with recording() as launches:
        if name == "xformers":
            from xformers.ops.fmha import triton_splitk
            from xformers.ops.fmha.common import Inputs

            from pagedbench.adapters.xformers import paged_bias, xformers_paged

            paged = xformers_paged(inputs)
            triton_splitk.FwOp.apply(Inputs(query=paged.q, key=paged.k, value=paged.v,
                                            attn_bias=paged_bias(paged), scale=inputs.scale),
                                     needs_gradient=False)
        else:
            adapter.run(adapter.prepare(inputs))
    return list(launches)


def check(impls: tuple[str, ...], cases: list[Any],
          on_row: Callable[[dict[str, Any]], None] = lambda row: None) -> list[dict[str, Any]]:
    """Record every launch of ``impls`` on ``cases`` (those each supports on CUDA; each
    case's inputs drawn once, on the CPU) and compile each distinct one
    (:func:`launch_key`); a row per compile: ``impl``, ``kernel``, ``cases`` (how many
    launches it served), ``seconds``, ``cubin_bytes`` and ``mma`` (tensor cores in its
    PTX), or ``error``; ``on_row`` sees each new row when it is done."""
    from pagedbench.adapters import BUILTIN, load
    from pagedbench.reference import materialize

    adapters = {name: load(BUILTIN[name]) for name in impls}
    rows: dict[str, dict[str, Any]] = {}
    for case in cases:
        inputs = None
        for name, adapter in adapters.items():
            if adapter.why_unsupported(case, "cuda"):
                continue
            inputs = inputs or materialize(case, "cpu")
            try:
                launches = record_launches(name, adapter, inputs)
            except Exception as exc:  # noqa: BLE001 (named in the report, the rest go on)
                row = rows[f"{name}:{case.case_id}"] = {
                    "impl": name, "kernel": None, "cases": 1,
                    "error": f"{case.case_id}: {type(exc).__name__}: {exc}"}
                on_row(row)
                continue
            for kernel, args, kwargs in launches:
                key = launch_key(kernel, args, kwargs)
                if key in rows:
                    rows[key]["cases"] += 1
                    continue
                row = rows[key] = {"impl": name, "kernel": kernel.fn.__name__, "cases": 1}
                start = time.monotonic()
                try:
                    compiled = compile_like_launch(kernel, args, kwargs, CAPABILITY)
                    row |= {"cubin_bytes": len(compiled.asm["cubin"]),
                            "mma": "mma" in compiled.asm["ptx"]}
                except Exception as exc:  # noqa: BLE001 (Triton's compile errors vary)
                    row["error"] = f"{type(exc).__name__}: {str(exc)[-1500:]}"
                row["seconds"] = round(time.monotonic() - start, 2)
                on_row(row)
    return list(rows.values())


def lane_cases() -> list[Any]:
    """A miniature of every sweep point of the CUDA lane, then its conformance cases."""
    from pagedbench.harness.lane.sweep import CUDA_SELECTION
    from pagedbench.harness.lane.warmup import miniature

    cases = [miniature(c) for c in CUDA_SELECTION.sweep.cases()]
    cases += CUDA_SELECTION.conformance_cases()
    return list({c.case_id: c for c in cases}.values())


def make_venv(folder: Path, triton_version: str) -> Path:
    """A virtual environment in ``folder`` with ``triton==triton_version`` in its own
    site-packages, ahead of this interpreter's (a ``.pth`` line) and of pagedbench from
    ``scripts/gpu_shim.py``; made once (a ``.installed`` marker). Returns its python.

    Raises
    ------
    subprocess.CalledProcessError
        If the venv or the install fails (no network, no such wheel).
    """
    python = folder / "bin" / "python"
    marker = folder / ".installed"
    if marker.is_file() and marker.read_text() == triton_version:
        return python
    venv.EnvBuilder(with_pip=False, symlinks=True, clear=True).create(folder)
    subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_shim.py"),
                    str(folder / "shim")], check=True, capture_output=True)
    purelib = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig."
                                   "get_paths()['purelib'])"], check=True, text=True,
                                  capture_output=True).stdout.strip())
    (purelib / "host_site.pth").write_text(
        f"{folder.resolve() / 'shim'}\n{sysconfig.get_paths()['purelib']}\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install",
                    "--quiet", "--no-deps", f"triton=={triton_version}"], check=True)
    marker.write_text(triton_version)
    return python


def _vllm_carry(folder: Path) -> None:
    """Make the vLLM Triton files the lane loads (``make gpu-carry``'s copy) and point the
    adapters at them, with ``vllm`` itself not importable, as on the GPU machine."""
    from pagedbench.adapters.vllm_triton_carry import CARRY_ENV
    from pagedbench.harness.lane.carry import copy_vllm_triton

    copy_vllm_triton(folder)
    os.environ[CARRY_ENV] = str(folder)
    sys.modules["vllm"] = None


def inside(impls: tuple[str, ...], triton_version: str, out: Path) -> int:
    """The check in this process (the venv's); its exit status."""
    import triton

    if triton.__version__ != triton_version:
        print(f"gpu_compile_check: triton {triton.__version__} at {triton.__file__}, not "
              f"{triton_version}", file=sys.stderr)
        return 2
    start = time.monotonic()
    with tempfile.TemporaryDirectory(dir=BUILD) as carry:
        if any(name.startswith("vllm-") for name in impls):
            _vllm_carry(Path(carry))
        rows = check(impls, lane_cases(), _print_row)
    failed = [r for r in rows if "error" in r]
    silent = [name for name in impls if not any(r["impl"] == name for r in rows)]
    for name in silent:
        print(f"gpu_compile_check: {name} launched no Triton kernel on the lane's cases",
              file=sys.stderr)
    report = {"triton": triton.__version__, "capability": CAPABILITY, "impls": list(impls),
              "seconds": round(time.monotonic() - start, 1), "compiled": len(rows) - len(failed),
              "failed": len(failed), "kernels": rows}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"gpu-compile-check: {report['compiled']} kernel specializations compiled for "
          f"sm_{CAPABILITY} with triton {triton.__version__}, {len(failed)} failed, in "
          f"{report['seconds']} s; {out}")
    return 1 if failed or silent else 0


def _print_row(row: dict[str, Any]) -> None:
    state = f"error: {row['error'][:200]}" if "error" in row else (
        f"{row['cubin_bytes']} B cubin{', mma' if row['mma'] else ''}, {row['seconds']} s")
    print(f"{row['impl']:<26} {row['kernel'] or '-':<32} {state}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pagedbench.harness.lane.compile_check",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--triton", default=DEVICE_TRITON, metavar="VERSION",
                        help=f"the Triton to compile with (default {DEVICE_TRITON})")
    parser.add_argument("--venv", type=Path, default=None, metavar="DIR",
                        help="its virtual environment (default build/triton-VERSION)")
    parser.add_argument("--out", type=Path, default=BUILD / "gpu-compile-check.json")
    parser.add_argument("--impl", action="append", default=[], choices=LANE_TRITON_IMPLS,
                        metavar="NAME", help="only these (default: every one of "
                                             f"{', '.join(LANE_TRITON_IMPLS)})")
    parser.add_argument("--inside", action="store_true",
                        help="run the check in this interpreter (make_venv's)")
    args = parser.parse_args(argv)
    impls = tuple(args.impl) or LANE_TRITON_IMPLS
    if args.inside:
        return inside(impls, args.triton, args.out)
    try:
        python = make_venv(args.venv or BUILD / f"triton-{args.triton}", args.triton)
    except subprocess.CalledProcessError as exc:
        print(f"gpu_compile_check: making its venv failed: {exc}", file=sys.stderr)
        return 2
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env |= cache_environment(BUILD, env)
    return subprocess.run([str(python), "-m", "pagedbench.harness.lane.compile_check",
                           "--inside", "--triton", args.triton, "--out", str(args.out),
                           *(f"--impl={name}" for name in impls)], env=env).returncode


if __name__ == "__main__":
    sys.exit(main())
