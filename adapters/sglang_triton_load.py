"""SGLang's Triton attention kernels, loaded from its wheel's files without importing SGLang.

``import sglang`` pulls in its whole server, so the adapters never import it. At install
time the Makefile's venv step runs ``python -m pagedbench.adapters.sglang_triton_load``:
``pip download --no-deps`` of the pinned wheel (:data:`SGLANG_VERSION`, :data:`WHEEL_TAGS`)
into ``build/wheels``, then the files of :data:`FILES` extracted into
``build/sglang-triton`` (:data:`DEFAULT_DIR`; ``PAGEDBENCH_SGLANG_TRITON_DIR`` names
another folder, as the GPU lane's carry does). :func:`load_kernels` checks every file's
sha256 against :data:`FILES` before executing any, then executes those verified bytes
(``linecache`` primed, so that Triton's ``inspect.getsource`` reads them too) and leaves
``sys.modules`` as it was: ``import sglang`` still fails in the process. The mechanics are
:class:`~.pinned_files.PinnedFiles`' (:data:`SGLANG_TRITON`).

The files import two SGLang modules that pull in most of SGLang; :func:`stand_ins` builds
stand-ins holding only the names the files use, each with SGLang 0.5.23's meaning, and
:func:`unmet_names` lists any use they do not cover (a test holds it empty):

- ``sglang.srt.utils`` (``sglang/srt/utils/common.py``): ``is_hip`` (torch built for
  ROCm), ``is_cuda``, ``get_device_core_count`` (the CUDA device's multiprocessor count,
  0 without one), ``is_gfx95_supported`` / ``is_gfx1250_supported`` (False: the adapters
  refuse ROCm builds of torch, and the files ask only when ``is_hip()``);
- ``sglang.srt.environ`` (``sglang/srt/environ.py``): ``envs``, the environment variables
  the files read, each parsed as SGLang's ``EnvBool`` / ``EnvFloat`` with its default
  (each is read only on ROCm paths, behind ``is_hip()`` or a gfx check);
- ``sglang``, ``sglang.srt``, ``sglang.kernels``, ``sglang.kernels.ops``,
  ``sglang.kernels.ops.attention``: empty packages, so the files' imports of each other
  resolve. ``sglang.srt.runtime_context`` is imported inside ``_keep_scheduler_splits``,
  reached on ROCm only (:data:`UNREACHED_IMPORTS`).
"""

from __future__ import annotations

import ast
import os
import sys
import types
from dataclasses import dataclass
from pathlib import Path

from .pinned_files import (PinnedFiles, PinnedFilesInvalid, link_parents, module_path,
                           package_module)

SGLANG_VERSION = "0.5.23"
#: The one wheel of that release (CPython 3.11, manylinux 2.34, x86-64): pip matches each
#: tag exactly, so the same file is fetched whatever the host's interpreter.
WHEEL_TAGS = ("--python-version", "3.11", "--implementation", "cp", "--abi", "cp311",
              "--platform", "manylinux_2_34_x86_64", "--only-binary=:all:")
#: Module -> sha256 of its file in sglang 0.5.23's wheel. Order: dependencies first.
FILES: dict[str, str] = {
    "sglang.kernels.ops.attention.score_mod":
        "127e2e6466bbfac3c2189cc4f2a9d7751fd819b30d25de65378d66ae63bbafa6",
    "sglang.kernels.ops.attention.metadata":
        "8aa5db57763f5ecfb01a05beba74791d0bf3921952c789d8a8432abf25c231ca",
    "sglang.kernels.ops.attention.decode_attention":
        "7a3b66ce3daabbb027efd860411cd9abe4b399b1f2cfc3ed5c6c01731eb9fa0a",
    "sglang.kernels.ops.attention.extend_attention":
        "be3baffc80ef9fe484d0b896842522b02bf671785088e05a66ca4dcdb2e8a9b3",
}
DIR_ENV = "PAGEDBENCH_SGLANG_TRITON_DIR"
DEFAULT_DIR = Path(__file__).resolve().parent.parent / "build" / "sglang-triton"
UNREACHED_IMPORTS = {
    "sglang.srt.runtime_context": "decode_attention._keep_scheduler_splits imports it; only "
                                  "ROCm's tuned MLA path calls that",
}
_PACKAGES = ("sglang", "sglang.srt", "sglang.kernels", "sglang.kernels.ops",
             "sglang.kernels.ops.attention")
#: The environment variables the files read through ``envs``: name -> (SGLang's default,
#: its parser's type).
ENV_VARS: dict[str, tuple[object, type]] = {
    "SGLANG_TRITON_DECODE_ATTN_STATIC_KV_SPLITS": (False, bool),
    "SGLANG_MLA_DECODE_TUNE": (False, bool),
    "SGLANG_FORCE_LEAN_GRID_CU_MULT": (1.0, float),
    "SGLANG_TRITON_FP8_PREFILL_ATTN": (True, bool),
    "SGLANG_TRITON_COMPACT_EXTEND_ATTENTION": (True, bool),
}


#: The files as :class:`~.pinned_files.PinnedFiles`: reading, checking, extracting, loading.
SGLANG_TRITON = PinnedFiles("sglang", SGLANG_VERSION, WHEEL_TAGS, FILES, DIR_ENV, DEFAULT_DIR)
#: Raised when the files cannot be used: missing, changed, or they do not load with the
#: stand-ins; the message names the file.
SglangFilesInvalid = PinnedFilesInvalid


def files_dir() -> Path:
    """Where the extracted files are: ``$PAGEDBENCH_SGLANG_TRITON_DIR`` or :data:`DEFAULT_DIR`."""
    return SGLANG_TRITON.files_dir()


def read_files(folder: Path) -> dict[str, bytes]:
    """Module -> the bytes of its file under ``folder``, each checked against :data:`FILES`.

    Raises
    ------
    SglangFilesInvalid
        If a file is absent or its sha256 differs from the pinned one.
    """
    return SGLANG_TRITON.read(folder)


class _EnvVar:
    """One of SGLang's ``EnvBool`` / ``EnvFloat`` fields: :meth:`get` reads the variable,
    or returns the default when it is unset."""

    def __init__(self, name: str, default: object, kind: type) -> None:
        self.name, self.default, self.kind = name, default, kind

    def get(self) -> object:
        value = os.environ.get(self.name)
        if value is None:
            return self.default
        if self.kind is bool:
            if value.lower() in ("true", "1", "yes", "y"):
                return True
            if value.lower() in ("false", "0", "no", "n"):
                return False
            raise ValueError(f'{self.name}: "{value}" is not a valid boolean value')
        return self.kind(value)


def _core_count(device_id: int = 0) -> int:
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(device_id).multi_processor_count
    return 0


def stand_ins() -> dict[str, types.ModuleType]:
    """The stand-in modules (module docstring), by module name."""
    import torch

    modules = {name: package_module(name, "a package of SGLang's kernel files")
               for name in _PACKAGES}
    envs = types.SimpleNamespace(**{name: _EnvVar(name, default, kind)
                                    for name, (default, kind) in ENV_VARS.items()})
    modules |= {
        "sglang.srt.environ": package_module("sglang.srt.environ",
                                             "the variables the kernels read", envs=envs),
        "sglang.srt.utils": package_module(
            "sglang.srt.utils", "the device questions the kernels ask",
            is_hip=lambda: torch.version.hip is not None,
            is_cuda=lambda: torch.cuda.is_available() and torch.version.cuda is not None,
            is_gfx95_supported=lambda: False,
            is_gfx1250_supported=lambda: False,
            get_device_core_count=_core_count),
    }
    return link_parents(modules)


@dataclass(frozen=True)
class SglangTritonKernels:
    """The loaded modules.

    Attributes
    ----------
    decode : types.ModuleType
        ``decode_attention`` (``decode_attention_fwd``, ``_fwd_kernel_stage1``, ...).
    extend : types.ModuleType
        ``extend_attention`` (``extend_attention_fwd``, ``_fwd_kernel``, ...).
    metadata : types.ModuleType
        ``metadata`` (``get_num_kv_splits_triton``, the backend's split heuristic).
    version : str
    source : str
        What results record: the version, and that each file was checked.
    folder : Path
        Where the files were read.
    """

    decode: types.ModuleType
    extend: types.ModuleType
    metadata: types.ModuleType
    version: str
    source: str
    folder: Path


def load_kernels(folder: Path | None = None) -> SglangTritonKernels:
    """The kernel modules from ``folder`` (default :func:`files_dir`), sha256-checked.

    Raises
    ------
    SglangFilesInvalid
        As :func:`read_files`, or if a file fails to load with the stand-ins.
    ImportError
        If triton is not installed.
    """
    import triton  # noqa: F401  (the files need it; fail here with its own error)

    folder, loaded = SGLANG_TRITON.load(stand_ins(), folder)
    attention = "sglang.kernels.ops.attention."
    return SglangTritonKernels(
        decode=loaded[attention + "decode_attention"],
        extend=loaded[attention + "extend_attention"],
        metadata=loaded[attention + "metadata"],
        version=SGLANG_VERSION,
        source=SGLANG_TRITON.source,
        folder=folder,
    )


def unmet_names(sources: dict[str, bytes]) -> list[str]:
    """Each use in the files of an SGLang module or name that neither a loaded file, a
    stand-in nor :data:`UNREACHED_IMPORTS` provides (:meth:`PinnedFiles.unmet_imports`),
    then each attribute of ``envs`` no stand-in has, as ``"<file>:<line>: <name>"``;
    empty when the stand-ins cover the files."""
    modules = stand_ins()
    envs = modules["sglang.srt.environ"].envs
    unmet = SGLANG_TRITON.unmet_imports(sources, modules, "sglang", UNREACHED_IMPORTS)
    for module, data in sources.items():
        unmet += [f"{module_path(module)}:{node.lineno}: envs.{node.attr}"
                  for node in ast.walk(ast.parse(data, module_path(module)))
                  if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                  and node.value.id == "envs" and not hasattr(envs, node.attr)]
    return unmet


def extract(wheel: Path, out: Path) -> list[Path]:
    """Write the files of :data:`FILES` from ``wheel`` under ``out`` (their wheel paths),
    each checked against its pinned sha256 first; returns the paths written.

    Raises
    ------
    SglangFilesInvalid
        If a file is missing from the wheel or differs from its pinned sha256.
    """
    return SGLANG_TRITON.extract(wheel, out)


if __name__ == "__main__":
    sys.exit(SGLANG_TRITON.main(None, "pagedbench.adapters.sglang_triton_load",
                                "its Triton attention kernel files"))
