"""Cross-check: our allocator and vLLM v1's KV cache manager on the same request traces.

Both are driven step by step with one trace of a serving engine's allocator calls
(``vllm_driver.py``): admit a request (prompt, with prefix-cache lookup), admit the same
request again (its blocks are then cached twice: duplicate keys), decode one token for
every running request, finish, preempt (free for recomputation) and re-admit, swap out and
back in (vLLM's asynchronous KV load). After every step both must report the same free
blocks, the same unreferenced cached blocks, the same prefix-cache hit and the same
refusals, with and without prefix caching, at block sizes 1, 4 and 16.

Where the two differ by design, a test below says why and checks the difference:

- commit: vLLM registers a full block in its prefix cache when ``allocate_slots``
  schedules it, before the step that writes it has run; ours when the step is committed.
  The driver commits at once, so traces agree; an uncommitted block is the difference.
- fork / copy-on-write: vLLM v1 has no fork; parallel sampling (n > 1) runs n requests
  that share only full prompt blocks through prefix caching, each recomputing its own
  last block. A fork also shares the partial last block until the first append copies it.
- swap: vLLM v1 has no host pool in its ``KVCacheManager``; a swap-out is its offload
  connector saving the blocks and the request freeing them, a swap-in its asynchronous
  KV load. Our swap-in restores the table block for block without a prefix-cache lookup,
  so the vLLM side is driven without one too (its scheduler would look up first).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pagedbench.reference.allocator import BlockAllocator
from pagedbench.suites.allocator.contract_machine import check_contract
from pagedbench.suites.allocator.vllm_driver import OursDriver, VllmDriver

pytestmark = pytest.mark.vllm


@dataclass
class Trace:
    """The engine's view: which requests run, which wait preempted, and their tokens."""

    tokens: dict[int, list[int]] = field(default_factory=dict)
    running: list[int] = field(default_factory=list)
    preempted: list[int] = field(default_factory=list)
    swapped: list[int] = field(default_factory=list)
    next_id: int = 0


#: Shared prompt heads; a request takes a head's first ``keep`` tokens, often a whole number
#: of blocks (or one past), then a few tokens of its own.
PREFIXES = [[1] * 40, [2, 3] * 20, list(range(40))]
KEEP = st.one_of(st.sampled_from([0, 4, 5, 8, 16, 17, 32, 33, 40]), st.integers(0, 40))
OPS = st.one_of(
    st.tuples(
        st.just("admit"),
        st.integers(0, len(PREFIXES) - 1),
        KEEP,
        st.lists(st.integers(0, 3), min_size=1, max_size=8),
    ),
    st.tuples(st.just("admit_again"), st.integers(0, 63)),
    st.tuples(st.just("decode"), st.integers(0, 3), st.integers(1, 8)),
    st.tuples(st.just("finish"), st.integers(0, 63)),
    st.tuples(st.just("preempt"), st.integers(0, 63)),
    st.tuples(st.just("readmit"), st.integers(0, 63)),
    st.tuples(st.just("swap_out"), st.integers(0, 63)),
    st.tuples(st.just("swap_in"), st.integers(0, 63), st.booleans()),
)


def _run_trace(ops, ours: OursDriver, theirs: VllmDriver) -> list[tuple[str, object]]:
    """Apply ``ops`` to both; compare after every step. Returns the steps checked, as
    (step, the answer both gave: prefix hit, None for a refusal, or append's success)."""
    trace = Trace()
    checked: list[tuple[str, object]] = []

    def check(what: str, mine, vllms) -> None:
        steps = len(checked)
        assert mine == vllms, f"step {steps} ({what}): ours {mine}, vLLM {vllms}"
        assert ours.counts() == theirs.counts(), (
            f"step {steps} ({what}): (free, cached) blocks ours {ours.counts()}, "
            f"vLLM {theirs.counts()}"
        )
        checked.append((what, mine))

    def preempt(request_id: int) -> None:
        trace.running.remove(request_id)
        ours.release(request_id)
        theirs.release(request_id)
        trace.preempted.append(request_id)

    def admit(prompt: list[int]) -> None:
        trace.next_id += 1
        request_id = trace.next_id
        hit = ours.admit(request_id, prompt)
        check(f"admit {request_id}", hit, theirs.admit(request_id, prompt))
        if hit is not None:
            trace.tokens[request_id] = prompt
            trace.running.append(request_id)

    for op in ops:
        if op[0] == "admit":
            _, prefix, keep, suffix = op
            admit(PREFIXES[prefix][:keep] + suffix)
        elif op[0] == "admit_again" and trace.running:
            # The same request again (greedy sampling gives it the same tokens as it
            # decodes): its blocks get cached twice under the same keys.
            admit(list(trace.tokens[trace.running[op[1] % len(trace.running)]]))
        elif op[0] == "decode":
            _, token_id, num_steps = op
            for _ in range(num_steps):
                for request_id in list(trace.running):
                    trace.tokens[request_id].append(token_id)
                    done = ours.append(request_id, token_id)
                    check(f"decode {request_id}", done, theirs.append(request_id, token_id))
                    if not done:  # the engine preempts the request it cannot grow
                        preempt(request_id)
                        check(f"preempt {request_id}", None, None)
        elif op[0] == "finish" and trace.running:
            request_id = trace.running.pop(op[1] % len(trace.running))
            ours.release(request_id)
            theirs.release(request_id)
            theirs.forget(request_id)
            check(f"finish {request_id}", None, None)
        elif op[0] == "preempt" and trace.running:
            preempt(trace.running[op[1] % len(trace.running)])
            check("preempt", None, None)
        elif op[0] == "readmit" and trace.preempted:
            request_id = trace.preempted[op[1] % len(trace.preempted)]
            tokens = trace.tokens[request_id]
            hit = ours.admit(request_id, tokens)
            check(f"readmit {request_id}", hit, theirs.admit(request_id, tokens))
            if hit is not None:
                trace.preempted.remove(request_id)
                trace.running.append(request_id)
        elif op[0] == "swap_out" and trace.running:
            request_id = trace.running.pop(op[1] % len(trace.running))
            ours.swap_out(request_id)
            theirs.swap_out(request_id)
            trace.swapped.append(request_id)
            check(f"swap_out {request_id}", None, None)
        elif op[0] == "swap_in" and trace.swapped:
            _, index, admit_during_copy = op
            request_id = trace.swapped[index % len(trace.swapped)]
            done = ours.swap_in(request_id)
            check(f"swap_in {request_id}", done, theirs.swap_in(request_id))
            if done:
                if admit_during_copy:  # neither may match blocks still being loaded
                    admit(list(trace.tokens[request_id]))
                ours.swap_in_done(request_id)
                theirs.swap_in_done(request_id)
                check(f"swap_in {request_id} done", None, None)
                trace.swapped.remove(request_id)
                trace.running.append(request_id)
        ours.allocator.check_invariants()
    return checked


@pytest.mark.parametrize("caching", [False, True], ids=["no-prefix-caching", "prefix-caching"])
@pytest.mark.parametrize("block_size", [1, 4, 16], ids=lambda bs: f"bs{bs}")
@given(pool_tokens=st.integers(8, 160), ops=st.lists(OPS, min_size=1, max_size=40))
def test_allocator_block_counts_match_vllm(vllm_api, block_size, caching, pool_tokens, ops):
    num_blocks = max(2, pool_tokens // block_size)
    ours = OursDriver(num_blocks, block_size, caching)
    theirs = VllmDriver(vllm_api, num_blocks, block_size, caching)
    _run_trace(ops, ours, theirs)


@pytest.mark.parametrize("caching", [False, True], ids=["no-prefix-caching", "prefix-caching"])
def test_allocator_matches_vllm_on_a_fixed_trace(vllm_api, caching):
    """A hand-written trace that reaches every kind of step, including refusals."""
    ops = [
        ("admit", 2, 40, [0]),  # 41 tokens: 11 of 12 blocks
        ("admit", 2, 16, [7]),  # shares 4 blocks with prefix caching, else refused
        ("decode", 1, 1),
        ("decode", 2, 1),
        ("preempt", 0),
        ("admit", 0, 12, [3, 3]),
        ("readmit", 0),
        ("finish", 0),
        ("readmit", 0),
        ("decode", 3, 6),
        ("finish", 0),
        ("finish", 0),
        ("readmit", 0),
        ("admit", 2, 40, [0]),
    ]
    ours = OursDriver(12, 4, caching)
    theirs = VllmDriver(vllm_api, 12, 4, caching)
    checked = dict(_run_trace(ops, ours, theirs))
    # Request 2's 17 tokens after request 1's 41 (11 of 12 blocks): with prefix caching
    # it hits the 4 full blocks they share and takes the last free one; without, it
    # needs 5 and is refused.
    assert checked["admit 1"] == 0
    assert checked["admit 2"] == (16 if caching else None)
    kinds = {what.split()[0] for what in checked}
    assert kinds == {"admit", "decode", "preempt", "readmit", "finish"}


@pytest.mark.parametrize("prompt_len", [10, 8], ids=["partial-last-block", "whole-blocks"])
def test_fork_versus_vllm_parallel_sampling(vllm_api, prompt_len):
    """n samples of one prompt: fork + copy-on-write here, n prefix-cached requests there.

    By design the counts differ until every sample has written its first token: a fork
    shares the prompt's partial last block and copies it on the first append, while
    vLLM v1 gives each of the n requests its own last block at admission. With a prompt
    of whole blocks, vLLM keeps n - 1 more blocks for good: each later request recomputes
    the cached last block (the hit is capped at ``num_tokens - 1``), which a fork never
    does, since the child inherits the parent's computed state.
    """
    block_size, samples = 4, 3
    prompt = list(range(prompt_len))
    ours = BlockAllocator(32, block_size, enable_prefix_caching=True)
    ours.add_sequence(0, prompt)
    ours.commit(0, prompt_len)  # the prefill ran: the samples fork from its state
    for child in range(1, samples):
        ours.fork(0, child)
    theirs = VllmDriver(vllm_api, 32, block_size, caching=True)
    for request_id in range(samples):
        assert theirs.admit(request_id, prompt) is not None

    def used() -> tuple[int, int]:
        return 32 - ours.num_free_blocks, 32 - theirs.manager.block_pool.get_num_free_blocks()

    full_blocks = prompt_len // block_size
    if prompt_len % block_size:
        assert used() == (full_blocks + 1, full_blocks + samples)
    else:
        assert used() == (full_blocks, full_blocks + samples - 1)
    for request_id in range(samples):
        ours.append_tokens(request_id, [100])
        assert theirs.append(request_id, 100)
    ours.check_invariants()
    copies = ours.pop_copies()
    ours.copy_done(copies)
    if prompt_len % block_size:
        assert used() == (full_blocks + samples, full_blocks + samples)
        assert len(copies) == samples - 1
    else:
        assert used() == (full_blocks + samples, full_blocks + 2 * samples - 1)
        assert copies == []


def test_eviction_order_matches_vllm(vllm_api):
    """The scenario of test_eviction_takes_uncached_blocks_then_a_finished_request_tail_first,
    on both: the prefix hit after the pool was cycled depends on the whole reuse order."""
    head = list(range(12))
    ours, theirs = OursDriver(16, 4, caching=True), VllmDriver(vllm_api, 16, 4, caching=True)
    for driver in (ours, theirs):
        driver.admit(1, head + [0])
        driver.release(1)
        driver.admit(2, [1] * 53)
        driver.release(2)
        driver.admit(3, [9, 9, 9])
    assert ours.counts() == theirs.counts()
    assert ours.admit(4, head + [5]) == theirs.admit(4, head + [5]) == 8


def test_duplicate_key_lookup_matches_vllm(vllm_api):
    """A lookup at a key with two cached blocks, one in use and one not, takes the one
    registered first on both; taking the other would leave one more block free.

    A (9 tokens) and B, the same request again, share A's two full blocks; B computes its
    own third block. Both decode the same 3 tokens, so their third blocks fill alike and
    are both cached, A's first. A finishes; B decodes one more token, and C, the same
    request as B, looks up the third key.
    """
    ours, theirs = OursDriver(16, 4, caching=True), VllmDriver(vllm_api, 16, 4, caching=True)
    prompt = list(range(9))
    for driver in (ours, theirs):
        assert driver.admit(1, prompt) == 0
        assert driver.admit(2, prompt) == 8
        for token_id in (5, 5, 5):
            assert driver.append(1, token_id) and driver.append(2, token_id)
        driver.release(1)
        assert driver.append(2, 6)
    pool = ours.allocator._pool
    third_key = pool.block_hash[ours.allocator.block_table(2)[2]]
    copies = list(pool._cached[third_key])
    assert len(copies) == 2 and [pool.ref[b] for b in copies] == [0, 1]  # A's free, B's used
    assert ours.counts() == theirs.counts()
    tokens = prompt + [5, 5, 5, 6]
    assert ours.admit(3, tokens) == theirs.admit(3, tokens) == 12
    assert ours.allocator.block_table(3)[2] == copies[0]
    assert ours.counts() == theirs.counts()
    ours.allocator.check_invariants()


def test_swap_in_matches_vllm_async_kv_load(vllm_api):
    """Swap out, evict the cached originals, swap back in: both allocate one block per
    block, neither matches the blocks while the load runs, both do once it is done."""
    ours, theirs = OursDriver(12, 4, caching=True), VllmDriver(vllm_api, 12, 4, caching=True)
    prompt = list(range(9))
    for driver in (ours, theirs):
        assert driver.admit(1, prompt) == 0
        driver.swap_out(1)
        assert driver.admit(2, [7] * 48) == 0  # the whole pool: evicts 1's cached blocks
        driver.release(2)
    assert ours.counts() == theirs.counts()
    for driver in (ours, theirs):
        assert driver.swap_in(1)
    assert ours.counts() == theirs.counts()
    assert ours.admit(3, prompt) == theirs.admit(3, prompt) == 0  # still loading
    for driver in (ours, theirs):
        driver.release(3)
        driver.swap_in_done(1)
    assert ours.counts() == theirs.counts()
    assert ours.admit(4, prompt) == theirs.admit(4, prompt) == 8
    assert ours.counts() == theirs.counts()
    ours.allocator.check_invariants()


def test_uncommitted_block_matched_by_vllm_not_by_us(vllm_api):
    """By design: vLLM caches a block when ``allocate_slots`` schedules it (so another
    request in the same batch can share it, ``docs/design/prefix_caching.md``); here a
    block is matchable only once the step that writes it is committed, so a request
    admitted in between computes its own copy."""
    ours = BlockAllocator(8, 4, seed=0, enable_prefix_caching=True)
    theirs = VllmDriver(vllm_api, 8, 4, caching=True)
    prompt = list(range(9))
    ours.add_sequence(1, prompt)  # allocated; its prefill has not run
    assert theirs.admit(1, prompt) == 0
    assert ours.add_sequence(2, prompt) == 0
    assert theirs.admit(2, prompt) == 8
    ours.commit(1, len(prompt))
    assert ours.add_sequence(3, prompt) == 8


@pytest.mark.parametrize("pool", ["ample", "tight"])
def test_vllm_keeps_the_allocator_contract(vllm_api, pool):
    """vLLM's ``KVCacheManager`` under the allocator contract's state machine
    (``contract_machine.py``), here so that this file's process imports vLLM once."""
    check_contract("vllm", pool)
