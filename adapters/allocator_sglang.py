"""``sglang-radix``: SGLang 0.5.23's ``RadixCache`` over its ``TokenToKVPoolAllocator``
(page size 1, SGLang's default) behind the allocator contract, loaded from its wheel's
files (:mod:`.sglang_radix_load`), driven as its scheduler drives them
(``srt/managers/schedule_batch.py``, ``srt/mem_cache/common.py``):

- admit: ``match_prefix`` on the prompt capped at ``len - 1`` tokens
  (``Req._compute_max_prefix_len``), lock the matched node, ``evict`` from the tree what
  the allocation lacks, ``alloc`` the rest; after the prefill the prompt is inserted
  (``checkpoint``: ``insert``, the duplicates it exposes freed, the row pointed at the
  tree's slots, the lock moved to the new node);
- append: ``evict`` if short, ``alloc`` one slot per token;
- free: the whole sequence inserted the same way, then unlocked
  (``release_kv_cache(..., checkpoint=True)``);
- evict: ``RadixCache.evict``, least recently used unlocked leaves first.

No fork: SGLang runs parallel samples as separate requests sharing the prompt through
the tree. Units are token slots (the allocator's indices, from 1: slot 0 is its padding
slot); the pool holds ``num_blocks * block_size`` of them.
"""

from __future__ import annotations

import functools
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

from .allocator_base import Allocator, PoolUsage, Step
from .base import Availability
from .pinned_files import PinnedFilesInvalid


@functools.cache
def _radix():
    """SGLang's classes, loaded once per process (:func:`.sglang_radix_load.load_radix`)."""
    from .sglang_radix_load import load_radix

    return load_radix()


@dataclass
class _Request:
    tokens: list[int]
    slots: list[int]
    lock: object
    protected: int = 0  # leading tokens whose slots the tree owns


class SglangRadixCache(Allocator):
    """SGLang's radix cache and token pool (module docstring)."""

    name = "sglang-radix"
    description = ("SGLang 0.5.23 RadixCache over TokenToKVPoolAllocator (page size 1), "
                   "wheel files, driven as its scheduler drives them")
    unit = "token"
    prefix_rule = "radix"
    supports_evict = True
    eviction = "RadixCache.evict: unlocked leaves, least recently used first, whole leaves"

    def available(self) -> Availability:
        try:
            radix = _radix()
        except PinnedFilesInvalid as exc:
            return Availability(False, f"SGLang's radix cache files not usable: {exc}")
        return Availability(True, version=radix.version, details={"source": radix.source})

    def start(self, num_blocks: int, block_size: int, prefix_caching: bool) -> None:
        import torch

        self.sg = _radix()
        self.pool = self.sg.TokenToKVPoolAllocator(
            size=num_blocks * block_size, dtype=torch.float32, device="cpu", kvcache=None,
            need_sort=False)
        self.tree = self.sg.RadixCache.create_simulated(disable=not prefix_caching,
                                                        mock_allocator=self.pool)
        self.requests: dict[int, _Request] = {}

    def _key(self, token_ids: Sequence[int], limit: int | None = None):
        return self.sg.RadixKey(array("q", token_ids), limit=limit)

    def _alloc(self, n: int):
        """``n`` slots, evicting from the tree first what the pool lacks; None, evicting
        nothing, when free and evictable slots together fall short (the scheduler admits
        only within ``available_size() + evictable_size()``, ``schedule_policy.py``)."""
        short = n - self.pool.available_size()
        if short > self.tree.evictable_size():
            return None
        if short > 0:
            self.tree.evict(self.sg.EvictParams(num_tokens=short))
        return self.pool.alloc(n)

    def _checkpoint(self, request: _Request) -> None:
        """Insert the request's tokens; free the duplicates; point its slots at the
        tree's and move its lock there (``RadixCache.checkpoint``)."""
        import torch

        n = len(request.tokens)
        values = torch.tensor(request.slots[:n], dtype=torch.int64)
        result = self.tree.insert(self.sg.InsertParams(key=self._key(request.tokens),
                                                       value=values))
        self.pool.free(values[request.protected:result.prefix_len])
        match = self.tree.match_prefix(self.sg.MatchPrefixParams(key=self._key(request.tokens)))
        request.slots[:n] = self.tree.path_device_indices(match.last_device_node).tolist()
        request.protected = n
        self.tree.unlock(request.lock)
        request.lock = self.tree.lock(match.last_device_node)

    def admit(self, seq_id: int, token_ids: Sequence[int]) -> Step:
        import torch

        tokens = list(token_ids)
        match = self.tree.match_prefix(self.sg.MatchPrefixParams(
            key=self._key(tokens, max(len(tokens) - 1, 0))))
        hit = match.device_prefix_len
        prefix = self.tree.path_device_indices(match.last_device_node)[:hit]
        lock = self.tree.lock(match.last_device_node)
        new = self._alloc(len(tokens) - hit) if len(tokens) > hit else torch.empty(0)
        if new is None:
            self.tree.unlock(lock)
            return Step(False)
        request = _Request(tokens, prefix.tolist() + new.tolist(), lock, protected=hit)
        self.requests[seq_id] = request
        if not self.tree.disable:
            self._checkpoint(request)
        return Step(True, hit=hit)

    def append(self, seq_id: int, token_ids: Sequence[int]) -> Step:
        new = self._alloc(len(token_ids))
        if new is None:
            return Step(False)
        request = self.requests[seq_id]
        request.tokens += list(token_ids)
        request.slots += new.tolist()
        return Step(True)

    def free(self, seq_id: int) -> None:
        import torch

        request = self.requests.pop(seq_id)
        if self.tree.disable:
            self.pool.free(torch.tensor(request.slots, dtype=torch.int64))
            return
        self._checkpoint(request)
        self.tree.unlock(request.lock)

    def lookup(self, token_ids: Sequence[int]) -> int:
        match = self.tree.match_prefix(self.sg.MatchPrefixParams(
            key=self._key(token_ids, max(len(token_ids) - 1, 0))))
        return match.device_prefix_len

    def evict(self, num_units: int) -> int:
        return self.tree.evict(self.sg.EvictParams(num_tokens=num_units)).num_tokens_evicted

    def slots(self, seq_id: int) -> list[int]:
        return list(self.requests[seq_id].slots)

    def usage(self) -> PoolUsage:
        free, cached = self.pool.available_size(), self.tree.evictable_size()
        return PoolUsage(free=free, cached=cached, used=self.pool.size - free - cached,
                         capacity=self.pool.size)
