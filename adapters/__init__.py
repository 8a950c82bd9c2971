"""Adapters: one module per implementation, behind the contract in :mod:`.base`.

:data:`BUILTIN` lists the in-tree implementations explicitly, name -> ``"module:Class"``;
its order is the leaderboard's column order. Out-of-tree implementations register through
the entry-point group ``pagedbench.adapters`` (name = value ``"module:Class"``) and
follow the built-ins; the entry point's name is the implementation's name.

:func:`entries` finds every implementation without importing any of them, so that a
plug-in that exits, crashes or hangs at import cannot take a command down: the runner
imports each one (:func:`~.loading.load`) inside its own worker process.
:func:`registry` imports them all in this process, for the pytest suites.

Finding them imports neither torch nor any adapter: the contract's names (``Adapter``,
``Capabilities``, ...), ``load`` and ``Unloadable`` are imported from :mod:`.base` and
:mod:`.loading` when first used (PEP 562), so a command lists its implementations and
refuses a bad one before torch is imported.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import TYPE_CHECKING

import lazy_loader

ENTRY_POINT_GROUP = "pagedbench.adapters"

#: In-tree implementations by name, in leaderboard order.
BUILTIN: dict[str, str] = {
    "sdpa-contiguous": "pagedbench.adapters.torch_sdpa:SdpaContiguous",
    "torch-gather": "pagedbench.adapters.torch_sdpa:TorchGather",
    "pagedbench-triton": "pagedbench.adapters.triton_decode:TritonPagedDecode",
    "pagedbench-triton-split": "pagedbench.adapters.triton_paged:TritonSplitDecode",
    "pagedbench-triton-prefill": "pagedbench.adapters.triton_paged:TritonPrefill",
    "flex-paged": "pagedbench.adapters.flex_paged:FlexPaged",
    "vllm-cpu": "pagedbench.adapters.vllm_cpu:VllmCpu",
    "vllm-cpu-mla": "pagedbench.adapters.vllm_cpu_mla:VllmCpuMla",
    "vllm-cpu-mla-decode": "pagedbench.adapters.vllm_cpu_mla:VllmCpuMlaDecode",
    "vllm-cpu-mla-extend": "pagedbench.adapters.vllm_cpu_mla:VllmCpuMlaExtend",
    "vllm-unified": "pagedbench.adapters.vllm_triton:VllmUnified",
    "vllm-decode": "pagedbench.adapters.vllm_triton:VllmDecode",
    "vllm-chunked-prefill": "pagedbench.adapters.vllm_triton:VllmChunkedPrefill",
    "sglang-decode": "pagedbench.adapters.sglang_triton:SglangDecode",
    "sglang-extend": "pagedbench.adapters.sglang_triton:SglangExtend",
    "lmdeploy-decode": "pagedbench.adapters.lmdeploy_triton:LmdeployDecode",
    "lmdeploy-prefill": "pagedbench.adapters.lmdeploy_triton:LmdeployPrefill",
    "transformers-paged": "pagedbench.adapters.transformers_paged:TransformersPaged",
    "flashinfer-nhd": "pagedbench.adapters.flashinfer:FlashInferNHD",
    "flashinfer-hnd": "pagedbench.adapters.flashinfer:FlashInferHND",
    "flashinfer-mla": "pagedbench.adapters.flashinfer:FlashInferMla",
    "flash-mla": "pagedbench.adapters.flash_mla:FlashMla",
    "flash-attn2": "pagedbench.adapters.flash_attn:FlashAttn2",
    "flash-attn3": "pagedbench.adapters.flash_attn:FlashAttn3",
    "xformers": "pagedbench.adapters.xformers:XformersSplitK",
    "vllm-cuda-flash-attn": "pagedbench.adapters.vllm_cuda:VllmCudaFlashAttn",
}


@dataclass(frozen=True)
class Entry:
    """An implementation as found, not imported: its name, ``"module:Class"`` target and
    whether it is in-tree."""

    name: str
    target: str
    builtin: bool


def entries() -> list[Entry]:
    """Built-ins, then the entry points of :data:`ENTRY_POINT_GROUP`, without importing
    any. An entry point whose name is already taken is skipped with a warning naming both
    targets."""
    found = {name: Entry(name, target, True) for name, target in BUILTIN.items()}
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name in found:
            if found[ep.name].target != ep.value:
                warnings.warn(f"entry point {ep.name!r} = {ep.value!r} ignored: the name is "
                              f"already {found[ep.name].target!r}", stacklevel=2)
            continue
        found[ep.name] = Entry(ep.name, ep.value, False)
    return list(found.values())


def registry() -> dict[str, tuple[str, Adapter]]:
    """Every adapter imported in this process: ``{name: (target, adapter)}``, in
    leaderboard order (for the pytest suites; commands never import plug-ins in their own
    process). A built-in that fails to load is a bug and raises; an entry-point adapter
    that raises at import becomes an :class:`Unloadable`."""
    from .loading import Unloadable, load

    out: dict[str, tuple[str, Adapter]] = {}
    for entry in entries():
        try:
            adapter = load(entry.target)
        except Exception as exc:
            if entry.builtin:
                raise
            adapter = Unloadable(entry.name, entry.target, exc)
        out[entry.name] = (entry.target, adapter)
    return out


#: The contract's names, imported when first used, by the module of this package that
#: defines each.
_NAMES_BY_MODULE = {"base": ["Adapter", "Availability", "Capabilities", "MultipleOf"],
                    "loading": ["Unloadable", "load"]}
__getattr__, _lazy_dir, _ = lazy_loader.attach(__name__, submod_attrs=_NAMES_BY_MODULE)


def __dir__() -> list[str]:
    """This module's names and the contract's, imported or not."""
    return sorted({*globals(), *_lazy_dir()})


if TYPE_CHECKING:  # for type checkers and the import graph (suites/docs/test_architecture.py)
    from .base import Adapter, Availability, Capabilities, MultipleOf
    from .loading import Unloadable, load


__all__ = [
    "BUILTIN",
    "ENTRY_POINT_GROUP",
    "Adapter",
    "Availability",
    "Capabilities",
    "Entry",
    "MultipleOf",
    "Unloadable",
    "entries",
    "load",
    "registry",
]
