"""MLA's latent cache as the MLA kernels take it: one buffer per token whose first
``head_dim_v`` channels are V (DeepSeek's ``c_kv``, ``kv_lora_rank`` 512) and whose last
``head_dim - head_dim_v`` are the rest of K (``k_pe``, 64), for vLLM's CPU MLA ops,
FlashInfer's MLA wrapper and FlashMLA alike."""

from __future__ import annotations

import torch

from pagedbench.reference import PagedInputs


def latent_cache(inputs: PagedInputs) -> torch.Tensor:
    """The canonical cache of a ``latent_cache`` case as MLA's one buffer, a copy.

    Returns
    -------
    Tensor[num_blocks, block_size, num_kv_heads, head_dim], the case dtype
        Channels ``:head_dim_v`` from V's half of the canonical cache, the rest from K's:
        for every live token exactly K (V is K's first channels there); in an unused slot
        the poison of each half, so the stale finite V that conformance puts in the last
        blocks' tails (``Capabilities.nan_safe_tail``) is what an MLA kernel reads there.
    """
    dv = inputs.case.v_head_dim
    return torch.cat([inputs.v_cache, inputs.k_cache[..., dv:]], dim=-1)
