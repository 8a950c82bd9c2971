"""Stateful property test: the block allocator against an independent model, on every path.

Hypothesis drives random runs of an engine's calls (admit, append, commit a step, finish
copies, fork, free, preempt and readmit, swap out and in, a whole decode step) against
:class:`BlockAllocator` and :class:`~pagedbench.suites.allocator.allocator_model.AllocatorModel`,
one machine with prefix caching and one without. After every call it checks the
allocator's own invariants and, from the public API only, that the model's predictions
hold: exact prefix hits (which block of several under one key), which blocks an
allocation takes (the eviction order), every refusal and its shortfall, usage and pins,
and that reading each sequence's committed tokens through its block table returns them.

Each path the machines must reach is an ``event()`` (``--hypothesis-show-statistics``
lists them); ``test_allocator_state_machine_reaches_every_path`` runs a machine and
asserts that every path was reached at least the stated number of times
(:data:`MIN_REACH`, met in the ``ci`` profile). ``target()`` steers the search towards
runs with many copies in flight and many duplicate keys. Sequences are drawn from the
model's live ids rather than a ``Bundle``: a decode step preempts sequences that another
rule drew, which a bundle cannot forget. Run longer with ``--hypothesis-profile nightly``.
(Over 500 lines: the rules and their predicted outcomes belong together; the model is
``allocator_model.py``.)
"""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import event, settings, target
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from pagedbench.reference.allocator import BlockAllocator, CopyKind, OutOfBlocksError
from pagedbench.suites.allocator.allocator_model import AllocatorModel, SequenceModel

#: Two token ids: prompts share prefixes often and independently filled blocks collide.
TOKEN_IDS = st.integers(min_value=0, max_value=1)
PROMPTS = st.lists(TOKEN_IDS, max_size=8)
NEW_TOKEN_IDS = st.lists(TOKEN_IDS, min_size=1, max_size=4)
STEPS = 100


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class AllocatorMachine(RuleBasedStateMachine):
    """One allocator under random engine calls; ``CACHING`` is set by the subclasses."""

    CACHING: bool
    reached: Counter[str]  # every path event of this machine class, over all its runs

    def __init__(self) -> None:
        super().__init__()
        self.allocator: BlockAllocator
        self.model: AllocatorModel
        self.preempted_tokens: dict[int, list[int]] = {}
        self.next_seq_id = 0
        self.next_marker = -1  # token values of tokens appended without ids: unique, < 0
        self.most_pending = self.most_duplicates = 0

    def _reach(self, path: str) -> None:
        event(path)
        type(self).reached[path] += 1

    def _new_seq_id(self) -> int:
        self.next_seq_id += 1
        return self.next_seq_id

    @property
    def bs(self) -> int:
        return self.model.block_size

    # Calls and their predicted outcomes ---------------------------------------------------------
    def _admit(self, seq_id: int, prompt: list[int], readmission: bool = False):
        """add_sequence, checked against the model's hits, need and eviction; whether it
        was admitted."""
        model = self.model
        hits = model.predict_hits(prompt)
        free = set(model.uncached) | set(model.lru)
        in_flight = model.in_flight()
        need = _cdiv(len(prompt), self.bs) - sum(b not in free for b in hits)
        assert self.allocator.blocks_needed_for_prompt(prompt) == need
        if any(len(model.blocks_of[model.key(prompt, i)]) > 1 for i in range(len(hits))):
            self._reach("duplicate-key lookup")
            held = model.holders()
            last = model.blocks_of[model.key(prompt, len(hits) - 1)]
            if any(held[b] for b in last) and not all(held[b] for b in last):
                self._reach("duplicate-key lookup, one copy in use and one not")
        if self._matches_unwritten_block(prompt, len(hits)):
            self._reach("prompt matches a block not yet matchable")
        if need > model.num_free:
            self._refused("readmit" if readmission else "add", need, model.num_free,
                          self.allocator.add_sequence, seq_id, prompt)
            return False
        hit = self.allocator.add_sequence(seq_id, prompt)
        assert hit == len(hits) * self.bs, f"prefix hit of {hit} tokens, model {hits}"
        table = self.allocator.block_table(seq_id)
        assert table[: len(hits)] == hits, f"hit blocks {table[:len(hits)]}, model {hits}"
        model.take_back(hits)
        self._took(table[len(hits) :])
        model.seqs[seq_id] = SequenceModel(
            tokens=list(prompt), with_ids=[True] * len(prompt), committed=hit, table=table,
            registered=len(hits),
        )
        if hits:
            self._reach("readmission served by the prefix cache" if readmission else "prefix hit")
        if set(hits) & in_flight:
            self._reach("prefix hit on a block pinned by a pending copy")
        return True

    def _matches_unwritten_block(self, prompt: list[int], num_hits: int) -> bool:
        """Whether a live sequence holds the prompt's next block, full and with ids, but
        not registered (uncommitted, or a copy into it pending)."""
        model, end = self.model, (num_hits + 1) * self.bs
        if not model.caching or end >= len(prompt):
            return False
        return any(
            seq.tokens[:end] == prompt[:end] and all(seq.with_ids[:end])
            and seq.registered <= num_hits
            for seq in model.seqs.values() if seq.host_table is None
        )

    def _refused(self, kind: str, need: int, free: int, call, *args) -> None:
        with pytest.raises(OutOfBlocksError) as refused:
            call(*args)
        assert refused.value.shortfall == need - free
        self._reach(f"refused {kind}")
        if need <= free + len(self.model.in_flight()) and kind != "swap_out":
            self._reach("refused while blocks are pinned by pending copies")

    def _took(self, new_blocks: list[int]) -> None:
        if self.model.take(new_blocks):
            self._reach("cached block evicted")

    def _append(self, seq_id: int, tokens: list[int] | int) -> bool:
        """append_tokens, checked against the model; whether it succeeded."""
        model = self.model
        seq = model.seqs[seq_id]
        with_ids = not isinstance(tokens, int)
        count = len(tokens) if with_ids else tokens
        if seq.host_table is not None:
            with pytest.raises(ValueError, match="swapped out"):
                self.allocator.append_tokens(seq_id, tokens)
            return False
        table, start = seq.table, len(seq.tokens)
        copy_on_write = count > 0 and start % self.bs != 0 and model.holders()[table[-1]] > 1
        need = _cdiv(start + count, self.bs) - len(table) + copy_on_write
        assert self.allocator.blocks_needed(seq_id, count) == need
        assert self.allocator.can_append(seq_id, count) == (need <= model.num_free)
        if need > model.num_free:
            kind = "append_tokens (copy-on-write)" if copy_on_write else "append_tokens"
            self._refused(kind, need, model.num_free, self.allocator.append_tokens,
                          seq_id, tokens)
            return False
        slots = self.allocator.append_tokens(seq_id, tokens)
        new_table = self.allocator.block_table(seq_id)
        copies = self.allocator.pop_copies()
        if copy_on_write:
            src, dst = table[-1], new_table[len(table) - 1]
            assert [(c.src, c.dst, c.kind) for c in copies] == [
                (src, dst, CopyKind.COPY_ON_WRITE)
            ]
            assert new_table[: len(table) - 1] == table[:-1]
            self._took([dst] + new_table[len(table) :])
            model.pending[copies[0]] = start % self.bs
            self._reach("copy-on-write append")
        else:
            assert copies == []
            assert new_table[: len(table)] == table
            self._took(new_table[len(table) :])
        seq.table = new_table
        assert slots == [model.slot(new_table, p) for p in range(start, start + count)]
        if with_ids:
            seq.tokens.extend(tokens)
        else:
            seq.tokens.extend(range(self.next_marker, self.next_marker - count, -1))
            self.next_marker -= count
        seq.with_ids.extend([with_ids] * count)
        return True

    def _commit(self, seq_id: int, num_tokens: int) -> None:
        before = len(self.model.key_of)
        self.allocator.commit(seq_id, num_tokens)
        self.model.commit(seq_id, num_tokens)
        if len(self.model.key_of) > before:
            self._reach("commit makes blocks matchable")

    def _copy_done(self, copies) -> None:
        held = self.model.holders()
        for copy in copies:
            if copy.kind is CopyKind.COPY_ON_WRITE and not held[copy.src]:
                self._reach("copy-on-write source outlived its tables until copy_done")
            if copy.kind is not CopyKind.SWAP_OUT and not held[copy.dst]:
                self._reach(f"{copy.kind.value} target freed before copy_done")
        self.allocator.copy_done(copies)
        for copy in copies:
            self.model.finish_copy(copy)
        self._reach("copy_done")

    def _write_out(self, seq_id: int) -> None:
        """Finish what the engine owes ``seq_id`` before reading its K/V: the copies into
        its blocks, then the step that writes its tokens."""
        seq = self.model.seqs[seq_id]
        copies = [c for c in self.model.pending if c.kind is not CopyKind.SWAP_OUT
                  and c.dst in seq.table]
        if copies:
            self._copy_done(copies)
        if seq.committed < len(seq.tokens):
            self._commit(seq_id, len(seq.tokens))

    def _release_seq(self, seq_id: int) -> None:
        seq = self.model.seqs.pop(seq_id)
        self.model.release(list(reversed(seq.table)))

    # Rules ----------------------------------------------------------------------------------
    def _pick(self, data, label: str, on_device: bool = False) -> int:
        ids = self.model.device_seqs() if on_device else list(self.model.seqs)
        return data.draw(st.sampled_from(ids), label=label)

    @initialize(
        block_size=st.sampled_from([1, 2, 2, 3, 4]),
        num_blocks=st.integers(min_value=4, max_value=24),
        num_host_blocks=st.integers(min_value=0, max_value=12),
        seed=st.integers(min_value=0, max_value=3),
    )
    def create(self, block_size, num_blocks, num_host_blocks, seed):
        self.allocator = BlockAllocator(
            num_blocks, block_size, seed=seed, enable_prefix_caching=self.CACHING,
            num_host_blocks=num_host_blocks,
        )
        self.model = AllocatorModel(num_blocks, block_size, num_host_blocks, self.CACHING)

    @rule(data=st.data(), kind=st.sampled_from(["new", "shared prefix", "same request again"]))
    def add(self, data, kind):
        """A new request: a fresh prompt, one starting with a live sequence's tokens, or
        a live sequence's tokens exactly (independently filled blocks then collide)."""
        if kind == "new" or not self.model.seqs:
            prompt = data.draw(PROMPTS, label="prompt")
        else:
            source = self.model.seqs[self._pick(data, "source")].tokens
            if kind == "same request again":
                prompt = list(source)
            else:
                keep = data.draw(st.integers(0, len(source)), label="keep")
                prompt = source[:keep] + data.draw(st.lists(TOKEN_IDS, max_size=4), label="extra")
        self._admit(self._new_seq_id(), prompt)

    @precondition(lambda self: self.model.seqs)
    @rule(data=st.data(), tokens=NEW_TOKEN_IDS | st.integers(min_value=0, max_value=4))
    def append(self, data, tokens):
        """Token ids, or a count of tokens without ids (never cacheable); until the step
        is committed, reading the sequence's K/V (fork, swap out) is refused."""
        seq = self._pick(data, "seq")
        if self._append(seq, tokens) and tokens:
            with pytest.raises(ValueError, match="fork: sequence .* uncommitted tokens"):
                self.allocator.fork(seq, self._new_seq_id())
            self._reach("fork refused: data not written")
            with pytest.raises(ValueError, match="swap_out: sequence .* uncommitted tokens"):
                self.allocator.swap_out(seq)
            self._reach("swap_out refused: data not written")

    @precondition(lambda self: self.model.seqs)
    @rule(data=st.data())
    def commit(self, data):
        seq = self._pick(data, "seq")
        model_seq = self.model.seqs[seq]
        if model_seq.host_table is not None:
            with pytest.raises(ValueError, match="swapped out"):
                self.allocator.commit(seq, model_seq.committed)
            return
        upto = data.draw(st.integers(model_seq.committed, len(model_seq.tokens)), label="upto")
        self._commit(seq, upto)
        with pytest.raises(ValueError, match="commit: num_tokens"):
            self.allocator.commit(seq, len(model_seq.tokens) + 1)

    @precondition(lambda self: self.model.pending)
    @rule(data=st.data())
    def copy_done(self, data):
        chosen = data.draw(st.permutations(list(self.model.pending)), label="order")
        self._copy_done(chosen[: data.draw(st.integers(1, len(chosen)), label="how many")])

    @precondition(lambda self: self.model.device_seqs())
    @rule(token_id=TOKEN_IDS)
    def decode_step(self, token_id):
        """One engine step: every running sequence, oldest first, gets a token; when one
        cannot, the newest running sequence is preempted (vLLM v1's victim) until it can
        or it was the newest; the step writes the tokens and finishes every copy."""
        model = self.model
        running = model.device_seqs()
        index = 0
        while index < len(running):
            seq = running[index]
            while not self._append(seq, [token_id]):
                victim = running.pop()
                self._preempt(victim)
                if victim == seq:
                    break
            else:
                index += 1
        if model.pending:
            self._copy_done(list(model.pending))
        for seq in model.device_seqs():
            self._commit(seq, len(model.seqs[seq].tokens))

    @precondition(lambda self: self.model.seqs)
    @rule(data=st.data(), write_first=st.booleans())
    def fork(self, data, write_first):
        parent = self._pick(data, "parent")
        child = self._new_seq_id()
        model = self.model
        if model.seqs[parent].host_table is not None:
            with pytest.raises(ValueError, match="swapped out"):
                self.allocator.fork(parent, child)
            return
        if write_first:
            self._write_out(parent)
        if not model.written(parent):
            with pytest.raises(ValueError, match="fork: sequence .* uncommitted tokens"):
                self.allocator.fork(parent, child)
            self._reach("fork refused: data not written")
            return
        self.allocator.fork(parent, child)
        source = model.seqs[parent]
        assert self.allocator.block_table(child) == source.table
        model.seqs[child] = SequenceModel(
            tokens=list(source.tokens), with_ids=list(source.with_ids),
            committed=source.committed, table=list(source.table), registered=source.registered,
        )
        self._reach("fork")

    @precondition(lambda self: self.model.seqs)
    @rule(data=st.data(), how_many=st.integers(1, 2))
    def free(self, data, how_many):
        """Finish one or two sequences in one call (after a refused call naming one twice)."""
        chosen = data.draw(st.permutations(list(self.model.seqs)), label="seqs")[:how_many]
        with pytest.raises(ValueError, match="duplicate"):
            self.allocator.free(chosen[0], *chosen)
        self.allocator.free(*chosen)
        for seq in chosen:
            self._release_seq(seq)
        with pytest.raises(KeyError, match="unknown sequence"):
            self.allocator.free(chosen[0])

    @precondition(lambda self: self.model.seqs)
    @rule()
    def finish_oldest(self):
        """The oldest request completes (requests admitted first tend to finish first)."""
        seq = next(iter(self.model.seqs))
        self.allocator.free(seq)
        self._release_seq(seq)

    def _preempt(self, seq: int) -> None:
        tokens = self.model.seqs[seq].tokens
        assert self.allocator.preempt(seq) == len(tokens)
        self.preempted_tokens[seq] = tokens
        self._release_seq(seq)
        self._reach("preempt")

    @precondition(lambda self: self.model.seqs)
    @rule(data=st.data())
    def preempt(self, data):
        self._preempt(self._pick(data, "seq"))

    @precondition(lambda self: self.preempted_tokens)
    @rule(data=st.data())
    def readmit(self, data):
        seq = data.draw(st.sampled_from(sorted(self.preempted_tokens)), label="preempted")
        if self._admit(seq, self.preempted_tokens[seq], readmission=True):
            del self.preempted_tokens[seq]
            self._reach("readmit")

    @precondition(lambda self: self.model.seqs)
    @rule(data=st.data(), write_first=st.booleans())
    def swap_out(self, data, write_first):
        seq = self._pick(data, "seq")
        if self.model.seqs[seq].host_table is not None:
            with pytest.raises(ValueError, match="swapped out"):
                self.allocator.swap_out(seq)
            return
        with pytest.raises(ValueError, match="not swapped out"):
            self.allocator.swap_in(seq)
        if write_first:
            self._write_out(seq)
        self.swap_out_sequence(seq)

    def swap_out_sequence(self, seq: int) -> None:
        model = self.model
        model_seq = model.seqs[seq]
        if not model.written(seq):
            with pytest.raises(ValueError, match="swap_out: sequence .* uncommitted tokens"):
                self.allocator.swap_out(seq)
            self._reach("swap_out refused: data not written")
            return
        host_free = model.num_host_blocks - len(model.host_busy())
        if len(model_seq.table) > host_free:
            with pytest.raises(OutOfBlocksError, match="host") as refused:
                self.allocator.swap_out(seq)
            assert refused.value.shortfall == len(model_seq.table) - host_free
            self._reach("refused swap_out")
            return
        copies = self.allocator.swap_out(seq)
        assert [(c.src, c.kind) for c in copies] == [
            (b, CopyKind.SWAP_OUT) for b in model_seq.table
        ]
        host_table = [c.dst for c in copies]
        assert len(set(host_table)) == len(host_table) and not set(host_table) & model.host_busy()
        for index, copy in enumerate(copies):  # each copies the tokens its block holds
            model.pending[copy] = min(self.bs, len(model_seq.tokens) - index * self.bs)
        table, model_seq.table, model_seq.host_table = model_seq.table, [], host_table
        model_seq.registered = 0
        model.release(list(reversed(table)))
        if table:
            self._reach("swap_out")
            with pytest.raises(ValueError, match="swap-out copies .* are pending"):
                self.allocator.swap_in(seq)
            self._reach("swap_in refused: swap-out copies pending")

    @precondition(lambda self: any(s.host_table is not None for s in self.model.seqs.values()))
    @rule(data=st.data(), wait=st.booleans())
    def swap_in(self, data, wait):
        swapped = [s for s, m in self.model.seqs.items() if m.host_table is not None]
        self.swap_in_sequence(data.draw(st.sampled_from(swapped), label="swapped seq"), wait)

    def swap_in_sequence(self, seq: int, wait: bool) -> None:
        model = self.model
        model_seq = model.seqs[seq]
        outgoing = [c for c in model.pending if c.kind is CopyKind.SWAP_OUT
                    and c.dst in model_seq.host_table]
        if outgoing and wait:
            self._copy_done(outgoing)
        elif outgoing:
            with pytest.raises(ValueError, match="swap-out copies .* are pending"):
                self.allocator.swap_in(seq)
            self._reach("swap_in refused: swap-out copies pending")
            return
        need = len(model_seq.host_table)
        if need > model.num_free:
            self._refused("swap_in", need, model.num_free, self.allocator.swap_in, seq)
            return
        copies = self.allocator.swap_in(seq)
        assert [(c.src, c.kind) for c in copies] == [
            (h, CopyKind.SWAP_IN) for h in model_seq.host_table
        ]
        table = self.allocator.block_table(seq)
        assert [c.dst for c in copies] == table
        self._took(table)
        for index, copy in enumerate(copies):  # each copies the tokens its block holds
            model.pending[copy] = min(self.bs, len(model_seq.tokens) - index * self.bs)
        model_seq.table, model_seq.host_table = table, None
        if table:
            self._reach("swap round trip")
            if self.CACHING and len(model_seq.tokens) >= self.bs and all(
                model_seq.with_ids[: self.bs]
            ):
                self._reach("swap round trip of hashed full blocks")

    # Engine scenarios that chain several calls ------------------------------------------------
    @rule(prompt=PROMPTS)
    def two_identical_requests_in_one_step(self, prompt):
        """Both prefill in one batch, so neither can hit the other: their blocks are cached
        twice under the same keys (vLLM's "duplicated blocks", prefix_caching.md)."""
        admitted = [s for s in (self._new_seq_id(), self._new_seq_id()) if self._admit(s, prompt)]
        for seq in admitted:
            self._commit(seq, len(prompt))

    @precondition(lambda self: self.model.device_seqs())
    @rule(data=st.data(), token_id=TOKEN_IDS, drop_parent=st.booleans())
    def beam_step(self, data, token_id, drop_parent):
        """Beam search: branch a sequence, the branch writes a token (copy-on-write of a
        shared partial block), and the parent beam may be dropped before the copy runs."""
        parent = self._pick(data, "parent", on_device=True)
        self._write_out(parent)
        child = self._new_seq_id()
        self.allocator.fork(parent, child)
        source = self.model.seqs[parent]
        self.model.seqs[child] = SequenceModel(
            tokens=list(source.tokens), with_ids=list(source.with_ids),
            committed=source.committed, table=list(source.table), registered=source.registered,
        )
        self._append(child, [token_id])
        if drop_parent:
            self.allocator.free(parent)
            self._release_seq(parent)

    @precondition(lambda self: any(s.host_table is not None for s in self.model.seqs.values()))
    @rule(data=st.data())
    def abort_during_swap_in(self, data):
        """A request is aborted while its blocks are being swapped back in."""
        swapped = [s for s, m in self.model.seqs.items() if m.host_table is not None]
        seq = data.draw(st.sampled_from(swapped), label="swapped seq")
        self.swap_in_sequence(seq, wait=True)
        self.allocator.free(seq)
        self._release_seq(seq)

    @precondition(lambda self: self.model.device_seqs())
    @rule(data=st.data())
    def preempt_then_readmit(self, data):
        """A sequence is preempted and rescheduled at once: with prefix caching its
        committed full blocks are still cached and serve the recomputation."""
        seq = self._pick(data, "seq", on_device=True)
        self._preempt(seq)
        if self._admit(seq, self.preempted_tokens[seq], readmission=True):
            del self.preempted_tokens[seq]
            self._reach("readmit")

    @precondition(lambda self: self.model.device_seqs())
    @rule(data=st.data())
    def same_request_arrives_during_swap_out(self, data):
        """A sequence is swapped out and the same request arrives before the copies are
        done: it shares the cached blocks the copies still read."""
        seq = self._pick(data, "seq", on_device=True)
        self._write_out(seq)
        self.swap_out_sequence(seq)
        self._admit(self._new_seq_id(), list(self.model.seqs[seq].tokens))

    @precondition(lambda self: self.model.device_seqs())
    @rule(data=st.data(), token_id=TOKEN_IDS)
    def swap_out_to_admit_a_waiting_request(self, data, token_id):
        """Swap a sequence out to make room, admit a waiting request into the room once the
        swap-out is done, and try to swap the first back in (refused when the room is
        gone)."""
        seq = self._pick(data, "seq", on_device=True)
        self._write_out(seq)
        room = len(self.model.seqs[seq].table) * self.bs
        self.swap_out_sequence(seq)
        outgoing = [c for c in self.model.pending if c.kind is CopyKind.SWAP_OUT]
        if outgoing:
            self._copy_done(outgoing)
        self._admit(self._new_seq_id(), [token_id] * room)
        if self.model.seqs[seq].host_table is not None:
            self.swap_in_sequence(seq, wait=True)

    # Checked after every step ---------------------------------------------------------------
    @invariant()
    def allocator_matches_the_model(self):
        allocator, model = self.allocator, self.model
        allocator.check_invariants()
        assert allocator.pop_copies() == []
        assert allocator.pending_copies() == list(model.pending)
        assert sorted(allocator.sequences()) == sorted(model.seqs)
        fills: dict[int, int] = {}
        for seq_id, seq in model.seqs.items():
            assert allocator.num_tokens(seq_id) == len(seq.tokens)
            assert allocator.num_committed(seq_id) == seq.committed
            assert allocator.block_table(seq_id) == seq.table
            assert allocator.is_swapped_out(seq_id) == (seq.host_table is not None)
            for index, block in enumerate(seq.table):
                fill = min(self.bs, len(seq.tokens) - index * self.bs)
                assert fills.setdefault(block, fill) == fill, (
                    f"block {block} is shared with unequal fills: it was written while shared"
                )
            store = model.host_store if seq.host_table is not None else model.store
            for slot, token in model.expected_reads(seq_id):
                assert store.get(slot) == token, (
                    f"sequence {seq_id} reads {store.get(slot)} at slot {slot}, wrote {token}"
                )
        held = model.holders()
        assert set(fills) == set(held)
        in_flight = model.in_flight()
        parts = [set(held), in_flight, model.uncached, set(model.lru)]
        assert sum(map(len, parts)) == model.num_blocks == len(set().union(*parts))
        usage = allocator.usage()
        bs = self.bs
        assert (usage.blocks_used, usage.blocks_in_flight) == (len(held), len(in_flight))
        assert (usage.blocks_free, usage.blocks_cached) == (len(model.uncached), len(model.lru))
        assert usage.tokens_stored == sum(fills.values())
        assert usage.fragmentation_slots == len(fills) * bs - sum(fills.values())
        assert allocator.num_free_blocks == model.num_free
        assert usage.host_blocks_used == len(model.host_busy())
        self.most_pending = max(self.most_pending, len(model.pending))
        self.most_duplicates = max(self.most_duplicates, model.duplicate_keys())

    def teardown(self):
        # Steer the search towards runs with many copies in flight and duplicate keys.
        target(float(self.most_pending), label="most pending copies")
        target(float(self.most_duplicates), label="most keys with several blocks")


class CachingMachine(AllocatorMachine):
    CACHING = True
    reached = Counter()


class NoCachingMachine(AllocatorMachine):
    CACHING = False
    reached = Counter()


#: Runs per machine: at least this many, or the profile's count if larger (the ``ci``
#: profile's 20 runs leave the rarest paths, e.g. a refused copy-on-write append, to chance).
MIN_EXAMPLES = 50
#: Each path and the fewest times a machine must reach it in the ``ci`` profile (about a
#: third of what it reaches there, so a change that halves a path's reach still passes).
MIN_REACH = {
    "both": {
        "copy-on-write append": 30,
        "copy-on-write source outlived its tables until copy_done": 10,
        "copy-on-write target freed before copy_done": 5,
        "swap round trip": 20,
        "swap-in target freed before copy_done": 20,
        "refused add": 100,
        "refused readmit": 3,
        "refused append_tokens": 50,
        "refused append_tokens (copy-on-write)": 5,
        "refused swap_out": 20,
        "refused swap_in": 15,
        "refused while blocks are pinned by pending copies": 50,
        "fork": 40,
        "fork refused: data not written": 50,
        "swap_out refused: data not written": 50,
        "swap_in refused: swap-out copies pending": 40,
        "preempt": 100,
        "readmit": 50,
        "copy_done": 100,
    },
    "caching": {
        "prefix hit": 100,
        "readmission served by the prefix cache": 40,
        "duplicate-key lookup": 100,
        "duplicate-key lookup, one copy in use and one not": 50,
        "cached block evicted": 200,
        "prefix hit on a block pinned by a pending copy": 15,
        "swap round trip of hashed full blocks": 50,
        "commit makes blocks matchable": 200,
        "prompt matches a block not yet matchable": 60,
    },
}


@pytest.mark.parametrize(
    "machine", [CachingMachine, NoCachingMachine], ids=["prefix-caching", "no-prefix-caching"]
)
def test_allocator_state_machine_reaches_every_path(machine):
    """The machine passes, and reaches each of its paths at least ``MIN_REACH`` times."""
    machine.reached.clear()
    examples = max(MIN_EXAMPLES, settings.default.max_examples)
    run_state_machine_as_test(
        machine, settings=settings(max_examples=examples, stateful_step_count=STEPS)
    )
    minima = MIN_REACH["both"] | (MIN_REACH["caching"] if machine.CACHING else {})
    short = {path: machine.reached[path] for path, least in minima.items()
             if machine.reached[path] < least}
    assert not short, f"paths reached fewer times than required: {short}"
