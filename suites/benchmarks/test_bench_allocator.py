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


def _prompt(seq: int) -> list[int]:
    return [(seq * 7919 + pos) % 32_000 for pos in range(PROMPT_LEN)]


def _decode_ours(allocator: BlockAllocator) -> None:
    for step in range(DECODE_STEPS):
        for seq in range(NUM_SEQS):
            allocator.append_tokens(seq, [step])
            allocator.commit(seq, PROMPT_LEN + step + 1)


def _setup_decode_ours():
    allocator = BlockAllocator(NUM_BLOCKS, BLOCK_SIZE, seed=0)
    for seq in range(NUM_SEQS):
        allocator.add_sequence(seq, _prompt(seq))
        allocator.commit(seq, PROMPT_LEN)
    return (allocator,), {}


def test_bench_allocator_appends_ours(benchmark) -> None:
    benchmark.group = "allocator-appends"
    benchmark.extra_info["ops"] = NUM_SEQS * DECODE_STEPS
    benchmark.pedantic(_decode_ours, setup=_setup_decode_ours, rounds=ROUNDS, iterations=1)


@pytest.mark.vllm
def test_bench_allocator_appends_vllm(benchmark, vllm_api) -> None:
    def setup():
        driver = VllmDriver(vllm_api, NUM_BLOCKS, BLOCK_SIZE, caching=False)
        for seq in range(NUM_SEQS):
            assert driver.admit(seq, _prompt(seq)) == 0
        return (driver,), {}

    def decode(driver: VllmDriver) -> None:
        manager, requests = driver.manager, driver.requests
        for step in range(DECODE_STEPS):
            for seq in range(NUM_SEQS):
                request = requests[seq]
                request.append_output_token_ids(step)
                manager.allocate_slots(request, 1)
                request.num_computed_tokens += 1

    benchmark.group = "allocator-appends"
    benchmark.extra_info["ops"] = NUM_SEQS * DECODE_STEPS
    benchmark.pedantic(decode, setup=setup, rounds=ROUNDS, iterations=1)


def test_bench_allocator_fork_cow_ours(benchmark) -> None:
    def setup():
        allocator = BlockAllocator(NUM_BLOCKS, BLOCK_SIZE, seed=0)
        allocator.add_sequence("parent", _prompt(0))
        allocator.commit("parent", PROMPT_LEN)
        return (allocator,), {}

    def fork_cow(allocator: BlockAllocator) -> None:
        for _ in range(NUM_FORKS):
            allocator.fork("parent", "child")
            allocator.append_tokens("child", [1])
            allocator.copy_done(allocator.pop_copies())
            allocator.free("child")

    benchmark.group = "allocator-fork-cow"
    benchmark.extra_info["ops"] = NUM_FORKS
    benchmark.pedantic(fork_cow, setup=setup, rounds=ROUNDS, iterations=1)


@pytest.mark.vllm
def test_bench_allocator_fork_cow_vllm(benchmark, vllm_api) -> None:
    def setup():
        pool = VllmDriver(vllm_api, NUM_BLOCKS, BLOCK_SIZE, caching=False).manager.block_pool
        parent = pool.get_new_blocks(-(-PROMPT_LEN // BLOCK_SIZE))
        return (pool, parent), {}

    def fork_cow(pool, parent) -> None:
        for _ in range(NUM_FORKS):
            pool.touch(parent)
            child = list(parent)
            copy = pool.get_new_blocks(1)[0]
            pool.free_blocks([child[-1]])
            child[-1] = copy
            pool.free_blocks(reversed(child))

    benchmark.group = "allocator-fork-cow"
    benchmark.extra_info["ops"] = NUM_FORKS
    benchmark.pedantic(fork_cow, setup=setup, rounds=ROUNDS, iterations=1)
