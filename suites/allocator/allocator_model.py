"""An independent model of the block allocator's state, for the state-machine tests.

The model predicts from plain lists, sets and dicts what :class:`BlockAllocator` must do,
and the machine (``test_allocator_state_machine.py``) compares after every call:

- the prefix cache: a sequence's full blocks with ids are registered in table order, each
  once its tokens are committed and no copy into it is pending; a key maps to its blocks
  in registration order and a lookup takes the first, so every hit's block ids are known;
- the eviction order (vLLM's ``BlockPool.free_blocks``, ``docs/design/prefix_caching.md``):
  uncached free blocks are taken before any cached one; cached blocks are evicted least
  recently released first, and a table is released tail first;
- data in flight: the token store is written only when a step is committed or a copy is
  done, so a read through a block table returns the right token only if nothing was
  matched, reused or evicted before its data arrived; a block a pending copy uses is
  neither free nor evictable.

Keys are the tuples of all token ids up to the block's end (equal keys mean equal prefixes,
as the allocator's chained SHA-256 does), so the model never calls the allocator's hash.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from pagedbench.reference.allocator import BlockCopy, CopyKind


@dataclass
class SequenceModel:
    """One sequence as the engine sees it."""

    tokens: list[int]
    with_ids: list[bool]
    committed: int = 0
    table: list[int] = field(default_factory=list)  # device blocks; empty while swapped
    host_table: list[int] | None = None
    registered: int = 0  # leading blocks of the table registered in the prefix cache


class AllocatorModel:
    """Pool state predicted from the engine's calls (see the module notes).

    Parameters
    ----------
    num_blocks, block_size, num_host_blocks : int
        As given to the allocator.
    caching : bool
        Whether prefix caching is on.
    """

    def __init__(self, num_blocks: int, block_size: int, num_host_blocks: int, caching: bool):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_host_blocks = num_host_blocks
        self.caching = caching
        self.seqs: dict[int, SequenceModel] = {}
        self.uncached: set[int] = set(range(num_blocks))  # free, holding nothing reusable
        self.lru: list[int] = []  # free cached blocks, next evicted first
        self.key_of: dict[int, tuple[int, ...]] = {}  # registered block -> key
        self.blocks_of: dict[tuple[int, ...], list[int]] = {}  # key -> blocks, first first
        self.pending: dict[BlockCopy, int] = {}  # pending copy -> slots it copies
        self.store: dict[int, int] = {}  # device slot -> token written there
        self.host_store: dict[int, int] = {}

    # Derived views -------------------------------------------------------------------------
    def device_seqs(self) -> list[int]:
        return [s for s, seq in self.seqs.items() if seq.host_table is None]

    def holders(self) -> Counter[int]:
        return Counter(b for s in self.device_seqs() for b in self.seqs[s].table)

    def device_pins(self) -> Counter[int]:
        pins: Counter[int] = Counter()
        for copy in self.pending:
            if copy.kind is not CopyKind.SWAP_IN:
                pins[copy.src] += 1
            if copy.kind is not CopyKind.SWAP_OUT:
                pins[copy.dst] += 1
        return pins

    def host_pinned(self) -> set[int]:
        pinned = set()
        for copy in self.pending:
            if copy.kind is CopyKind.SWAP_IN:
                pinned.add(copy.src)
            if copy.kind is CopyKind.SWAP_OUT:
                pinned.add(copy.dst)
        return pinned

    def filling(self) -> set[int]:
        """Device blocks a pending copy writes into."""
        return {c.dst for c in self.pending if c.kind is not CopyKind.SWAP_OUT}

    def host_filling(self) -> set[int]:
        return {c.dst for c in self.pending if c.kind is CopyKind.SWAP_OUT}

    def in_flight(self) -> set[int]:
        held = self.holders()
        return {b for b in self.device_pins() if not held[b]}

    @property
    def num_free(self) -> int:
        return len(self.uncached) + len(self.lru)

    def host_busy(self) -> set[int]:
        held = {h for seq in self.seqs.values() for h in seq.host_table or ()}
        return held | self.host_pinned()

    def written(self, seq_id: int) -> bool:
        """Whether every token's K/V is in place (fork and swap-out read them)."""
        seq = self.seqs[seq_id]
        return seq.committed == len(seq.tokens) and not set(seq.table) & self.filling()

    def slot(self, table: list[int], pos: int) -> int:
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    # Prefix cache ----------------------------------------------------------------------------
    def key(self, tokens: list[int], index: int) -> tuple[int, ...]:
        return tuple(tokens[: (index + 1) * self.block_size])

    def predict_hits(self, prompt: list[int]) -> list[int]:
        """The blocks a prompt's lookup takes: per leading full block, the block registered
        first under its key, leaving at least one token to compute."""
        if not self.caching:
            return []
        hits = []
        for index in range(max(0, (len(prompt) - 1) // self.block_size)):
            blocks = self.blocks_of.get(self.key(prompt, index))
            if not blocks:
                break
            hits.append(blocks[0])
        return hits

    def register_ready(self, seq_id: int) -> None:
        """Register the sequence's next blocks that are full, all ids, committed and not
        being copied into, in table order."""
        seq = self.seqs[seq_id]
        if not self.caching or seq.host_table is not None:
            return
        bs = self.block_size
        filling = self.filling()
        while seq.registered < seq.committed // bs:
            index = seq.registered
            end = (index + 1) * bs
            block = seq.table[index]
            if not all(seq.with_ids[:end]) or block in filling:
                return
            key = self.key(seq.tokens, index)
            if block in self.key_of:
                assert self.key_of[block] == key, f"block {block} registered under two keys"
            else:
                self.key_of[block] = key
                self.blocks_of.setdefault(key, []).append(block)
            seq.registered += 1

    def duplicate_keys(self) -> int:
        return sum(len(blocks) > 1 for blocks in self.blocks_of.values())

    # Free queue ------------------------------------------------------------------------------
    def release(self, blocks: list[int]) -> None:
        """Blocks just dropped by a table or unpinned, in release order: each one no table
        holds and no copy pins joins the free queue (cached at the back)."""
        held, pins = self.holders(), self.device_pins()
        for block in blocks:
            if held[block] or pins[block] or block in self.uncached or block in self.lru:
                continue
            if block in self.key_of:
                self.lru.append(block)
            else:
                self.uncached.add(block)

    def take_back(self, hits: list[int]) -> None:
        """Prefix hits leave the free queue (a later release puts them at its back)."""
        for block in hits:
            self.lru = [b for b in self.lru if b != block]

    def take(self, new_blocks: list[int]) -> int:
        """Check that ``new_blocks`` came off the queue in eviction order; return how many
        cached blocks were evicted.

        Uncached blocks are interchangeable (any of them may come first); the cached ones
        must be exactly the least recently released.
        """
        new = set(new_blocks)
        assert len(new) == len(new_blocks), f"one block handed out twice: {new_blocks}"
        assert new <= self.uncached | set(self.lru), (
            f"blocks {sorted(new - self.uncached - set(self.lru))} were not free"
        )
        if len(new) <= len(self.uncached):
            assert new <= self.uncached, (
                f"evicted cached blocks {sorted(new - self.uncached)} while uncached "
                f"blocks {sorted(self.uncached - new)} were free"
            )
            evicted: list[int] = []
        else:
            evicted = self.lru[: len(new) - len(self.uncached)]
            assert new == self.uncached | set(evicted), (
                f"took {sorted(new)}; eviction order says every uncached block "
                f"{sorted(self.uncached)} and the least recently released cached {evicted}"
            )
        self.uncached -= new
        self.lru = self.lru[len(evicted) :]
        for block in evicted:
            key = self.key_of.pop(block)
            self.blocks_of[key].remove(block)
            if not self.blocks_of[key]:
                del self.blocks_of[key]
        return len(evicted)

    # Data -----------------------------------------------------------------------------------
    def commit(self, seq_id: int, num_tokens: int) -> None:
        """The step that wrote tokens ``committed .. num_tokens - 1`` ran."""
        seq = self.seqs[seq_id]
        for pos in range(seq.committed, num_tokens):
            self.store[self.slot(seq.table, pos)] = seq.tokens[pos]
        seq.committed = num_tokens
        self.register_ready(seq_id)

    def finish_copy(self, copy: BlockCopy) -> None:
        """Copy the data now, unpin, release what nothing holds, register what is ready."""
        fill = self.pending.pop(copy)
        bs = self.block_size
        src_store = self.host_store if copy.kind is CopyKind.SWAP_IN else self.store
        dst_store = self.host_store if copy.kind is CopyKind.SWAP_OUT else self.store
        for offset in range(fill):
            value = src_store.get(copy.src * bs + offset)
            if value is None:
                dst_store.pop(copy.dst * bs + offset, None)
            else:
                dst_store[copy.dst * bs + offset] = value
        unpinned = [b for b, dev in ((copy.src, copy.kind is not CopyKind.SWAP_IN),
                                     (copy.dst, copy.kind is not CopyKind.SWAP_OUT)) if dev]
        self.release(unpinned)
        if copy.kind is not CopyKind.SWAP_OUT:
            for seq_id in self.device_seqs():
                if copy.dst in self.seqs[seq_id].table:
                    self.register_ready(seq_id)

    def expected_reads(self, seq_id: int) -> list[tuple[int, int]]:
        """``(slot, token)`` pairs whose data must be in place now: committed tokens in
        blocks no copy is still writing (on device), or host blocks whose copy is done."""
        seq = self.seqs[seq_id]
        bs = self.block_size
        if seq.host_table is not None:
            filling = self.host_filling()
            return [
                (self.slot(seq.host_table, pos), seq.tokens[pos])
                for pos in range(len(seq.tokens))
                if seq.host_table[pos // bs] not in filling
            ]
        filling = self.filling()
        return [
            (self.slot(seq.table, pos), seq.tokens[pos])
            for pos in range(seq.committed)
            if seq.table[pos // bs] not in filling
        ]
