"""``reference``: :class:`pagedbench.reference.allocator.BlockAllocator` behind the
allocator contract (:mod:`.allocator_base`), one engine step per call: reserve, make the
copy-on-write copy, write and commit."""

from __future__ import annotations

from collections.abc import Sequence

from pagedbench.reference.allocator import BlockAllocator, OutOfBlocksError

from .allocator_base import Allocator, PoolUsage, Step
from .base import Availability


class ReferenceAllocator(Allocator):
    """The reference allocator (vLLM's design: block-hash prefix caching, LRU eviction of
    freed blocks inside allocation, fork with copy-on-write)."""

    name = "reference"
    description = "pagedbench's reference block allocator (reference/allocator.py)"
    unit = "block"
    prefix_rule = "block-hash"
    supports_fork = True
    eviction = ("inside allocation: free uncached blocks first, then cached blocks least "
                "recently released first, a finished table tail first")

    def available(self) -> Availability:
        return Availability(True, version="", details={"source": "reference/allocator.py"})

    def start(self, num_blocks: int, block_size: int, prefix_caching: bool) -> None:
        self.allocator = BlockAllocator(num_blocks, block_size, seed=0,
                                        enable_prefix_caching=prefix_caching)

    def _step(self, seq_id: int, token_ids: Sequence[int]) -> Step:
        alloc = self.allocator
        alloc.append_tokens(seq_id, list(token_ids))
        copies = alloc.pop_copies()
        alloc.copy_done(copies)
        alloc.commit(seq_id, alloc.num_tokens(seq_id))
        return Step(True, copies=tuple((c.src, c.dst) for c in copies))

    def admit(self, seq_id: int, token_ids: Sequence[int]) -> Step:
        try:
            hit = self.allocator.add_sequence(seq_id, list(token_ids))
        except OutOfBlocksError:
            return Step(False)
        self.allocator.commit(seq_id, len(token_ids))
        return Step(True, hit=hit)

    def append(self, seq_id: int, token_ids: Sequence[int]) -> Step:
        try:
            return self._step(seq_id, token_ids)
        except OutOfBlocksError:
            return Step(False)

    def fork(self, parent_id: int, child_id: int) -> Step:
        self.allocator.fork(parent_id, child_id)
        return Step(True)

    def free(self, seq_id: int) -> None:
        self.allocator.free(seq_id)

    def lookup(self, token_ids: Sequence[int]) -> int:
        return self.allocator.prefix_hit(token_ids)

    def slots(self, seq_id: int) -> list[int]:
        bs = self.allocator.block_size
        table = self.allocator.block_table(seq_id)
        return [table[p // bs] * bs + p % bs for p in range(self.allocator.num_tokens(seq_id))]

    def block_table(self, seq_id: int) -> list[int]:
        return self.allocator.block_table(seq_id)

    def usage(self) -> PoolUsage:
        usage = self.allocator.usage()
        return PoolUsage(free=usage.blocks_free, cached=usage.blocks_cached,
                         used=usage.blocks_used, capacity=usage.num_blocks)
