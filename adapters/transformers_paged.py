"""``transformers-paged``: Hugging Face transformers' paged attention, as its continuous
batching runs it (transformers 5.x, ``generation/continuous_batching/``).

``generate_batch`` keeps one ``PagedAttentionCache``: a flat tensor of sectors cut into
blocks of ``page_size`` tokens, each request's blocks in the full-attention allocator's
block table. With the ``sdpa`` implementation (what continuous batching keeps on a CPU,
``continuous_api.py``), every attention call is ``sdpa_attention_forward(..., cache=)``
(``integrations/sdpa_attention.py``): ``PagedAttentionCache.update`` writes the new
tokens' K and V at their ``write_index`` and gathers every key the batch reads through
``read_index`` (``index_copy_`` / ``index_select`` on the cache's per-layer token views),
then one ``scaled_dot_product_attention`` runs over the packed batch with continuous
batching's additive block-diagonal mask (``build_attention_mask``: bottom-right causal per
request, ``finfo(dtype).min`` where masked). In 5.19 ``sdpa_paged`` is a deprecated alias
of exactly this.

``prepare`` (untimed) builds a one-layer cache with the case's heads, ``page_size =
block_size`` and as many blocks as the case's sequences need, poisons every slot of it
with NaN, allocates each sequence's blocks through the cache (``can_store_request_tokens``
for a request of ``kv_len`` tokens) and writes its K and V there through
``PagedAttentionCache.update``; then it builds the read and write indices
(``get_read_indices`` / ``get_write_indices``) and the mask for the step that computes
each sequence's last ``q_len`` tokens. ``run`` is the ``sdpa_attention_forward`` call
(its write of the new tokens rewrites the values already there).
"""

from __future__ import annotations

import functools
import types
from itertools import accumulate

import torch

from pagedbench.reference import PagedCase, PagedInputs, logit_bound
from pagedbench.reference.axes import LAYOUTS

from .base import Adapter, Availability, Capabilities, Prepared

#: Fraction of the device's free memory the cache may plan for (``max_memory_percent``;
#: the cache's size is fixed by ``num_blocks``, so this only bounds its own check).
MAX_MEMORY_PERCENT = 0.9
#: The cache's full-attention layer type (``cache_allocators.FULL_ATTENTION``).
FULL_ATTENTION = "full_attention"


def _import():
    """transformers' names, imported once the adapter is used (10 s on a cold CPU)."""
    from transformers.generation.configuration_utils import ContinuousBatchingConfig
    from transformers.generation.continuous_batching.cache import PagedAttentionCache
    from transformers.generation.continuous_batching.distributed import DistributedHelper
    from transformers.generation.continuous_batching.requests import RequestState
    from transformers.generation.continuous_batching.utils import build_attention_mask
    from transformers.configuration_utils import PreTrainedConfig
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return types.SimpleNamespace(**locals())


def mask_overflows(case: PagedCase) -> list[str]:
    """Why ``case``'s logits may defeat continuous batching's mask: it adds
    ``finfo(dtype).min`` (-65504 in float16) to the float32 logits, so where two logits
    of a row differ by more than that a masked key (another request's in the packed
    batch, or a later one) outweighs a visible one. Declared when twice
    :func:`~pagedbench.reference.logit_bound` reaches it (float16 only in practice);
    ``docs/findings.md`` has the smallest case."""
    mask = -torch.finfo(case.torch_dtype).min
    if 2 * logit_bound(case) >= mask:
        return [f"logits up to {logit_bound(case):.4g} in {case.dtype}: transformers' packed "
                f"mask adds {-mask:g}, which a logit spread that wide survives"]
    return []


class TransformersPaged(Adapter):
    """transformers' continuous-batching attention over its ``PagedAttentionCache``."""

    name = "transformers-paged"
    description = ("Hugging Face transformers continuous batching: sdpa_attention_forward "
                   "over PagedAttentionCache (index gather + SDPA with a packed mask)")
    # From the code: any head_dim and page size (full-attention allocator, SDPA), K and V
    # of one head_dim (one cache row per token for each); decode and prefill rows mixed
    # (the mask is bottom-right causal per request). No window (a sliding layer takes
    # another allocator, a ring buffer), soft cap, ALiBi or sinks (SDPA has none); no
    # degenerate rows (continuous batching never schedules a request with no token).
    # Layouts: q is viewed as [1, heads, tokens, head_dim] through its strides, the
    # cache is copied; the output is a new tensor, so no strided_out.
    CAPABILITIES = Capabilities(
        devices=frozenset({"cpu", "cuda"}),
        dtypes=frozenset({"float32", "float16", "bfloat16"}),
        modes=frozenset({"decode", "prefill"}),
        layouts=frozenset(LAYOUTS) - {"strided_out"},
    )

    def capabilities(self, device: str) -> Capabilities:
        return self.CAPABILITIES

    def why_unsupported(self, case: PagedCase, device: str) -> list[str]:
        """Also: logits that may spread over more than the mask's magnitude
        (:func:`mask_overflows`)."""
        return super().why_unsupported(case, device) + mask_overflows(case)

    def available(self, device: str = "cpu") -> Availability:
        device_type = torch.device(device).type
        if device_type == "cuda" and not torch.cuda.is_available():
            return Availability(False, "no CUDA device visible to torch")
        try:
            import transformers

            _import()
        except ImportError as exc:
            return Availability(False, f"transformers not importable ({exc}); pip install "
                                       "'pagedbench[transformers]'")
        return Availability(True, version=transformers.__version__, details={
            "source": f"transformers {transformers.__version__} (installed)",
            "attention": "sdpa"})

    def prepare(self, inputs: PagedInputs) -> Prepared:
        """Build transformers' cache holding the case's K and V, its indices and mask (see
        the module docstring); ``facts``: the cache's ``num_blocks`` and
        ``blocks_per_sector``."""
        case = inputs.case
        tf = _import()
        dtype, device = inputs.q.dtype, inputs.device
        # A model config holding only what the cache reads (a model's, Llama's say, would
        # also validate its RoPE, which refuses odd head dims the cache takes).
        config = tf.PreTrainedConfig(num_hidden_layers=1, num_attention_heads=case.num_q_heads,
                                     num_key_value_heads=case.num_kv_heads,
                                     head_dim=case.head_dim,
                                     hidden_size=case.num_q_heads * case.head_dim,
                                     vocab_size=8)
        config._attn_implementation = "sdpa"
        cb_config = tf.ContinuousBatchingConfig(
            page_size=case.block_size, num_blocks=sum(case.blocks_per_seq),
            max_batch_tokens=max(1, case.total_q), max_memory_percent=MAX_MEMORY_PERCENT)
        cache = tf.PagedAttentionCache(config, cb_config, device,
                                       tf.DistributedHelper(None, None), dtype=dtype)
        cache.cache_tensor.view(dtype).fill_(float("nan"))
        allocator = cache.cache_allocators[FULL_ATTENTION]
        slots = inputs.slot_mapping.tolist()
        starts = list(accumulate(case.kv_lens, initial=0))
        k_all = inputs.k_cache.reshape(-1, case.num_kv_heads, case.head_dim)  # [slots, hkv, d]
        v_all = inputs.v_cache.reshape(-1, case.num_kv_heads, case.head_dim)
        read, write = [], []
        for i, (q_len, kv_len) in enumerate(zip(case.q_lens_or_decode, case.kv_lens)):
            request = tf.RequestState(request_id=f"seq{i}", initial_tokens=[0] * kv_len)
            if not cache.can_store_request_tokens(request, kv_len):
                raise RuntimeError(f"transformers' cache refused sequence {i}'s {kv_len} "
                                   f"tokens ({cache.num_blocks} blocks)")
            own = torch.tensor(slots[starts[i]:starts[i + 1]], device=device)
            kv = [t.index_select(0, own).transpose(0, 1)[None] for t in (k_all, v_all)]
            cache.update(*kv, layer_idx=0, kwargs={  # [1, hkv, kv_len, d] each
                "read_index": [torch.empty(0, dtype=torch.long, device=device)],
                "write_index": [torch.tensor(allocator.get_write_indices(f"seq{i}", 0, kv_len),
                                             device=device)],
                "cu_seq_lens_k": {FULL_ATTENTION: torch.tensor([0, kv_len])},
                "max_length_k": {FULL_ATTENTION: kv_len}})
            read += allocator.get_read_indices(f"seq{i}", kv_len - q_len, q_len)
            write += allocator.get_write_indices(f"seq{i}", kv_len - q_len, q_len)
        past = any(q_len < kv_len for q_len, kv_len in zip(case.q_lens_or_decode, case.kv_lens))
        cu_k = list(accumulate(case.kv_lens if past else case.q_lens_or_decode, initial=0))
        cu_q = list(accumulate(case.q_lens_or_decode, initial=0))
        mask = torch.empty(1, 1, case.total_q, cu_k[-1], dtype=dtype, device=device)
        mask.fill_(torch.finfo(dtype).min)
        tf.build_attention_mask(mask, cu_q, cu_k)
        new = torch.tensor([slots[s + kv - q + j] for s, q, kv in
                            zip(starts, case.q_lens_or_decode, case.kv_lens)
                            for j in range(q)], dtype=torch.long, device=device)
        new_k, new_v = (t.index_select(0, new).transpose(0, 1)[None] for t in (k_all, v_all))
        module = types.SimpleNamespace(layer_idx=0, is_causal=True,
                                       num_key_value_groups=case.gqa_ratio)
        index = functools.partial(torch.tensor, dtype=torch.long, device=device)
        call = functools.partial(
            tf.sdpa_attention_forward, module,
            inputs.q.transpose(0, 1)[None],  # [1, num_q_heads, total_q, head_dim]
            new_k, new_v,  # [1, num_kv_heads, total_q, head_dim]
            mask, scaling=inputs.scale, cache=cache,
            read_index=[index(read if past else [])], write_index=[index(write)],
            cu_seq_lens_k={FULL_ATTENTION: torch.tensor(cu_k, dtype=torch.int32)},
            max_length_k={FULL_ATTENTION: max(case.kv_lens)})

        def run() -> torch.Tensor:
            return call()[0]  # [1, total_q, num_q_heads, head_dim]

        return Prepared(run, out_shape=(case.total_q, case.num_q_heads, case.head_dim),
                        facts={"num_blocks": cache.num_blocks,
                               "blocks_per_sector": allocator.blocks_per_sector})
