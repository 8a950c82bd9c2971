"""The process environment of every pagedbench process (the one place it is set).

- :func:`cache_environment`: compiler caches, matplotlib's cache and the temp folder of
  the CLI, its workers, the test session and the GPU lane's steps, under one folder
  (``build/`` by default), never the home folder or the system temp folder
  (TorchInductor's precompiled headers follow ``TMPDIR``), and the failing cases that
  conformance failures write for ``pagedbench replay``. A variable the user has already
  set is kept.
- :func:`worker_environment`: what a worker process starts with: those caches, the
  Triton interpreter on the CPU, and only the variables of the parent a worker needs
  (:data:`INHERITED`): no credentials, nothing that changes how files are loaded
  (``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD``).
- :func:`apply_environment`: set variables in this process.
- :func:`heavy_imports`: how a process that imports once, then works (the CLI, a worker,
  a test session's collection) imports torch, the harness and the implementations:
  without cyclic garbage collection, then frozen.

Standard library only: the GPU lane imports it before torch.
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path

#: The variable that names the cache folder when no option does (the CLI's
#: ``--cache-dir``, the pytest plugin's ``--pagedbench-cache-dir``).
CACHE_DIR_VARIABLE = "PAGEDBENCH_CACHE_DIR"
#: The cache folder when neither an option nor :data:`CACHE_DIR_VARIABLE` names one.
DEFAULT_CACHE_DIR = Path("build")
#: Cache and scratch variables, and their folder under the cache folder.
CACHE_FOLDERS = {
    "TRITON_CACHE_DIR": "triton-cache",
    "TORCHINDUCTOR_CACHE_DIR": "inductor-cache",
    "FLASHINFER_WORKSPACE_BASE": "flashinfer",
    "XDG_CACHE_HOME": "xdg-cache",
    "MPLCONFIGDIR": "matplotlib",
    "TMPDIR": "tmp",
    "PAGEDBENCH_REPLAY_DIR": "replay",  # failing cases (harness/run/replay.py)
    # Bytecode, and pytest's assertion-rewritten modules, out of the source tree and kept
    # between processes (without it, each pytest run rewrote and compiled ~130 modules).
    "PYTHONPYCACHEPREFIX": "pycache",
}
#: Variables a worker inherits from its parent: exact names, and prefixes ending in
#: ``_`` (locale, CUDA and ROCm runtimes, thread pools, compilers, the peers' own
#: settings).
INHERITED = (
    "PATH", "HOME", "USER", "LOGNAME", "LANG", "LANGUAGE", "TZ", "TERM",
    "PYTHONPATH", "PYTHONHASHSEED", "PYTHONUNBUFFERED", "PYTHONWARNINGS", "PYTHONFAULTHANDLER",
    "VIRTUAL_ENV", "LD_LIBRARY_PATH", "CC", "CXX",
    "TORCH_CUDA_ARCH_LIST", "TORCH_EXTENSIONS_DIR",
    "LC_", "CUDA_", "NVIDIA_", "HIP_", "ROCM_", "ROCR_", "OMP_", "MKL_", "KMP_",
    "TRITON_", "TORCHINDUCTOR_", "VLLM_", "FLASHINFER_", "XFORMERS_", "PAGEDBENCH_",
)


def default_cache_dir(inherited: Mapping[str, str] | None = None) -> Path:
    """The cache folder of a command or test session given none: ``$PAGEDBENCH_CACHE_DIR``
    of ``inherited`` (default: this process's environment), else ``build``."""
    inherited = os.environ if inherited is None else inherited
    return Path(inherited.get(CACHE_DIR_VARIABLE) or DEFAULT_CACHE_DIR)


def cache_environment(cache_dir: Path, inherited: Mapping[str, str] | None = None, *,
                      create: bool = True) -> dict[str, str]:
    """The cache and scratch variables (:data:`CACHE_FOLDERS`): each one already set in
    ``inherited`` (default: this process's environment) as it is, the others under
    ``cache_dir``. The folders are created, unless ``create`` is false (a read-only
    command: whatever it happens to cache goes there if it makes the folder itself).

    Raises
    ------
    OSError
        If a folder cannot be created (the CLI checks ``--cache-dir`` before).
    """
    inherited = os.environ if inherited is None else inherited
    root = Path(cache_dir).resolve()
    env = {name: inherited.get(name) or str(root / folder)
           for name, folder in CACHE_FOLDERS.items()}
    for folder in env.values() if create else ():
        Path(folder).mkdir(parents=True, exist_ok=True)
    return env


def _inherited(name: str) -> bool:
    return any(name.startswith(entry) if entry.endswith("_") else name == entry
               for entry in INHERITED)


def worker_environment(device: str, cache_dir: Path,
                       parent: Mapping[str, str] | None = None) -> dict[str, str]:
    """The whole environment of a worker process: the parent's (default: this process's)
    variables named by :data:`INHERITED`, :func:`cache_environment`, and
    ``TRITON_INTERPRET=1`` when ``device`` is the CPU (Triton reads it when a kernel is
    decorated, i.e. at import)."""
    parent = os.environ if parent is None else parent
    env = {name: value for name, value in parent.items() if _inherited(name)}
    env |= cache_environment(cache_dir, parent)
    if device.split(":")[0] == "cpu":
        env["TRITON_INTERPRET"] = "1"
    return env


def apply_environment(env: Mapping[str, str]) -> None:
    """Set ``env`` in this process, make :mod:`tempfile` read ``TMPDIR`` again (it
    caches the temp folder at first use; TorchInductor derives its precompiled-header
    folder from it when ``torch._inductor.codecache`` is first imported), and write the
    bytecode of modules imported from now on under ``PYTHONPYCACHEPREFIX`` (Python reads
    the variable only at start-up) if that folder exists (a read-only command's
    :func:`cache_environment` creates none, and Python would make it)."""
    os.environ.update(env)
    tempfile.tempdir = None
    prefix = env.get("PYTHONPYCACHEPREFIX")
    if prefix and sys.pycache_prefix is None and os.path.isdir(prefix):
        sys.pycache_prefix = prefix


@contextlib.contextmanager
def heavy_imports() -> Iterator[None]:
    """Import inside this: Python's cyclic garbage collector is off, then every object made
    so far is frozen (``gc.freeze``: left out of every later collection, never freed) and
    the collector is as it was. An import makes many objects that live as long as the
    process and little garbage, so collections during it only walk them again, and each
    full collection afterwards would walk them all (torch's ~180,000), in a timed call if
    it falls there. Only for a process that imports once and then works (the console
    script, a worker, a test session's collection); the CLI called in-process does not."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if enabled:
            gc.enable()


__all__ = ["CACHE_FOLDERS", "INHERITED", "apply_environment", "cache_environment",
           "heavy_imports", "worker_environment"]
