"""Example tests for the allocator boundaries that public bug reports keep hitting.

Every expected number here is worked out by hand from the scenario (block counts, slots,
hits), not read back from the allocator. ``_prefill`` is what an engine does for a new
request: allocate the prompt, run the prefill, commit it.
"""

from __future__ import annotations

import numpy
import pytest

from pagedbench.reference.errors import PagedTypeError
from pagedbench.reference.allocator import (
    AllocatorInvariantError,
    AllocatorUsage,
    BlockAllocator,
    BlockCopy,
    CopyKind,
    OutOfBlocksError,
    chain_hash,
)

BLOCK_SIZE = 4


def _prefix_allocator(num_blocks: int) -> BlockAllocator:
    return BlockAllocator(num_blocks, BLOCK_SIZE, seed=0, enable_prefix_caching=True)


def _prefill(allocator: BlockAllocator, seq_id, prompt) -> int:
    """Admit ``prompt`` and commit it, as after its prefill step; returns the prefix hit."""
    hit = allocator.add_sequence(seq_id, prompt)
    allocator.commit(seq_id, len(prompt))
    return hit


def _decode(allocator: BlockAllocator, seq_id, tokens) -> list[int]:
    """Append ``tokens``, finish any copy-on-write copy and commit, as after a step."""
    slots = allocator.append_tokens(seq_id, tokens)
    allocator.copy_done(allocator.pop_copies())
    allocator.commit(seq_id, allocator.num_tokens(seq_id))
    return slots


@pytest.mark.parametrize("num_full_blocks", [1, 2, 3])
def test_full_prefix_hit_on_whole_blocks_leaves_one_block_to_compute(num_full_blocks):
    """A prompt that is exactly cached whole blocks hits all but its last block.

    The last token must be computed to get logits; a hit on the whole prompt would have
    nothing to compute and would write into the shared cached block (vLLM caps the hit at
    ``num_tokens - 1`` and so recomputes the last block).
    """
    prompt = list(range(num_full_blocks * BLOCK_SIZE))
    allocator = _prefix_allocator(16)
    assert _prefill(allocator, "first", prompt) == 0
    first_table = allocator.block_table("first")
    hit = allocator.add_sequence("second", prompt)
    second_table = allocator.block_table("second")
    allocator.check_invariants()
    assert hit == (num_full_blocks - 1) * BLOCK_SIZE
    assert second_table[:-1] == first_table[:-1]
    assert second_table[-1] != first_table[-1]
    assert allocator.usage().blocks_used == num_full_blocks + 1


def test_prompt_one_token_past_cached_blocks_hits_them_all():
    prompt = list(range(2 * BLOCK_SIZE))
    allocator = _prefix_allocator(8)
    _prefill(allocator, "first", prompt)
    assert allocator.add_sequence("second", prompt + [99]) == 2 * BLOCK_SIZE
    assert allocator.usage().blocks_used == 3
    allocator.check_invariants()


def test_free_with_duplicate_ids_frees_nothing():
    allocator = BlockAllocator(8, BLOCK_SIZE)
    allocator.add_sequence("a", [1, 2, 3, 4, 5])
    allocator.add_sequence("b", [6])
    with pytest.raises(ValueError, match=r"duplicate seq_ids \['a'\]"):
        allocator.free("a", "b", "a")
    allocator.check_invariants()
    assert allocator.sequences() == ["a", "b"]
    assert allocator.num_free_blocks == 8 - 3


def test_free_of_an_unknown_id_frees_nothing():
    allocator = BlockAllocator(8, BLOCK_SIZE)
    allocator.add_sequence("a", [1, 2])
    with pytest.raises(KeyError, match="unknown sequence 'ghost'"):
        allocator.free("a", "ghost")
    assert allocator.sequences() == ["a"]
    allocator.check_invariants()


def test_double_free_is_refused():
    allocator = BlockAllocator(8, BLOCK_SIZE)
    allocator.add_sequence("a", [1, 2])
    assert "a" in allocator
    allocator.free("a")
    assert "a" not in allocator
    with pytest.raises(KeyError, match="already freed"):
        allocator.free("a")
    assert allocator.num_free_blocks == 8
    allocator.check_invariants()


def test_free_with_no_id_is_refused():
    with pytest.raises(ValueError, match="at least one seq_id"):
        BlockAllocator(4, BLOCK_SIZE).free()


def test_referenced_cached_block_survives_pool_pressure():
    """A cached block that a live sequence still holds is never evicted.

    Two requests share the first block of a prefix; one ends. Filling the rest of the pool
    must take only unreferenced blocks: the survivor's tokens stay where they are and the
    prefix still hits.
    """
    prefix = [7, 7, 7, 7]
    allocator = _prefix_allocator(6)
    _prefill(allocator, "a", prefix + [1])
    shared = allocator.block_table("a")[0]
    assert _prefill(allocator, "b", prefix + [2]) == BLOCK_SIZE
    assert allocator.block_table("b")[0] == shared
    allocator.free("a")
    # a's tail block is free again; the shared block stays in use, held by b.
    assert allocator.usage() == AllocatorUsage(
        num_blocks=6,
        blocks_used=2,
        blocks_free=4,
        blocks_cached=0,
        tokens_stored=5,
        slots_allocated=8,
        fragmentation_slots=3,
        host_blocks_used=0,
        blocks_in_flight=0,
    )
    allocator.add_sequence("filler", list(range(100, 100 + 4 * BLOCK_SIZE)))
    assert allocator.num_free_blocks == 0
    assert allocator.block_table("b")[0] == shared
    allocator.free("filler")
    assert allocator.add_sequence("c", prefix + [3]) == BLOCK_SIZE
    assert allocator.block_table("c")[0] == shared
    allocator.check_invariants()


def test_unreferenced_cached_blocks_are_evicted_least_recently_freed_first():
    allocator = _prefix_allocator(4)
    old, new = [1, 1, 1, 1], [2, 2, 2, 2]
    _prefill(allocator, "old", old + [0])
    _prefill(allocator, "new", new + [0])
    allocator.free("old")
    allocator.free("new")
    usage = allocator.usage()
    assert (usage.blocks_cached, usage.blocks_free) == (2, 2)
    # Three blocks: the two uncached tails first, then the cached block freed first.
    allocator.add_sequence("filler")
    allocator.append_tokens("filler", 3 * BLOCK_SIZE)
    assert allocator.usage().blocks_cached == 1
    allocator.free("filler")
    assert allocator.add_sequence("again-new", new + [0]) == BLOCK_SIZE
    assert allocator.add_sequence("again-old", old + [0]) == 0
    allocator.check_invariants()


def test_eviction_removes_the_hash_entry():
    prefix = [5, 6, 7, 8]
    allocator = _prefix_allocator(2)
    _prefill(allocator, "a", prefix + [0])
    allocator.free("a")
    assert allocator.usage().blocks_cached == 1
    allocator.add_sequence("filler", list(range(2 * BLOCK_SIZE)))
    assert allocator.usage().blocks_cached == 0
    allocator.check_invariants()
    allocator.free("filler")
    assert allocator.add_sequence("b", prefix + [0]) == 0


def test_block_is_matchable_only_once_full():
    allocator = _prefix_allocator(8)
    _prefill(allocator, "writer", [1, 2, 3])
    assert _prefill(allocator, "early", [1, 2, 3, 4, 9]) == 0
    allocator.free("early")  # its own copy of the block is cached now: drop it
    allocator.add_sequence("filler")
    allocator.append_tokens("filler", 7 * BLOCK_SIZE)
    allocator.free("filler")
    _decode(allocator, "writer", [4])
    assert allocator.add_sequence("late", [1, 2, 3, 4, 9]) == BLOCK_SIZE
    assert allocator.block_table("late")[0] == allocator.block_table("writer")[0]
    allocator.check_invariants()


def test_tokens_without_ids_are_never_cached():
    allocator = _prefix_allocator(8)
    allocator.add_sequence("a")
    allocator.append_tokens("a", 2 * BLOCK_SIZE)
    allocator.free("a")
    assert allocator.usage().blocks_cached == 0


def test_fork_shares_every_block_and_append_copies_the_partial_last_one():
    allocator = BlockAllocator(8, BLOCK_SIZE, seed=3)
    _prefill(allocator, "parent", list(range(6)))  # one full block, one with 2 tokens
    allocator.fork("parent", "child")
    table = allocator.block_table("parent")
    assert allocator.block_table("child") == table
    assert allocator.usage().blocks_used == 2
    slots = allocator.append_tokens("child", [100])
    child_table = allocator.block_table("child")
    copy = BlockCopy(table[1], child_table[1], CopyKind.COPY_ON_WRITE)
    assert allocator.pop_copies() == [copy]
    assert allocator.pop_copies() == []
    allocator.copy_done([copy])
    assert child_table[0] == table[0] and child_table[1] != table[1]
    assert slots == [child_table[1] * BLOCK_SIZE + 2]
    # The parent keeps its block, now unshared: its append copies nothing.
    assert allocator.append_tokens("parent", [200]) == [table[1] * BLOCK_SIZE + 2]
    assert allocator.pop_copies() == []
    assert allocator.usage().blocks_used == 3
    allocator.check_invariants()


def test_fork_of_full_blocks_needs_no_copy():
    allocator = BlockAllocator(8, BLOCK_SIZE)
    _prefill(allocator, "parent", list(range(8)))
    allocator.fork("parent", "child")
    assert allocator.blocks_needed("child", 1) == 1
    allocator.append_tokens("child", [1])
    assert allocator.pop_copies() == []
    assert allocator.usage().blocks_used == 3


def test_copy_on_write_counts_toward_the_blocks_needed():
    allocator = BlockAllocator(3, BLOCK_SIZE)
    _prefill(allocator, "parent", [1, 2, 3])
    allocator.fork("parent", "child")
    # 3 + 3 tokens: one block copied, one more for the overflow.
    assert allocator.blocks_needed("child", 3) == 2
    allocator.add_sequence("other", [9])
    with pytest.raises(OutOfBlocksError, match=r"needs 2 free blocks but only 1 .*short by 1"):
        allocator.append_tokens("child", [4, 5, 6])
    assert allocator.pop_copies() == []
    allocator.check_invariants()


def test_append_past_the_pool_is_refused_and_changes_nothing():
    allocator = BlockAllocator(4, BLOCK_SIZE)
    allocator.add_sequence("a", [0] * 10)  # 3 blocks
    with pytest.raises(OutOfBlocksError) as refused:
        allocator.append_tokens("a", 2 * BLOCK_SIZE + 3)  # to 21 tokens: 6 blocks
    assert (refused.value.needed, refused.value.available, refused.value.shortfall) == (3, 1, 2)
    assert "short by 2" in str(refused.value)
    assert allocator.num_tokens("a") == 10
    assert allocator.num_free_blocks == 1
    allocator.check_invariants()


def test_prompt_past_the_pool_is_refused_and_changes_nothing():
    allocator = BlockAllocator(2, BLOCK_SIZE)
    with pytest.raises(OutOfBlocksError, match="needs 3 free blocks but only 2"):
        allocator.add_sequence("a", list(range(9)))
    assert allocator.sequences() == []
    allocator.check_invariants()


def test_slot_mapping_of_a_batch_of_appends():
    allocator = BlockAllocator(8, BLOCK_SIZE, seed=None)  # ascending free list: 0, 1, 2, ...
    allocator.add_sequence("a")
    assert allocator.append_tokens("a", 3) == [0, 1, 2]
    allocator.add_sequence("b")
    assert allocator.append_tokens("b", [9]) == [4]
    assert allocator.append_tokens("a", 3) == [3, 8, 9]
    assert allocator.block_table("a") == [0, 2]


def test_usage_counts_fragmentation_by_hand():
    allocator = BlockAllocator(10, 16)
    for seq_id, length in (("one", 1), ("full", 16), ("past", 17)):
        allocator.add_sequence(seq_id)
        allocator.append_tokens(seq_id, length)
    usage = allocator.usage()
    assert (usage.blocks_used, usage.blocks_free, usage.blocks_cached) == (4, 6, 0)
    assert (usage.tokens_stored, usage.slots_allocated) == (34, 64)
    assert usage.fragmentation_slots == 30  # 15 after "one", 15 after "past"


def test_preempt_returns_tokens_to_recompute_and_prefix_cache_serves_the_readmission():
    allocator = _prefix_allocator(8)
    tokens = list(range(10))
    _prefill(allocator, "a", tokens[:6])
    _decode(allocator, "a", tokens[6:])
    assert allocator.preempt("a") == 10
    assert allocator.sequences() == []
    assert allocator.usage().blocks_cached == 2  # the two full blocks
    assert allocator.add_sequence("a", tokens) == 2 * BLOCK_SIZE
    allocator.check_invariants()


def test_swap_out_and_in_reports_the_copies():
    allocator = BlockAllocator(6, BLOCK_SIZE, num_host_blocks=4)
    _prefill(allocator, "a", list(range(6)))
    table = allocator.block_table("a")
    out = allocator.swap_out("a")
    assert [(c.src, c.kind) for c in out] == [(b, CopyKind.SWAP_OUT) for b in table]
    assert allocator.is_swapped_out("a") and allocator.block_table("a") == []
    # The device blocks stay pinned until the copies are done.
    assert allocator.num_free_blocks == 4 and allocator.usage().blocks_in_flight == 2
    allocator.copy_done(out)
    assert allocator.num_free_blocks == 6 and allocator.usage().host_blocks_used == 2
    with pytest.raises(ValueError, match="swapped out"):
        allocator.append_tokens("a", 1)
    back = allocator.swap_in("a")
    assert [c.src for c in back] == [c.dst for c in out]
    assert [c.dst for c in back] == allocator.block_table("a")
    assert {c.kind for c in back} == {CopyKind.SWAP_IN}
    # The host blocks are read until the copies are done.
    assert allocator.num_tokens("a") == 6 and allocator.usage().host_blocks_used == 2
    allocator.copy_done(back)
    assert allocator.usage().host_blocks_used == 0
    allocator.check_invariants()


def test_swap_out_needs_room_in_the_host_pool():
    allocator = BlockAllocator(6, BLOCK_SIZE, num_host_blocks=1)
    _prefill(allocator, "a", list(range(6)))
    with pytest.raises(OutOfBlocksError, match="needs 2 host blocks but only 1"):
        allocator.swap_out("a")
    assert not allocator.is_swapped_out("a")
    allocator.check_invariants()


def test_swapped_out_sequence_frees_its_host_blocks():
    allocator = BlockAllocator(6, BLOCK_SIZE)
    _prefill(allocator, "a", list(range(6)))
    allocator.copy_done(allocator.swap_out("a"))
    allocator.free("a")
    assert allocator.usage().host_blocks_used == 0
    allocator.check_invariants()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_blocks": 0, "block_size": 16}, "num_blocks must be an int >= 1, got 0"),
        ({"num_blocks": 4, "block_size": 0}, "block_size must be an int >= 1, got 0"),
        ({"num_blocks": 4.0, "block_size": 16}, "num_blocks must be an int >= 1, got 4.0"),
        ({"num_blocks": 4, "block_size": 16, "num_host_blocks": -1}, "num_host_blocks"),
    ],
)
def test_bad_parameters_name_the_parameter(kwargs, message):
    with pytest.raises(ValueError, match=message):
        BlockAllocator(**kwargs)


@pytest.mark.parametrize("bad", [1.5, "7", True, 2**63])
def test_bad_token_ids_are_refused(bad):
    allocator = BlockAllocator(4, BLOCK_SIZE)
    with pytest.raises(ValueError, match="token_ids must be ints in int64 range"):
        allocator.add_sequence("a", [1, bad])
    assert allocator.sequences() == []


def test_negative_count_is_refused():
    allocator = BlockAllocator(4, BLOCK_SIZE)
    allocator.add_sequence("a")
    with pytest.raises(ValueError, match="tokens must be a count >= 0"):
        allocator.append_tokens("a", -1)


def test_chain_hash_depends_on_the_whole_prefix():
    block = [1, 2, 3, 4]
    root = chain_hash(b"", block)
    assert chain_hash(b"", list(block)) == root
    assert chain_hash(root, block) != root
    assert chain_hash(chain_hash(b"", [0, 0, 0, 0]), block) != chain_hash(root, block)


@pytest.mark.parametrize(
    ("corrupt", "invariant"),
    [
        (lambda a, b: a._pool.ref.__setitem__(b, a._pool.ref[b] + 1), "ref count"),
        (lambda a, b: a._pool._free.__setitem__(b, None), "partition"),
        (lambda a, b: a._pool.content[b].append(0), "block fill"),
        (lambda a, b: setattr(a._pool, "tokens_stored", a._pool.tokens_stored + 1), "accounting"),
        (lambda a, b: a._seqs["x"].blocks.append(b), "holds a block twice"),
        (lambda a, b: a._pool.pin(b), "pin count"),
        (lambda a, b: setattr(a._seqs["x"], "num_committed", 3), "commit"),
    ],
    ids=["ref-count", "free-and-used", "overfilled", "token-count", "duplicate-entry",
         "stray-pin", "overcommitted"],
)
def test_check_invariants_names_the_broken_invariant(corrupt, invariant):
    """The checker is not vacuous: each corruption of the state is reported by name."""
    allocator = BlockAllocator(4, BLOCK_SIZE)
    allocator.add_sequence("x", [1, 2])
    allocator.check_invariants()
    corrupt(allocator, allocator.block_table("x")[0])
    with pytest.raises(AllocatorInvariantError, match=invariant):
        allocator.check_invariants()


def test_check_invariants_catches_a_cache_entry_with_wrong_content():
    allocator = _prefix_allocator(4)
    _prefill(allocator, "x", [1, 2, 3, 4, 5])
    block = allocator.block_table("x")[0]
    allocator._pool.content[block][0] = 9
    with pytest.raises(AllocatorInvariantError, match="hash"):
        allocator.check_invariants()


def test_eviction_takes_uncached_blocks_then_a_finished_request_tail_first():
    """Reuse order of the free queue (vLLM v1 ``BlockPool.free_blocks``).

    Uncached blocks are reused before any cached one, and a finished request's cached
    blocks are evicted tail first, so a later request still hits the head of the prefix.
    16 blocks of 4: A caches 3 blocks and ends; a 14-block filler takes the 13 uncached
    blocks and evicts only A's third block; after the filler ends, a 1-block request takes
    the filler's uncached partial block; a request with A's prefix then hits 2 blocks.
    """
    head = list(range(12))
    allocator = _prefix_allocator(16)
    _prefill(allocator, "a", head + [0])
    allocator.free("a")
    allocator.add_sequence("filler", [1] * 53)
    allocator.free("filler")
    allocator.add_sequence("small", [9, 9, 9])
    assert allocator.add_sequence("b", head + [5]) == 2 * BLOCK_SIZE
    allocator.check_invariants()


def test_numpy_integers_are_accepted_and_other_types_named():
    allocator = BlockAllocator(numpy.int64(4), numpy.int32(BLOCK_SIZE))
    allocator.add_sequence("a", numpy.arange(5))
    assert allocator.append_tokens("a", numpy.int64(2)) == [
        allocator.block_table("a")[1] * BLOCK_SIZE + offset for offset in (1, 2)
    ]
    with pytest.raises(PagedTypeError, match="token_ids must be a sequence of ints, got 2.0"):
        allocator.append_tokens("a", 2.0)
