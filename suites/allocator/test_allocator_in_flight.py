"""Data in flight: uncommitted tokens are never matchable, a block a pending copy uses is pinned.

A serving engine allocates slots, runs the step that writes K/V there, and only then may
another request read them; a copy (copy-on-write, swap out, swap in) likewise reads and
writes blocks after the allocator handed them out. Public reports show engines getting
this wrong: a prefix-cache hit on a block whose prefill had not run yet, an offloaded
block reused before its copy finished. Every expected number is worked out by hand.
"""

from __future__ import annotations

import pytest

from pagedbench.reference.allocator import (
    AllocatorInvariantError,
    BlockAllocator,
    BlockCopy,
    CopyKind,
    OutOfBlocksError,
)

BLOCK_SIZE = 4
PROMPT = [1, 2, 3, 4, 5]  # one full block and one token


def _caching(num_blocks: int, num_host_blocks: int | None = None) -> BlockAllocator:
    return BlockAllocator(
        num_blocks, BLOCK_SIZE, seed=0, enable_prefix_caching=True, num_host_blocks=num_host_blocks
    )


def _prefill(allocator: BlockAllocator, seq_id, prompt) -> int:
    hit = allocator.add_sequence(seq_id, prompt)
    allocator.commit(seq_id, len(prompt))
    return hit


def test_uncommitted_block_is_never_matched():
    allocator = _caching(8)
    allocator.add_sequence("writer", PROMPT)  # allocated, its prefill not run yet
    assert allocator.add_sequence("early", PROMPT) == 0
    allocator.commit("writer", 3)  # block 0 holds 4 tokens, 3 written
    assert allocator.add_sequence("still-early", PROMPT) == 0
    allocator.commit("writer", 5)
    assert allocator.add_sequence("late", PROMPT) == BLOCK_SIZE
    assert allocator.block_table("late")[0] == allocator.block_table("writer")[0]
    # The early readers computed their own copy of block 0; it is not matchable either.
    assert allocator.num_committed("early") == 0
    allocator.check_invariants()


def test_commit_is_bounded_by_what_was_committed_and_what_is_held():
    allocator = _caching(8)
    allocator.add_sequence("a", PROMPT)
    allocator.commit("a", 2)
    allocator.commit("a", 2)  # committing again what is committed changes nothing
    for bad in (1, 6, 2.5):
        with pytest.raises(ValueError, match=r"commit: num_tokens of sequence 'a' .*\[2, 5\]"):
            allocator.commit("a", bad)
    assert allocator.num_committed("a") == 2
    with pytest.raises(KeyError, match="unknown sequence 'b'"):
        allocator.commit("b", 0)


def test_fork_and_swap_out_refuse_data_not_yet_written():
    allocator = _caching(8)
    allocator.add_sequence("a", PROMPT)
    with pytest.raises(ValueError, match=r"fork: sequence 'a' has 5 uncommitted tokens"):
        allocator.fork("a", "b")
    with pytest.raises(ValueError, match=r"swap_out: sequence 'a' has 5 uncommitted tokens"):
        allocator.swap_out("a")
    assert allocator.sequences() == ["a"] and allocator.usage().host_blocks_used == 0
    allocator.commit("a", 5)
    allocator.fork("a", "b")
    allocator.check_invariants()


def test_copy_on_write_source_stays_pinned_until_the_copy_is_done():
    """The shared block a copy-on-write reads stays out of circulation while the copy runs,
    even when every table that held it is freed meanwhile."""
    allocator = BlockAllocator(4, BLOCK_SIZE, seed=0)
    _prefill(allocator, "parent", [1, 2])
    allocator.fork("parent", "child")
    src = allocator.block_table("parent")[0]
    allocator.append_tokens("child", [3])
    (copy,) = allocator.pop_copies()
    assert copy == BlockCopy(src, allocator.block_table("child")[0], CopyKind.COPY_ON_WRITE)
    allocator.free("parent")
    usage = allocator.usage()
    assert (usage.blocks_used, usage.blocks_in_flight, usage.blocks_free) == (1, 1, 2)
    assert allocator.num_free_blocks == 2
    with pytest.raises(OutOfBlocksError, match="needs 3 free blocks but only 2 of 4"):
        allocator.add_sequence("big", list(range(12)))
    allocator.add_sequence("filler", list(range(8)))  # the two free blocks, never src
    assert src not in allocator.block_table("filler")
    allocator.check_invariants()
    allocator.copy_done([copy])
    assert allocator.num_free_blocks == 1 and allocator.usage().blocks_in_flight == 0
    allocator.append_tokens("filler", [9])
    assert allocator.block_table("filler")[-1] == src
    allocator.check_invariants()


def test_copy_on_write_target_is_matchable_only_once_the_copy_is_done():
    allocator = _caching(8)
    _prefill(allocator, "parent", [1, 2, 3])
    allocator.fork("parent", "child")
    allocator.append_tokens("child", [4])  # fills the copied block
    allocator.commit("child", 4)
    assert allocator.add_sequence("reader", [1, 2, 3, 4, 9]) == 0
    allocator.copy_done(allocator.pop_copies())
    assert allocator.add_sequence("late", [1, 2, 3, 4, 9]) == BLOCK_SIZE
    assert allocator.block_table("late")[0] == allocator.block_table("child")[0]
    allocator.check_invariants()


def test_swap_out_sources_stay_pinned_until_the_copy_is_done():
    allocator = BlockAllocator(3, BLOCK_SIZE, seed=0)
    _prefill(allocator, "a", PROMPT)
    out = allocator.swap_out("a")
    assert allocator.num_free_blocks == 1 and allocator.usage().blocks_in_flight == 2
    with pytest.raises(OutOfBlocksError, match="needs 2 free blocks but only 1 of 3"):
        allocator.add_sequence("b", list(range(8)))
    allocator.copy_done(out[1:])
    assert allocator.num_free_blocks == 2
    allocator.add_sequence("b", list(range(8)))
    assert out[0].src not in allocator.block_table("b")
    allocator.check_invariants()


def test_prefix_hit_on_a_block_a_swap_out_still_reads_costs_no_free_block():
    """The swapped-out sequence's cached blocks are pinned, not free: sharing them takes
    nothing from the free queue, so the same request fits in the one free block."""
    allocator = _caching(4)
    prompt = list(range(9))  # two full blocks and one token: 3 of the 4 blocks
    _prefill(allocator, "a", prompt)
    out = allocator.swap_out("a")
    assert allocator.num_free_blocks == 1 and allocator.usage().blocks_in_flight == 3
    assert allocator.blocks_needed_for_prompt(prompt) == 1
    assert allocator.add_sequence("b", prompt) == 2 * BLOCK_SIZE
    assert allocator.block_table("b")[:2] == [c.src for c in out[:2]]
    allocator.copy_done(out)
    assert allocator.num_free_blocks == 1  # a's partial block; the shared two stay in use
    allocator.check_invariants()


def test_swap_in_waits_for_the_swap_out_copies():
    allocator = BlockAllocator(4, BLOCK_SIZE, seed=0)
    _prefill(allocator, "a", PROMPT)
    out = allocator.swap_out("a")
    with pytest.raises(ValueError, match=r"swap_in: the swap-out copies of sequence 'a'"):
        allocator.swap_in("a")
    allocator.copy_done(out)
    assert len(allocator.swap_in("a")) == 2


def test_host_blocks_read_by_a_swap_in_stay_pinned():
    allocator = BlockAllocator(6, BLOCK_SIZE, seed=0, num_host_blocks=2)
    _prefill(allocator, "a", PROMPT)
    allocator.copy_done(allocator.swap_out("a"))
    back = allocator.swap_in("a")
    _prefill(allocator, "b", PROMPT)
    with pytest.raises(OutOfBlocksError, match="needs 2 host blocks but only 0 of 2"):
        allocator.swap_out("b")
    allocator.copy_done(back)
    assert allocator.usage().host_blocks_used == 0
    allocator.copy_done(allocator.swap_out("b"))
    allocator.check_invariants()


def test_swap_in_registers_the_full_blocks_once_the_copies_are_done():
    """The converse of the cache map: a swapped-in sequence's full blocks are findable."""
    allocator = _caching(8)
    prompt = list(range(9))  # two full blocks and one token
    _prefill(allocator, "a", prompt)
    allocator.copy_done(allocator.swap_out("a"))
    # Evict the cached device copies of a's blocks: the filler takes all 8 blocks.
    allocator.add_sequence("filler")
    allocator.append_tokens("filler", 8 * BLOCK_SIZE)
    allocator.free("filler")
    assert allocator.usage().blocks_cached == 0
    back = allocator.swap_in("a")
    assert allocator.add_sequence("early", prompt) == 0  # the blocks are still arriving
    allocator.free("early")
    allocator.copy_done(back[1:])  # block 0 still arriving: nothing after it registers
    assert allocator.add_sequence("early-again", prompt) == 0
    allocator.free("early-again")
    allocator.copy_done(back[:1])
    assert allocator.add_sequence("late", prompt) == 2 * BLOCK_SIZE
    assert allocator.block_table("late")[:2] == allocator.block_table("a")[:2]
    allocator.check_invariants()


def test_target_freed_before_its_copy_is_done_returns_when_done():
    allocator = BlockAllocator(4, BLOCK_SIZE, seed=0)
    _prefill(allocator, "a", PROMPT)
    allocator.copy_done(allocator.swap_out("a"))
    back = allocator.swap_in("a")
    allocator.free("a")
    usage = allocator.usage()
    assert (usage.blocks_in_flight, usage.host_blocks_used, allocator.num_free_blocks) == (2, 2, 2)
    allocator.copy_done(back)
    assert allocator.num_free_blocks == 4 and allocator.usage().host_blocks_used == 0
    allocator.check_invariants()


def test_copy_done_refuses_copies_that_are_not_pending_and_changes_nothing():
    allocator = BlockAllocator(4, BLOCK_SIZE, seed=0)
    _prefill(allocator, "a", PROMPT)
    out = allocator.swap_out("a")
    stranger = BlockCopy(out[0].src, out[0].dst, CopyKind.SWAP_IN)
    with pytest.raises(ValueError, match="not pending"):
        allocator.copy_done([out[0], stranger])
    with pytest.raises(ValueError, match="more than once"):
        allocator.copy_done([out[0], out[0]])
    with pytest.raises(TypeError, match="BlockCopy"):
        allocator.copy_done([(out[0].src, out[0].dst)])
    assert allocator.pending_copies() == out
    allocator.copy_done(out)
    with pytest.raises(ValueError, match="not pending"):
        allocator.copy_done(out[:1])
    assert allocator.pending_copies() == []
    allocator.check_invariants()


def test_check_invariants_catches_a_full_block_missing_from_the_cache():
    allocator = _caching(4)
    _prefill(allocator, "a", PROMPT)
    allocator._pool._unregister(allocator.block_table("a")[0])
    with pytest.raises(AllocatorInvariantError, match="prefix cache: sequence 'a' has 1 full"):
        allocator.check_invariants()


def test_check_invariants_catches_a_block_registered_before_it_is_committed():
    allocator = _caching(4)
    allocator.add_sequence("a", PROMPT)
    block = allocator.block_table("a")[0]
    allocator._pool.register(block, b"", allocator._seqs["a"].hashes[0])
    with pytest.raises(AllocatorInvariantError, match="registered past its 0 committed"):
        allocator.check_invariants()
