"""The allocator contract's state machine: every registered allocator
(``adapters/allocator_base.py``'s ``ALLOCATORS``: the reference, vLLM's ``KVCacheManager``,
SGLang's ``RadixCache``, transformers' ``PagedAttentionCache``) under one state machine,
judged on what its design promises. Run by ``test_allocator_contract.py``, and for vLLM
by ``test_allocator_matches_vllm.py`` (beside the other vLLM tests, so that one process
imports vLLM).

Hypothesis drives an engine's calls (admit a new prompt, one sharing a live or finished
sequence's prefix, or a live sequence's tokens again; append; fork; free; evict; look a
prefix up) on two pools: one so large that nothing is ever evicted, one of a few blocks.
After every call, from the contract's answers only:

- the pool's units are each free, cached or used (they sum to its capacity), and the
  used ones are exactly those the live sequences hold;
- reading each live sequence's tokens back through its slots (its block table for a
  block allocator) returns them: the model writes each computed token's K/V (its whole
  prefix) where the allocator placed it, and moves it with every copy the allocator
  reports, so a slot owned twice, a prefix hit on evicted or foreign data, a table that
  lost a block or a copy that did not happen all show;
- a refused call changes nothing; an admission takes exactly what a lookup just before
  said it would;
- prefix hits follow the design's rule, exactly on the large pool and as an upper bound
  on the small one (where eviction may have dropped some):

  * ``block-hash`` (reference, vLLM, transformers): full blocks keyed by their whole
    prefix, registered as they are written, prompt ones and appended ones alike; a hit
    is the longest run of such blocks, capped at ``len - 1`` tokens;
  * ``radix`` (SGLang): a token tree holding each running request's prompt (inserted
    after its prefill) and each finished sequence whole, not the tokens a running request
    appended: a hit is the longest common prefix, capped at ``len - 1``. So where the
    designs differ, the same trace hits at token granularity in one and whole blocks in
    the other, and a running sequence's appended tokens are matchable in one only.

- eviction follows each design's documented rule: SGLang evicts unlocked leaves until at
  least the tokens asked for have gone (or none are left); transformers evicts every
  cached block at once; the reference and vLLM evict only inside allocation (no call).
"""

from __future__ import annotations

from typing import ClassVar

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from pagedbench.adapters.allocator_base import ALLOCATORS, Allocator, Step, load_allocator
from pagedbench.suites.budget import by_profile

#: Three token ids: prompts share prefixes often, and blocks filled apart collide.
TOKENS = st.integers(min_value=0, max_value=2)
PROMPTS = st.lists(TOKENS, min_size=1, max_size=8)
#: Blocks of the large pool (never full in a run of STEPS steps) and the small pools.
AMPLE_BLOCKS, TIGHT_BLOCKS = 512, (3, 12)
STEPS = 30
#: Runs per machine, per hypothesis profile (a few seconds each in make test).
EXAMPLES = {"ci": 25, "nightly": 400}


def _loaded(name: str) -> Allocator:
    allocator = load_allocator(name)
    availability = allocator.available()
    if not availability.ok:
        pytest.skip(f"{name} unavailable: {availability.reason}")
    return allocator


class ContractMachine(RuleBasedStateMachine):
    """One allocator under the engine's calls (module docstring); subclassed per
    allocator and pool by :func:`machine`."""

    ALLOCATOR: ClassVar[Allocator]
    AMPLE: ClassVar[bool]

    def __init__(self) -> None:
        super().__init__()
        self.alloc = self.ALLOCATOR
        self.seqs: dict[int, list[int]] = {}
        self.finished: list[list[int]] = []
        self.store: dict[int, tuple[int, ...]] = {}  # slot -> the prefix whose K/V it holds
        self.registry: set[tuple[int, ...]] = set()  # block-hash: registered block prefixes
        self.inserted: list[tuple[int, ...]] = []  # radix: sequences in the tree
        self.next_id = 0

    @initialize(block_size=st.sampled_from([1, 2, 4]),
                tight_blocks=st.integers(*TIGHT_BLOCKS))
    def start(self, block_size, tight_blocks):
        self.bs = block_size
        self.alloc.start(AMPLE_BLOCKS if self.AMPLE else tight_blocks, block_size, True)

    # The design's rules -------------------------------------------------------------
    def expected_hit(self, prompt: list[int]) -> int:
        """The most the design's rule lets a prompt hit now (exact on the large pool)."""
        cap = len(prompt) - 1
        if self.alloc.prefix_rule == "radix":
            common = [next((i for i, (a, b) in enumerate(zip(prompt, s)) if a != b),
                           min(len(prompt), len(s))) for s in self.inserted]
            return min(max(common, default=0), cap)
        k = 0
        while (k + 1) * self.bs <= cap and tuple(prompt[:(k + 1) * self.bs]) in self.registry:
            k += 1
        return k * self.bs

    def written(self, seq_id: int, start: int) -> None:
        """The step computed tokens ``start ..`` of ``seq_id``: write them where the
        allocator put them, and register what the design registers as written."""
        tokens, slots = self.seqs[seq_id], self.alloc.slots(seq_id)
        for pos in range(start, len(tokens)):
            self.store[slots[pos]] = tuple(tokens[:pos + 1])
        if self.alloc.prefix_rule == "block-hash":
            self.registry |= {tuple(tokens[:k * self.bs])
                              for k in range(1, len(tokens) // self.bs + 1)}

    def copied(self, step: Step) -> None:
        width = self.bs if self.alloc.unit == "block" else 1
        for src, dst in step.copies:
            for offset in range(width):
                if src * width + offset in self.store:
                    self.store[dst * width + offset] = self.store[src * width + offset]

    def refused(self, before) -> None:
        assert self.alloc.usage() == before, "a refused call changed the pool"

    # Rules ----------------------------------------------------------------------------
    @rule(data=st.data(), kind=st.sampled_from(["new", "shared prefix", "same again"]))
    def admit(self, data, kind):
        sources = list(self.seqs.values()) + self.finished
        if kind == "new" or not sources:
            prompt = data.draw(PROMPTS, label="prompt")
        else:
            source = data.draw(st.sampled_from(sources), label="source")
            keep = data.draw(st.integers(1, len(source)), label="keep")
            extra = [] if kind == "same again" else data.draw(st.lists(TOKENS, max_size=3))
            prompt = source[:keep] + extra
        expected, looked_up, before = self.expected_hit(prompt), self.alloc.lookup(prompt), \
            self.alloc.usage()
        seq_id, self.next_id = self.next_id, self.next_id + 1
        step = self.alloc.admit(seq_id, prompt)
        if not step.ok:
            assert not self.AMPLE, "refused on a pool that cannot be full"
            return self.refused(before)
        assert step.hit == looked_up, f"admitted with {step.hit} hit, lookup said {looked_up}"
        assert step.hit <= expected if not self.AMPLE else step.hit == expected, (
            f"{self.alloc.prefix_rule} hit {step.hit} tokens of {prompt}, rule {expected}")
        self.seqs[seq_id] = prompt
        slots = self.alloc.slots(seq_id)
        for pos in range(step.hit):
            assert self.store.get(slots[pos]) == tuple(prompt[:pos + 1]), (
                f"hit position {pos} reads {self.store.get(slots[pos])}")
        self.written(seq_id, step.hit)
        if self.alloc.prefix_rule == "radix":
            self.inserted.append(tuple(prompt))

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), tokens=st.lists(TOKENS, min_size=1, max_size=3))
    def append(self, data, tokens):
        seq_id = data.draw(st.sampled_from(sorted(self.seqs)), label="seq")
        before, slots = self.alloc.usage(), self.alloc.slots(seq_id)
        step = self.alloc.append(seq_id, tokens)
        if not step.ok:
            assert not self.AMPLE, "refused on a pool that cannot be full"
            self.refused(before)
            assert self.alloc.slots(seq_id) == slots
            return
        self.copied(step)
        start = len(self.seqs[seq_id])
        self.seqs[seq_id] = self.seqs[seq_id] + tokens
        self.written(seq_id, start)

    @precondition(lambda self: self.seqs and self.alloc.supports_fork)
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(sorted(self.seqs)), label="parent")
        before = self.alloc.usage()
        child, self.next_id = self.next_id, self.next_id + 1
        step = self.alloc.fork(parent, child)
        if not step.ok:
            return self.refused(before)
        self.copied(step)
        self.seqs[child] = list(self.seqs[parent])

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def free(self, data):
        seq_id = data.draw(st.sampled_from(sorted(self.seqs)), label="seq")
        self.alloc.free(seq_id)
        tokens = self.seqs.pop(seq_id)
        self.finished.append(tokens)
        if self.alloc.prefix_rule == "radix":
            self.inserted.append(tuple(tokens))

    @precondition(lambda self: not self.AMPLE and self.alloc.supports_evict)
    @rule(units=st.integers(1, 6))
    def evict(self, units):
        before = self.alloc.usage()
        evicted = self.alloc.evict(units)
        after = self.alloc.usage()
        assert after.cached == before.cached - evicted and after.used == before.used
        if self.alloc.evicts_all_cached:
            assert evicted == before.cached
        else:  # whole leaves until at least `units`, or none left
            assert min(units, before.cached) <= evicted <= before.cached

    @rule(prompt=PROMPTS)
    def lookup(self, prompt):
        hit = self.alloc.lookup(prompt)
        expected = self.expected_hit(prompt)
        assert hit <= expected if not self.AMPLE else hit == expected, (prompt, hit, expected)

    # Invariants -----------------------------------------------------------------------
    @invariant()
    def pool_and_reads_agree(self):
        usage = self.alloc.usage()
        assert min(usage.free, usage.cached, usage.used) >= 0, usage
        assert usage.free + usage.cached + usage.used == usage.capacity, usage
        width = self.bs if self.alloc.unit == "block" else 1
        held = set()
        for seq_id, tokens in self.seqs.items():
            slots = self.alloc.slots(seq_id)
            assert len(slots) == len(tokens) and len(set(slots)) == len(slots), seq_id
            for pos, slot in enumerate(slots):
                assert self.store.get(slot) == tuple(tokens[:pos + 1]), (
                    f"sequence {seq_id} reads {self.store.get(slot)} at position {pos}")
            held |= {slot // width for slot in slots}
            table = self.alloc.block_table(seq_id)
            if table is not None:
                assert table == [slots[p] // self.bs for p in range(0, len(slots), self.bs)]
        assert usage.used == len(held), f"{usage.used} used units, the sequences hold {len(held)}"


def machine(name: str, ample: bool) -> type[ContractMachine]:
    return type(f"{name}{'Ample' if ample else 'Tight'}Machine", (ContractMachine,),
                {"ALLOCATOR": _loaded(name), "AMPLE": ample})


def check_contract(name: str, pool: str) -> None:
    """Run the machine on allocator ``name`` with the ``"ample"`` or ``"tight"`` pool."""
    run_state_machine_as_test(
        machine(name, pool == "ample"),
        settings=settings(max_examples=by_profile(EXAMPLES), stateful_step_count=STEPS,
                          deadline=None))
