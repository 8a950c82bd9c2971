"""Duplicate keys and the eviction order of cached blocks, by hand.

Equal blocks filled independently are all cached under one key (vLLM's
``BlockHashToBlockMap`` does not deduplicate, so block tables stay append-only); a lookup
takes the block registered first (``get_one_block``). Which one it takes is visible in the
free-block count whenever one copy is in use and another is not: a hit on the copy in use
costs no free block, a hit on the unreferenced copy takes it out of the free queue.
"""

from __future__ import annotations

import pytest

from pagedbench.reference.allocator import BlockAllocator

BLOCK_SIZE = 4
HEAD = [7, 7, 7, 7]
PROMPT = HEAD + [1]


def _caching(num_blocks: int) -> BlockAllocator:
    return BlockAllocator(num_blocks, BLOCK_SIZE, seed=0, enable_prefix_caching=True)


def _two_copies_of_head(commit_first: str) -> BlockAllocator:
    """"a" and "b" fill HEAD independently (neither can hit the other before it commits);
    ``commit_first`` commits first, so its block is registered first."""
    allocator = _caching(8)
    allocator.add_sequence("a", PROMPT)
    assert allocator.add_sequence("b", PROMPT) == 0
    second = "b" if commit_first == "a" else "a"
    allocator.commit(commit_first, len(PROMPT))
    allocator.commit(second, len(PROMPT))
    return allocator


@pytest.mark.parametrize(
    ("commit_first", "need"),
    [("a", 2), ("b", 1)],
    ids=["first-registered-is-free", "first-registered-is-in-use"],
)
def test_lookup_takes_the_block_registered_first(commit_first, need):
    """After "a" ends, its head is cached and free and "b"'s is in use. The hit takes the
    one committed first: the free one costs a block from the queue besides the tail's."""
    allocator = _two_copies_of_head(commit_first)
    first = allocator.block_table(commit_first)[0]
    allocator.free("a")
    free_before = allocator.num_free_blocks
    assert allocator.blocks_needed_for_prompt(PROMPT) == need
    assert allocator.add_sequence("c", PROMPT) == BLOCK_SIZE
    assert allocator.block_table("c")[0] == first
    assert allocator.num_free_blocks == free_before - need
    allocator.check_invariants()


def test_evicting_the_first_copy_leaves_the_second_matchable():
    allocator = _two_copies_of_head(commit_first="a")
    second = allocator.block_table("b")[0]
    allocator.free("a", "b")
    # 8 blocks: a's and b's tails (uncached) go first, then a's head, b's head: a 7-block
    # filler evicts a's head (released first), not b's.
    allocator.add_sequence("filler")
    allocator.append_tokens("filler", 7 * BLOCK_SIZE)
    allocator.free("filler")
    assert allocator.add_sequence("c", PROMPT) == BLOCK_SIZE
    assert allocator.block_table("c")[0] == second
    allocator.check_invariants()


def test_whole_block_prompt_caches_a_second_copy_of_its_last_block():
    """A prompt of whole cached blocks recomputes its last block (the hit leaves one token
    to compute), so that block is cached twice once the second request commits."""
    allocator = _caching(8)
    allocator.add_sequence("a", HEAD)
    allocator.commit("a", 4)
    assert allocator.add_sequence("b", HEAD) == 0
    allocator.commit("b", 4)
    first, second = allocator.block_table("a")[0], allocator.block_table("b")[0]
    assert first != second
    allocator.free("a")
    assert allocator.usage().blocks_cached == 1
    assert allocator.add_sequence("c", PROMPT) == BLOCK_SIZE
    assert allocator.block_table("c")[0] == first
    allocator.check_invariants()


def test_a_hit_makes_a_cached_block_the_most_recently_released():
    """LRU: a cached block that a request hits and frees again is evicted after cached
    blocks released before it."""
    allocator = _caching(6)
    for seq_id, head in (("x", [1] * 4), ("y", [2] * 4)):
        allocator.add_sequence(seq_id, head + [0])
        allocator.commit(seq_id, 5)
    allocator.free("x")
    allocator.free("y")  # cached order: x's head, then y's head
    allocator.add_sequence("x-again", [1] * 4 + [3])
    allocator.commit("x-again", 5)
    allocator.free("x-again")  # cached order now: y's head, then x's head
    # 6 blocks: 4 uncached, then one eviction: y's head.
    allocator.add_sequence("filler")
    allocator.append_tokens("filler", 5 * BLOCK_SIZE)
    allocator.free("filler")
    assert allocator.add_sequence("y-late", [2] * 4 + [0]) == 0
    assert allocator.add_sequence("x-late", [1] * 4 + [0]) == BLOCK_SIZE
    allocator.check_invariants()
