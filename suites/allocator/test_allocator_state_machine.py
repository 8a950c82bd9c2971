"""Stateful property test: the block allocator against a model made of plain token lists.

Hypothesis drives random runs of add / append / fork / free / preempt and re-admit /
swap out and in / prefix-hit prompts against :class:`BlockAllocator`, while the test keeps
its own model: each sequence's token list, and a slot -> token store that it writes at the
slots the allocator hands out (copying blocks when the allocator reports copy-on-write or
a swap), as a serving engine writes K/V. After every step it checks the allocator's own
invariants and, computed here from the public block tables only, that:

- reading each sequence's tokens through its block table returns exactly its token list
  (so no block was reused, shared, or matched from the prefix cache wrongly);
- blocks shared by several tables hold the same number of tokens in each (a shared block
  is never written: copy-on-write split it first);
- ``usage()`` and ``num_free_blocks`` agree with a recount over the tables;
- every refusal (``OutOfBlocksError``) happens exactly when the free blocks fall short.

Token ids come from a three-letter vocabulary so that prompts often share prefixes.
Run longer with ``HYPOTHESIS_PROFILE=dev``.
"""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    multiple,
    precondition,
    rule,
)

from pagedbench.reference.allocator import BlockAllocator, OutOfBlocksError

TOKEN_IDS = st.integers(min_value=0, max_value=2)
PROMPTS = st.lists(TOKEN_IDS, max_size=12)
NEW_TOKEN_IDS = st.lists(TOKEN_IDS, max_size=6)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class AllocatorMachine(RuleBasedStateMachine):
    """The allocator under random operation sequences, checked against a dict model."""

    seqs = Bundle("seqs")
    preempted = Bundle("preempted")

    def __init__(self) -> None:
        super().__init__()
        self.allocator: BlockAllocator
        self.block_size = 0
        self.caching = False
        self.tokens: dict[int, list[int]] = {}  # every known sequence's token values
        self.has_ids: dict[int, list[bool]] = {}  # whether each token was given with an id
        self.host_tables: dict[int, list[int]] = {}  # swapped-out sequence -> host blocks
        self.preempted_tokens: dict[int, list[int]] = {}
        self.store: dict[int, int] = {}  # device slot -> token value written there
        self.host_store: dict[int, int] = {}  # host slot -> token value
        self.next_seq_id = 0
        self.next_marker = -1  # values of tokens appended without ids: unique, negative

    # Independent views of the state, from the public block tables -----------------------
    def _slot(self, table: list[int], pos: int) -> int:
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    def _device_seqs(self) -> list[int]:
        return [s for s in self.tokens if s not in self.host_tables]

    def _used_blocks(self) -> set[int]:
        return {b for s in self._device_seqs() for b in self.allocator.block_table(s)}

    def _expected_free(self) -> int:
        return self.allocator.num_blocks - len(self._used_blocks())

    def _holders(self, block: int) -> int:
        return sum(block in self.allocator.block_table(s) for s in self._device_seqs())

    def _guaranteed_hit_blocks(self, prompt: list[int]) -> int:
        """Leading prompt blocks that a live sequence on device holds, full and with ids.

        Those blocks are referenced, so they are cached and cannot be evicted: a prompt
        starting with them must hit at least them (capped to leave one token to compute).
        """
        if not self.caching:
            return 0
        bs = self.block_size
        cap = (len(prompt) - 1) // bs if prompt else 0
        best = 0
        for seq in self._device_seqs():
            values, ids = self.tokens[seq], self.has_ids[seq]
            k = 0
            while (
                k < cap
                and (k + 1) * bs <= len(values)
                and all(ids[k * bs : (k + 1) * bs])
                and values[k * bs : (k + 1) * bs] == prompt[k * bs : (k + 1) * bs]
            ):
                k += 1
            best = max(best, k)
        return best

    def _new_seq_id(self) -> int:
        self.next_seq_id += 1
        return self.next_seq_id

    def _write(self, table: list[int], start: int, values: list[int]) -> None:
        for pos, value in enumerate(values, start):
            self.store[self._slot(table, pos)] = value

    def _copy_block(self, src_store, src, dst_store, dst) -> None:
        bs = self.block_size
        for offset in range(bs):
            if src * bs + offset in src_store:
                dst_store[dst * bs + offset] = src_store[src * bs + offset]

    def _admit(self, seq_id: int, prompt: list[int]):
        """add_sequence with checks; returns the id, or nothing when refused."""
        bs = self.block_size
        guaranteed = self._guaranteed_hit_blocks(prompt)
        free, used = self._expected_free(), self._used_blocks()
        # A hit on a block in use saves a free block, a hit on an unreferenced cached one
        # does not; which one a lookup takes is the allocator's (vLLM's: the one cached
        # first), so the need is checked against the table after the fact.
        need = self.allocator.blocks_needed_for_prompt(prompt)
        assert need <= _cdiv(len(prompt), bs)
        if need > free:
            with pytest.raises(OutOfBlocksError) as refused:
                self.allocator.add_sequence(seq_id, prompt)
            assert refused.value.shortfall == need - free
            return multiple()
        hit = self.allocator.add_sequence(seq_id, prompt)
        table = self.allocator.block_table(seq_id)
        assert len(set(table) - used) == need, "prompt took other than the blocks it needed"
        assert hit % bs == 0
        assert guaranteed * bs <= hit <= max(0, (len(prompt) - 1) // bs * bs), (
            f"prefix hit of {hit} tokens for a {len(prompt)}-token prompt, "
            f"expected at least {guaranteed * bs} and at most one token short of it"
        )
        if not self.caching:
            assert hit == 0
        self._write(table, hit, prompt[hit:])
        self.tokens[seq_id] = list(prompt)
        self.has_ids[seq_id] = [True] * len(prompt)
        return seq_id

    def _append(self, seq: int, tokens: list[int] | int) -> None:
        with_ids = not isinstance(tokens, int)
        count = len(tokens) if with_ids else tokens
        if seq in self.host_tables:
            with pytest.raises(ValueError, match="swapped out"):
                self.allocator.append_tokens(seq, tokens)
            return
        bs = self.block_size
        table = self.allocator.block_table(seq)
        start = len(self.tokens[seq])
        copy_on_write = count > 0 and start % bs != 0 and self._holders(table[-1]) > 1
        need = _cdiv(start + count, bs) - len(table) + copy_on_write
        free = self._expected_free()
        assert self.allocator.blocks_needed(seq, count) == need
        assert self.allocator.can_append(seq, count) == (need <= free)
        if need > free:
            with pytest.raises(OutOfBlocksError) as refused:
                self.allocator.append_tokens(seq, tokens)
            assert refused.value.shortfall == need - free
            return
        slots = self.allocator.append_tokens(seq, tokens)
        new_table = self.allocator.block_table(seq)
        copies = self.allocator.pop_copies()
        if copy_on_write:
            src, dst = table[-1], new_table[len(table) - 1]
            assert copies == [(src, dst)]
            assert new_table[: len(table) - 1] == table[:-1]
            assert self._holders(dst) == 1, f"copy-on-write target {dst} is shared"
            self._copy_block(self.store, src, self.store, dst)
        else:
            assert copies == []
            assert new_table[: len(table)] == table
        assert slots == [self._slot(new_table, p) for p in range(start, start + count)]
        if with_ids:
            values = list(tokens)
        else:
            values = list(range(self.next_marker, self.next_marker - count, -1))
            self.next_marker -= count
        self._write(new_table, start, values)
        self.tokens[seq].extend(values)
        self.has_ids[seq].extend([with_ids] * count)

    # Rules ----------------------------------------------------------------------------------
    @initialize(
        target=seqs,
        block_size=st.sampled_from([1, 2, 4]),
        num_blocks=st.integers(min_value=1, max_value=16),
        caching=st.booleans(),
        num_host_blocks=st.integers(min_value=0, max_value=8),
        seed=st.integers(min_value=0, max_value=3),
    )
    def create(self, block_size, num_blocks, caching, num_host_blocks, seed):
        self.block_size = block_size
        self.caching = caching
        self.allocator = BlockAllocator(
            num_blocks,
            block_size,
            seed=seed,
            enable_prefix_caching=caching,
            num_host_blocks=num_host_blocks,
        )
        # One empty sequence to start (it needs no block), so every rule is enabled.
        return self._admit(self._new_seq_id(), [])

    @rule(target=seqs, prompt=PROMPTS)
    def add(self, prompt):
        return self._admit(self._new_seq_id(), prompt)

    @rule(target=seqs, source=seqs, keep=st.integers(0, 12), extra=NEW_TOKEN_IDS)
    def add_with_shared_prefix(self, source, keep, extra):
        return self._admit(self._new_seq_id(), self.tokens[source][:keep] + extra)

    @rule(seq=seqs, token_ids=NEW_TOKEN_IDS)
    def append_ids(self, seq, token_ids):
        self._append(seq, token_ids)

    @rule(seq=seqs, count=st.integers(min_value=0, max_value=6))
    def append_without_ids(self, seq, count):
        self._append(seq, count)

    @rule(target=seqs, parent=seqs)
    def fork(self, parent):
        child = self._new_seq_id()
        if parent in self.host_tables:
            with pytest.raises(ValueError, match="swapped out"):
                self.allocator.fork(parent, child)
            return multiple()
        self.allocator.fork(parent, child)
        assert self.allocator.block_table(child) == self.allocator.block_table(parent)
        self.tokens[child] = list(self.tokens[parent])
        self.has_ids[child] = list(self.has_ids[parent])
        return child

    def _forget(self, seq: int) -> None:
        del self.tokens[seq], self.has_ids[seq]
        self.host_tables.pop(seq, None)

    @rule(seq=consumes(seqs))
    def free(self, seq):
        self.allocator.free(seq)
        self._forget(seq)
        with pytest.raises(KeyError, match="unknown sequence"):
            self.allocator.free(seq)

    @precondition(lambda self: len(self.tokens) >= 2)
    @rule(first=consumes(seqs), second=consumes(seqs))
    def free_two_in_one_call(self, first, second):
        self.allocator.free(first, second)
        self._forget(first)
        self._forget(second)

    @rule(seq=seqs)
    def free_with_duplicate_ids_is_refused(self, seq):
        with pytest.raises(ValueError, match="duplicate"):
            self.allocator.free(seq, seq)
        assert self.allocator.num_tokens(seq) == len(self.tokens[seq])

    @rule(target=preempted, seq=consumes(seqs))
    def preempt(self, seq):
        assert self.allocator.preempt(seq) == len(self.tokens[seq])
        self.preempted_tokens[seq] = self.tokens[seq]
        self._forget(seq)
        return seq

    @rule(target=seqs, seq=consumes(preempted))
    def readmit(self, seq):
        return self._admit(seq, self.preempted_tokens.pop(seq))

    @rule(seq=seqs)
    def swap_out(self, seq):
        if seq in self.host_tables:
            with pytest.raises(ValueError, match="swapped out"):
                self.allocator.swap_out(seq)
            return
        table = self.allocator.block_table(seq)
        host_used = sum(len(t) for t in self.host_tables.values())
        host_free = self.allocator.num_host_blocks - host_used
        if len(table) > host_free:
            with pytest.raises(OutOfBlocksError, match="host"):
                self.allocator.swap_out(seq)
            return
        mapping = self.allocator.swap_out(seq)
        assert [device for device, _ in mapping] == table
        host_table = [host for _, host in mapping]
        held = {h for t in self.host_tables.values() for h in t}
        assert len(set(host_table)) == len(host_table) and not held & set(host_table)
        for device, host in mapping:
            self._copy_block(self.store, device, self.host_store, host)
        self.host_tables[seq] = host_table
        assert self.allocator.block_table(seq) == []

    @rule(seq=seqs)
    def swap_in(self, seq):
        if seq not in self.host_tables:
            with pytest.raises(ValueError, match="not swapped out"):
                self.allocator.swap_in(seq)
            return
        need, free = len(self.host_tables[seq]), self._expected_free()
        if need > free:
            with pytest.raises(OutOfBlocksError) as refused:
                self.allocator.swap_in(seq)
            assert refused.value.shortfall == need - free
            return
        used = self._used_blocks()
        mapping = self.allocator.swap_in(seq)
        assert [host for host, _ in mapping] == self.host_tables.pop(seq)
        table = self.allocator.block_table(seq)
        assert [device for _, device in mapping] == table
        assert not used & set(table), "swap_in took a block in use"
        for host, device in mapping:
            self._copy_block(self.host_store, host, self.store, device)

    # Checked after every step ---------------------------------------------------------------
    @invariant()
    def tables_read_back_every_token(self):
        self.allocator.check_invariants()
        assert self.allocator.pop_copies() == []
        assert sorted(self.allocator.sequences()) == sorted(self.tokens)
        bs = self.block_size
        fills: dict[int, int] = {}
        for seq, values in self.tokens.items():
            assert self.allocator.num_tokens(seq) == len(values)
            if seq in self.host_tables:
                table, store = self.host_tables[seq], self.host_store
                assert self.allocator.block_table(seq) == []
            else:
                table, store = self.allocator.block_table(seq), self.store
                for index, block in enumerate(table):
                    fill = min(bs, len(values) - index * bs)
                    assert fills.setdefault(block, fill) == fill, (
                        f"block {block} is shared with unequal fills: it was written "
                        "while shared"
                    )
            assert len(table) == _cdiv(len(values), bs)
            read = [store.get(self._slot(table, pos)) for pos in range(len(values))]
            assert read == values, f"sequence {seq} reads {read} through its table"
        usage = self.allocator.usage()
        assert usage.blocks_used == len(fills)
        assert usage.tokens_stored == sum(fills.values())
        assert usage.slots_allocated == len(fills) * bs
        assert usage.fragmentation_slots == len(fills) * bs - sum(fills.values())
        assert usage.blocks_used + usage.blocks_free + usage.blocks_cached == usage.num_blocks
        assert self.allocator.num_free_blocks == usage.num_blocks - len(fills)
        assert usage.host_blocks_used == sum(len(t) for t in self.host_tables.values())
        if not self.caching:
            assert usage.blocks_cached == 0


AllocatorMachine.TestCase.settings = settings(stateful_step_count=50)
TestAllocatorMatchesTokenListModel = AllocatorMachine.TestCase
