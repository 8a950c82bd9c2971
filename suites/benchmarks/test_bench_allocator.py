"""Benchmark: the reference block allocator beside vLLM's, on the same operation sequence.

Two operations, each a pytest-benchmark group with one row per allocator:

- ``allocator-appends``: decode. 64 sequences with 100-token prompts each append one token
  per step for 256 steps, block_size 16, no prefix caching. Ours: ``append_tokens(seq,
  [token_id])`` (slot mapping returned) then ``commit`` (the step ran). vLLM: what its
  scheduler calls per decoded token, ``Request.append_output_token_ids`` then
  ``KVCacheManager.allocate_slots(request, 1)``.
- ``allocator-fork-cow``: parallel sampling. A 100-token parent (last block partial) is
  forked, the child appends one token (copying the shared last block, then reporting the
  copy done), and the child is freed; 2,000 times. vLLM v1 has no fork, so its side is the
  same sequence of block-pool primitives on ``BlockPool``: ``touch`` the parent's blocks,
  ``get_new_blocks(1)`` for the copy, ``free_blocks`` the shared block, then
  ``free_blocks`` the child's table.

``extra_info["ops"]`` holds the operations per round, so ops per second is
``ops / mean``; the ratio of the two rows' means is vLLM's speed relative to ours.
Setup (pools, prompts, the parent) is outside the timed region.
"""

from __future__ import annotations

import pytest

from pagedbench.reference.allocator import BlockAllocator
from pagedbench.suites.allocator.vllm_driver import VllmDriver

pytestmark = pytest.mark.bench

BLOCK_SIZE = 16
NUM_SEQS = 64
PROMPT_LEN = 100
DECODE_STEPS = 256
NUM_FORKS = 2_000
#: Room for every sequence's prompt and decoded tokens, and spare.
NUM_BLOCKS = NUM_SEQS * ((PROMPT_LEN + DECODE_STEPS) // BLOCK_SIZE + 2)
ROUNDS = 5
#: Blocks a sequence holds after the decode: 356 tokens in blocks of 16 -> 23; the parent
#: of the fork benchmark: 100 tokens -> 7.
BLOCKS_AFTER_DECODE = -(-(PROMPT_LEN + DECODE_STEPS) // BLOCK_SIZE)
PARENT_BLOCKS = -(-PROMPT_LEN // BLOCK_SIZE)


def _prompt(seq: int) -> list[int]:
    return [(seq * 7919 + pos) % 32_000 for pos in range(PROMPT_LEN)]


def _decode_ours(allocator: BlockAllocator) -> BlockAllocator:
    for step in range(DECODE_STEPS):
        for seq in range(NUM_SEQS):
            allocator.append_tokens(seq, [step])
            allocator.commit(seq, PROMPT_LEN + step + 1)
    return allocator


def _setup_decode_ours():
    allocator = BlockAllocator(NUM_BLOCKS, BLOCK_SIZE, seed=0)
    for seq in range(NUM_SEQS):
        allocator.add_sequence(seq, _prompt(seq))
        allocator.commit(seq, PROMPT_LEN)
    return (allocator,), {}


def test_bench_allocator_appends_ours(benchmark) -> None:
    benchmark.group = "allocator-appends"
    benchmark.extra_info["ops"] = NUM_SEQS * DECODE_STEPS
    allocator = benchmark.pedantic(_decode_ours, setup=_setup_decode_ours, rounds=ROUNDS,
                                   iterations=1)
    assert allocator.num_free_blocks == NUM_BLOCKS - NUM_SEQS * BLOCKS_AFTER_DECODE


@pytest.mark.vllm
def test_bench_allocator_appends_vllm(benchmark, vllm_api) -> None:
    def setup():
        driver = VllmDriver(vllm_api, NUM_BLOCKS, BLOCK_SIZE, caching=False)
        for seq in range(NUM_SEQS):
            assert driver.admit(seq, _prompt(seq)) == 0
        return (driver,), {}

    def decode(driver: VllmDriver) -> VllmDriver:
        manager, requests = driver.manager, driver.requests
        for step in range(DECODE_STEPS):
            for seq in range(NUM_SEQS):
                request = requests[seq]
                request.append_output_token_ids(step)
                manager.allocate_slots(request, 1)
                request.num_computed_tokens += 1
        return driver

    benchmark.group = "allocator-appends"
    benchmark.extra_info["ops"] = NUM_SEQS * DECODE_STEPS
    driver = benchmark.pedantic(decode, setup=setup, rounds=ROUNDS, iterations=1)
    # Every append got its slot (a refused allocate_slots returns None and allocates none).
    assert driver.counts()[0] == NUM_BLOCKS - NUM_SEQS * BLOCKS_AFTER_DECODE


def test_bench_allocator_fork_cow_ours(benchmark) -> None:
    def setup():
        allocator = BlockAllocator(NUM_BLOCKS, BLOCK_SIZE, seed=0)
        allocator.add_sequence("parent", _prompt(0))
        allocator.commit("parent", PROMPT_LEN)
        return (allocator,), {}

    def fork_cow(allocator: BlockAllocator) -> BlockAllocator:
        for _ in range(NUM_FORKS):
            allocator.fork("parent", "child")
            allocator.append_tokens("child", [1])
            allocator.copy_done(allocator.pop_copies())
            allocator.free("child")
        return allocator

    benchmark.group = "allocator-fork-cow"
    benchmark.extra_info["ops"] = NUM_FORKS
    allocator = benchmark.pedantic(fork_cow, setup=setup, rounds=ROUNDS, iterations=1)
    # Every copy was reported done and every child freed: the parent's blocks alone held.
    assert allocator.sequences() == ["parent"]
    assert allocator.num_free_blocks == NUM_BLOCKS - PARENT_BLOCKS
    assert allocator.usage().blocks_in_flight == 0


@pytest.mark.vllm
def test_bench_allocator_fork_cow_vllm(benchmark, vllm_api) -> None:
    def setup():
        pool = VllmDriver(vllm_api, NUM_BLOCKS, BLOCK_SIZE, caching=False).manager.block_pool
        parent = pool.get_new_blocks(-(-PROMPT_LEN // BLOCK_SIZE))
        return (pool, parent), {}

    def fork_cow(pool, parent):
        for _ in range(NUM_FORKS):
            pool.touch(parent)
            child = list(parent)
            copy = pool.get_new_blocks(1)[0]
            pool.free_blocks([child[-1]])
            child[-1] = copy
            pool.free_blocks(reversed(child))
        return pool

    benchmark.group = "allocator-fork-cow"
    benchmark.extra_info["ops"] = NUM_FORKS
    pool = benchmark.pedantic(fork_cow, setup=setup, rounds=ROUNDS, iterations=1)
    assert pool.get_num_free_blocks() == NUM_BLOCKS - PARENT_BLOCKS  # the parent's alone
