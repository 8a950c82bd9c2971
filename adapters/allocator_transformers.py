"""``transformers``: Hugging Face transformers' continuous-batching ``PagedAttentionCache``
(5.x, ``generation/continuous_batching/cache.py``) behind the allocator contract, driven
as its scheduler drives it (``scheduler.py``, ``continuous_api.py``):

- admit: ``search_prefix_match`` (which acquires the matched blocks), then
  ``can_store_request_tokens`` for the rest (sectors taken from the pool as needed), and
  after the forward ``mark_complete_blocks`` (full blocks hashed, a duplicate of an
  already hashed block swapped for it and freed); a refused admission gives back what
  the match acquired (``free_blocks``);
- append: ``can_store_request_tokens`` for the new tokens, then ``mark_complete_blocks``;
- fork: ``prepare_fork_request`` (full blocks shared, the partial last block copied into
  a fresh one at once) and ``perform_cache_copy``;
- free: ``free_blocks`` (hashed blocks stay cached);
- evict: ``evict_cached_blocks``, which frees every cached block at once, then
  ``try_to_free_sectors`` (what the scheduler does under its safety margin); an
  allocation itself never evicts.

One full-attention layer of one KV head of 16 float32 channels, so that a sector holds
one block (``lcm`` of the block's bytes and 128). Blocks are numbered from 2 (sectors 0
and 1 are its trash sectors).
"""

from __future__ import annotations

from collections.abc import Sequence

from .allocator_base import Allocator, PoolUsage, Step
from .base import Availability

FULL_ATTENTION = "full_attention"


class TransformersPagedCache(Allocator):
    """transformers' ``PagedAttentionCache`` (module docstring)."""

    name = "transformers"
    description = ("Hugging Face transformers continuous batching's PagedAttentionCache, "
                   "driven as its scheduler drives it")
    unit = "block"
    prefix_rule = "block-hash"
    supports_fork = True
    supports_evict = True
    evicts_all_cached = True
    eviction = ("only when the scheduler falls under its safety margin: every cached block "
                "at once (evict_cached_blocks); an allocation never evicts")

    def available(self) -> Availability:
        try:
            import transformers
            from transformers.generation.continuous_batching.cache import (  # noqa: F401
                PagedAttentionCache,
            )
        except ImportError as exc:
            return Availability(False, f"transformers not importable ({exc})")
        return Availability(True, version=transformers.__version__,
                            details={"source": f"transformers {transformers.__version__}"})

    def start(self, num_blocks: int, block_size: int, prefix_caching: bool) -> None:
        import torch
        from transformers.configuration_utils import PreTrainedConfig
        from transformers.generation.configuration_utils import ContinuousBatchingConfig
        from transformers.generation.continuous_batching.cache import PagedAttentionCache
        from transformers.generation.continuous_batching.distributed import DistributedHelper
        from transformers.generation.continuous_batching.requests import RequestState

        self.RequestState = RequestState
        config = PreTrainedConfig(num_hidden_layers=1, num_attention_heads=1,
                                  num_key_value_heads=1, head_dim=16, hidden_size=16,
                                  vocab_size=8)
        config._attn_implementation = "sdpa"
        cb_config = ContinuousBatchingConfig(
            page_size=block_size, num_blocks=num_blocks, max_batch_tokens=64,
            max_memory_percent=0.9, allow_block_sharing=prefix_caching)
        self.cache = PagedAttentionCache(config, cb_config, "cpu", DistributedHelper(None, None),
                                         dtype=torch.float32)
        self.allocator = self.cache.cache_allocators[FULL_ATTENTION]
        assert self.allocator.blocks_per_sector == 1
        self.block_size = block_size
        self.states: dict[int, object] = {}

    def _forward(self, state, tokens: Sequence[int]) -> bool:
        """Store ``tokens`` for ``state`` and mark the blocks the step completes."""
        if not self.cache.can_store_request_tokens(state, len(tokens)):
            return False
        complete = self.cache.count_new_complete_blocks(state, len(tokens))
        state.position_offset += len(tokens)
        if state.position_offset > len(state.initial_tokens):
            state.generated_tokens.extend(tokens)
        self.cache.mark_complete_blocks(state, complete)
        return True

    def admit(self, seq_id: int, token_ids: Sequence[int]) -> Step:
        tokens = list(token_ids)
        state = self.RequestState(request_id=str(seq_id), initial_tokens=tokens)
        hit = self.cache.search_prefix_match(state.request_id, tokens)
        state.position_offset = hit
        if not self._forward(state, tokens[hit:]):
            self.cache.free_blocks(state.request_id)
            return Step(False)
        self.states[seq_id] = state
        return Step(True, hit=hit)

    def append(self, seq_id: int, token_ids: Sequence[int]) -> Step:
        return Step(self._forward(self.states[seq_id], list(token_ids)))

    def fork(self, parent_id: int, child_id: int) -> Step:
        parent = self.states[parent_id]
        copies = {FULL_ATTENTION: ([], [])}
        if not self.cache.prepare_fork_request(parent, [str(child_id)], copies):
            return Step(False)
        self.cache.perform_cache_copy(copies)
        child = self.RequestState(request_id=str(child_id),
                                  initial_tokens=list(parent.initial_tokens))
        child.generated_tokens = list(parent.generated_tokens)
        child.position_offset = parent.position_offset
        self.states[child_id] = child
        return Step(True, copies=tuple(zip(*copies[FULL_ATTENTION])))

    def free(self, seq_id: int) -> None:
        self.cache.free_blocks(self.states.pop(seq_id).request_id)

    def lookup(self, token_ids: Sequence[int]) -> int:
        if not self.cache.use_prefix_sharing:
            return 0
        return len(self.allocator.match_prefix_blocks(list(token_ids))) * self.block_size

    def evict(self, num_units: int) -> int:
        cached = len(self.allocator.ledger.cached_blocks)
        self.cache.evict_cached_blocks()
        self.cache.pool.try_to_free_sectors()
        return cached

    def block_table(self, seq_id: int) -> list[int]:
        return list(self.allocator.block_table[self.states[seq_id].request_id])

    def slots(self, seq_id: int) -> list[int]:
        bs, table = self.block_size, self.block_table(seq_id)
        return [table[p // bs] * bs + p % bs for p in range(self.states[seq_id].position_offset)]

    def usage(self) -> PoolUsage:
        pool = self.cache.pool
        free = pool.count_free_blocks(self.allocator.index) + pool.num_free_sectors
        cached = len(self.allocator.ledger.cached_blocks)
        return PoolUsage(free=free, cached=cached, used=self.cache.num_blocks - free - cached,
                         capacity=self.cache.num_blocks)
