"""The allocator contract: what a KV-cache manager under test must answer, beside the
kernel contract of :mod:`.base`.

An engine's block manager (vLLM's ``KVCacheManager``, SGLang's ``RadixCache`` over its
token pool, transformers' ``PagedAttentionCache``, :mod:`pagedbench.reference.allocator`)
is driven through :class:`Allocator` with the calls its scheduler makes, one engine step
each: every token an admission or an append reserves has its K/V written (and, with
prefix caching, becomes matchable by that engine's own rule) before the call returns.
``suites/allocator/contract_machine.py`` judges every registered allocator
(:data:`ALLOCATORS`) with one state machine, each against what its design promises.

Units are what the pool hands out: blocks of ``block_size`` slots (``unit="block"``), or
single token slots (``unit="token"``, SGLang's token pool, page size 1). A sequence's
slots are ``block * block_size + offset`` for block allocators (vLLM's ``slot_mapping``),
token indices for token pools. A refused call changes nothing.
"""

from __future__ import annotations

import abc
import importlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Literal

from .base import Availability

#: Registered allocators, name -> ``"module:Class"`` (imported only when used).
ALLOCATORS: dict[str, str] = {
    "reference": "pagedbench.adapters.allocator_reference:ReferenceAllocator",
    "vllm": "pagedbench.adapters.allocator_vllm:VllmKvCacheManager",
    "sglang-radix": "pagedbench.adapters.allocator_sglang:SglangRadixCache",
    "transformers": "pagedbench.adapters.allocator_transformers:TransformersPagedCache",
}


@dataclass(frozen=True)
class Step:
    """What one call did.

    Attributes
    ----------
    ok : bool
        False when refused (the pool cannot hold it now); nothing changed then.
    hit : int
        Tokens an admission took from the prefix cache (not computed).
    copies : tuple[tuple[int, int], ...]
        ``(src, dst)`` units whose K/V the allocator copied (copy-on-write, a fork's
        partial block): the caller's data moves with them, before the new tokens'.
    """

    ok: bool
    hit: int = 0
    copies: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True)
class PoolUsage:
    """The pool in units: every unit is exactly one of ``free`` (holding nothing
    reusable), ``cached`` (reusable by a prefix hit, held by no sequence, evictable) or
    ``used`` (held by at least one live sequence), so they sum to ``capacity``."""

    free: int
    cached: int
    used: int
    capacity: int


class Allocator(abc.ABC):
    """One engine's KV-cache manager behind the contract (module docstring).

    Class attributes say what the design promises, so that the judge holds each to its
    own rule: ``unit``; ``prefix_rule`` (``"block-hash"``: full blocks keyed by their
    whole prefix, registered as they are written; ``"radix"``: a token tree holding each
    running request's prompt and each finished sequence); ``supports_fork`` and
    ``supports_evict`` (an explicit eviction call); ``evicts_all_cached`` (that call
    empties the cache at once, whatever it is asked for, rather than evicting whole units
    until enough went); ``eviction`` (its documented order, in words).
    """

    name: ClassVar[str]
    description: ClassVar[str] = ""
    unit: ClassVar[Literal["block", "token"]]
    prefix_rule: ClassVar[Literal["block-hash", "radix"]]
    supports_fork: ClassVar[bool] = False
    supports_evict: ClassVar[bool] = False
    evicts_all_cached: ClassVar[bool] = False
    eviction: ClassVar[str] = ""

    @abc.abstractmethod
    def available(self) -> Availability:
        """Whether the engine's code can be loaded here (never raises)."""

    @abc.abstractmethod
    def start(self, num_blocks: int, block_size: int, prefix_caching: bool) -> None:
        """A fresh pool of ``num_blocks * block_size`` token slots (``num_blocks`` units
        of ``block_size``; a token pool takes them all as units)."""

    @abc.abstractmethod
    def admit(self, seq_id: int, token_ids: Sequence[int]) -> Step:
        """Allocate a new request's prompt, taking what the prefix cache holds of it (at
        most ``len - 1`` tokens: one is always computed), all or nothing."""

    @abc.abstractmethod
    def append(self, seq_id: int, token_ids: Sequence[int]) -> Step:
        """Reserve and write the next tokens of a running sequence (a decode step)."""

    def fork(self, parent_id: int, child_id: int) -> Step:
        """Start ``child_id`` holding ``parent_id``'s tokens (parallel sampling).

        Raises
        ------
        NotImplementedError
            Where ``supports_fork`` is False.
        """
        raise NotImplementedError(f"{self.name} has no fork")

    @abc.abstractmethod
    def free(self, seq_id: int) -> None:
        """Finish a sequence: release it, leaving what its design caches."""

    @abc.abstractmethod
    def lookup(self, token_ids: Sequence[int]) -> int:
        """Tokens an admission of ``token_ids`` would take from the cache now."""

    def evict(self, num_units: int) -> int:
        """Evict cached units by the design's rule (at least ``num_units`` where the
        rule allows); returns how many went.

        Raises
        ------
        NotImplementedError
            Where ``supports_evict`` is False (eviction happens inside allocation).
        """
        raise NotImplementedError(f"{self.name} evicts only when it allocates")

    @abc.abstractmethod
    def slots(self, seq_id: int) -> list[int]:
        """The sequence's token slots, ``[num_tokens]``, in position order."""

    def block_table(self, seq_id: int) -> list[int] | None:
        """The sequence's blocks in logical order (None for a token pool)."""
        return None

    @abc.abstractmethod
    def usage(self) -> PoolUsage:
        """The pool now (:class:`PoolUsage`)."""


def load_allocator(name: str) -> Allocator:
    """Import and instantiate the allocator registered as ``name`` in :data:`ALLOCATORS`.

    Raises
    ------
    KeyError
        If ``name`` is not registered (the message lists the names).
    """
    if name not in ALLOCATORS:
        raise KeyError(f"unknown allocator {name!r}; registered: {sorted(ALLOCATORS)}")
    module_name, _, class_name = ALLOCATORS[name].partition(":")
    return getattr(importlib.import_module(module_name), class_name)()


__all__ = ["ALLOCATORS", "Allocator", "PoolUsage", "Step", "load_allocator"]
