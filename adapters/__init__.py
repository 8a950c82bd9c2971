"""Adapters: one module per implementation, behind the contract in :mod:`.base`.

:data:`BUILTIN` lists the in-tree implementations explicitly; its order is the
leaderboard's column order. Out-of-tree implementations register through the entry-point
group ``pagedbench.adapters`` (value ``"module:Class"``) and follow the built-ins.
Adapters are addressed by their ``"module:Class"`` target so that a worker process can
load exactly the same one.
"""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points

from .base import Adapter, Availability, Capabilities, MultipleOf

ENTRY_POINT_GROUP = "pagedbench.adapters"

#: In-tree implementations, in leaderboard order.
BUILTIN: tuple[str, ...] = (
    "pagedbench.adapters.torch_sdpa:SdpaContiguous",
    "pagedbench.adapters.torch_sdpa:TorchGather",
    "pagedbench.adapters.triton_decode:TritonPagedDecode",
    "pagedbench.adapters.triton_paged:TritonSplitDecode",
    "pagedbench.adapters.triton_paged:TritonPrefill",
    "pagedbench.adapters.flex_paged:FlexPaged",
    "pagedbench.adapters.vllm_cpu:VllmCpu",
    "pagedbench.adapters.vllm_triton:VllmUnified",
    "pagedbench.adapters.vllm_triton:VllmDecode",
    "pagedbench.adapters.vllm_triton:VllmChunkedPrefill",
    "pagedbench.adapters.flashinfer:FlashInferNHD",
    "pagedbench.adapters.flashinfer:FlashInferHND",
    "pagedbench.adapters.flash_attn:FlashAttn2",
    "pagedbench.adapters.flash_attn:FlashAttn3",
    "pagedbench.adapters.xformers:XformersSplitK",
    "pagedbench.adapters.vllm_cuda:VllmCudaFlashAttn",
)


def load(target: str) -> Adapter:
    """Instantiate the adapter class named by ``target`` (``"module:Class"``).

    Raises
    ------
    ValueError
        If ``target`` is not of the form ``"module:Class"``.
    ImportError, AttributeError
        If the module or class does not exist.
    """
    module_name, sep, class_name = target.partition(":")
    if not sep or not module_name or not class_name:
        raise ValueError(f"adapter target must be 'module:Class', got {target!r}")
    cls = getattr(importlib.import_module(module_name), class_name)
    return cls()


def targets() -> list[str]:
    """Built-in targets, then those registered under :data:`ENTRY_POINT_GROUP`."""
    found = list(BUILTIN)
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.value not in found:
            found.append(ep.value)
    return found


class Unloadable(Adapter):
    """Stands in for an out-of-tree adapter whose module or class failed to load: it is
    ``unavailable`` with the import error as the reason, so one broken plug-in never
    breaks ``pagedbench list`` or ``run`` for the others."""

    description = "adapter failed to load"

    def __init__(self, target: str, error: BaseException) -> None:
        self.name = target
        self.reason = f"failed to load {target}: {type(error).__name__}: {error}"

    def capabilities(self, device: str) -> Capabilities:
        return Capabilities(devices=frozenset(), dtypes=frozenset())

    def available(self, device: str = "cpu") -> Availability:
        return Availability(False, self.reason)

    def prepare(self, inputs):
        raise RuntimeError(self.reason)

    def run(self, prepared):
        raise RuntimeError(self.reason)


def registry() -> dict[str, tuple[str, Adapter]]:
    """Every adapter by name: ``{name: (target, adapter)}``, in leaderboard order. A
    built-in that fails to load is a bug and raises; an entry-point adapter that fails to
    load becomes an :class:`Unloadable` named by its target.

    Raises
    ------
    ValueError
        If two targets declare the same adapter name.
    """
    out: dict[str, tuple[str, Adapter]] = {}
    for target in targets():
        try:
            adapter = load(target)
        except Exception as exc:
            if target in BUILTIN:
                raise
            adapter = Unloadable(target, exc)
        if adapter.name in out:
            raise ValueError(
                f"adapter name {adapter.name!r} is declared by both {out[adapter.name][0]} "
                f"and {target}"
            )
        out[adapter.name] = (target, adapter)
    return out


__all__ = [
    "BUILTIN",
    "ENTRY_POINT_GROUP",
    "Adapter",
    "Availability",
    "Capabilities",
    "MultipleOf",
    "Unloadable",
    "load",
    "registry",
    "targets",
]
