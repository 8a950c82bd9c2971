"""The reference block allocator: one pool of fixed-size blocks and a table per sequence.

This is the memory model of paged attention (Kwon et al., "Efficient Memory Management
for Large Language Model Serving with PagedAttention", SOSP 2023, section 4.2): the KV
cache is cut into ``num_blocks`` blocks of ``block_size`` token slots; each sequence owns
an ordered list of blocks (its block table); a block is taken from the free list only when
the sequence's last block is full, and every block returns to the free list when the
sequence ends. Host-only Python ints, no torch, so stateful tests run in milliseconds.

Placement is deliberately non-contiguous: the free list is shuffled with a seeded RNG, so
a kernel that assumes ``block_table[i][j] == i * max_blocks + j`` fails.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Hashable


class OutOfBlocksError(RuntimeError):
    """Raised when an allocation needs more free blocks than the pool has."""


class BlockAllocator:
    """A pool of ``num_blocks`` KV blocks with on-demand, all-or-nothing allocation.

    Parameters
    ----------
    num_blocks : int
        Blocks in the pool, >= 1. Block ids are ``0 .. num_blocks - 1``.
    block_size : int
        Token slots per block, >= 1. Slot ``s`` of block ``b`` is physical slot
        ``b * block_size + s`` (vLLM's ``slot_mapping`` convention).
    seed : int or None
        Seeds the shuffle of the free list; ``None`` keeps ascending order.

    Raises
    ------
    ValueError
        If ``num_blocks`` or ``block_size`` is < 1.
    """

    def __init__(self, num_blocks: int, block_size: int, seed: int | None = 0) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        order = list(range(num_blocks))
        if seed is not None:
            random.Random(seed).shuffle(order)
        self._free: deque[int] = deque(order)
        self._tables: dict[Hashable, list[int]] = {}
        self._num_tokens: dict[Hashable, int] = {}

    # Queries ------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def block_table(self, seq_id: Hashable) -> list[int]:
        """The physical block ids of ``seq_id``, in logical order (a copy)."""
        return list(self._table(seq_id))

    def num_tokens(self, seq_id: Hashable) -> int:
        self._table(seq_id)
        return self._num_tokens[seq_id]

    def sequences(self) -> list[Hashable]:
        return list(self._tables)

    def blocks_needed(self, seq_id: Hashable, num_new_tokens: int) -> int:
        """New blocks an append of ``num_new_tokens`` to ``seq_id`` would take."""
        table = self._table(seq_id)
        capacity = len(table) * self.block_size
        overflow = self._num_tokens[seq_id] + num_new_tokens - capacity
        return max(0, -(-overflow // self.block_size))

    # Mutations ----------------------------------------------------------------------------
    def add_sequence(self, seq_id: Hashable) -> None:
        """Start an empty sequence (no blocks until its first token).

        Raises
        ------
        ValueError
            If ``seq_id`` is already live.
        """
        if seq_id in self._tables:
            raise ValueError(f"sequence {seq_id!r} already exists")
        self._tables[seq_id] = []
        self._num_tokens[seq_id] = 0

    def append_tokens(self, seq_id: Hashable, num_new_tokens: int) -> list[int]:
        """Reserve slots for ``num_new_tokens`` more tokens of ``seq_id``.

        A new block is taken only when the last one is full. Allocation is all-or-nothing:
        if the pool cannot hold every new token, nothing changes.

        Returns
        -------
        list[int]
            The physical slot of each new token, ``[num_new_tokens]`` (``slot_mapping``).

        Raises
        ------
        KeyError
            If ``seq_id`` is not a live sequence.
        OutOfBlocksError
            If the append needs more free blocks than there are; the message names the
            shortfall.
        """
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        need = self.blocks_needed(seq_id, num_new_tokens)
        if need > len(self._free):
            raise OutOfBlocksError(
                f"appending {num_new_tokens} tokens to sequence {seq_id!r} needs {need} new "
                f"blocks but only {len(self._free)} of {self.num_blocks} are free "
                f"(short by {need - len(self._free)})"
            )
        table = self._tables[seq_id]
        table.extend(self._free.popleft() for _ in range(need))
        start = self._num_tokens[seq_id]
        self._num_tokens[seq_id] = start + num_new_tokens
        bs = self.block_size
        return [table[pos // bs] * bs + pos % bs for pos in range(start, start + num_new_tokens)]

    def free(self, seq_id: Hashable) -> None:
        """End ``seq_id`` and return its blocks to the free list.

        Raises
        ------
        KeyError
            If ``seq_id`` is not a live sequence (including a second free).
        """
        table = self._table(seq_id)
        self._free.extend(table)
        del self._tables[seq_id]
        del self._num_tokens[seq_id]

    def _table(self, seq_id: Hashable) -> list[int]:
        try:
            return self._tables[seq_id]
        except KeyError:
            raise KeyError(f"unknown sequence {seq_id!r} (never added, or already freed)") from None
