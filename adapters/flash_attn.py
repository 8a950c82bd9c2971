"""FlashAttention's paged kernels: FA2 (``flash_attn``) and FA3 (``flash_attn_3``), CUDA only.

``flash-attn2`` runs decode cases through ``flash_attn_with_kvcache(..., block_table=)``
and prefill/mixed cases through ``flash_attn_varlen_func(..., block_table=)``;
``flash-attn3`` runs every case through FA3's ``flash_attn_with_kvcache(...,
page_table=, cu_seqlens_q=)`` with packed queries. Sources: ``flash_attn/
flash_attn_interface.py``, ``hopper/flash_attn_interface.py`` and
``csrc/flash_attn/flash_api.cpp`` of Dao-AILab/flash-attention at commit 0251105.

- Paged K and V: ``[num_blocks, page_block_size, num_kv_heads, head_dim]`` each, last dim
  contiguous: the canonical ``[:, 0]`` / ``[:, 1]`` made contiguous (:func:`flash_attn_paged`).
- ``block_table`` / ``page_table`` and ``cache_seqlens`` are the canonical int32 tensors;
  FA2's varlen path takes key lengths as prefix sums ``cu_seqlens_k [batch + 1]``.
- Causal masks are aligned bottom-right; a window ``W`` is ``window_size = (W - 1, 0)``,
  ``(-1, -1)`` none; ``softcap = c`` caps the scaled logits, 0.0 off.

Limits: fp16/bf16; head_dim a multiple of 8 up to 256 (``flash_api.cpp``); FA2 needs a
block size divisible by 256 ("Paged KV cache block size must be divisible by 256") and
compute capability 8.0; FA3 takes any block size (Dao-AILab/flash-attention#1627) and is
built for Hopper (README: "H100 / H800 GPU"), so 9.0.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass

import torch

from pagedbench.reference import PagedInputs

from .base import MultipleOf, Prepared
from .cuda_probe import CudaPeerAdapter, PeerUnusable, cuda_capabilities

#: head_dim values FlashAttention accepts: multiples of 8 up to 256.
HEAD_DIMS = frozenset(range(8, 257, 8))
#: FA2's paged block-size rule (``flash_api.cpp``).
FA2_BLOCK_SIZE_MULTIPLE = 256

FA2_CAPABILITIES = cuda_capabilities(
    head_dims=HEAD_DIMS,
    block_sizes=frozenset({MultipleOf(FA2_BLOCK_SIZE_MULTIPLE)}),
    modes=frozenset({"decode", "prefill"}),
    features=frozenset({"sliding_window", "logits_soft_cap"}),
    min_compute_capability=(8, 0),
)
FA3_CAPABILITIES = cuda_capabilities(
    head_dims=HEAD_DIMS,
    modes=frozenset({"decode", "prefill"}),
    features=frozenset({"sliding_window", "logits_soft_cap"}),
    min_compute_capability=(9, 0),
)


def window_size(sliding_window: int | None) -> tuple[int, int]:
    """FlashAttention's ``window_size`` for a causal window of ``sliding_window`` keys:
    ``(W - 1, 0)``, or ``(-1, -1)`` (no window) for ``None``.

    Raises
    ------
    ValueError
        If ``sliding_window`` is < 1.
    """
    if sliding_window is None:
        return (-1, -1)
    if sliding_window < 1:
        raise ValueError(f"sliding_window must be None or >= 1, got {sliding_window}")
    return (sliding_window - 1, 0)


@dataclass(frozen=True)
class FlashAttnPaged:
    """A case's arguments in FlashAttention's paged layout (shared with vLLM's fork).

    Attributes
    ----------
    k_cache, v_cache : Tensor[num_blocks, block_size, num_kv_heads, head_dim], case dtype
        Contiguous copies of the canonical ``kv_cache[:, 0]`` and ``kv_cache[:, 1]``.
    block_table : Tensor[batch, max_blocks_per_seq], int32
    cache_seqlens : Tensor[batch], int32
        Keys per sequence (``seqused_k`` in vLLM's fork).
    cu_seqlens_q : Tensor[batch + 1], int32
    cu_seqlens_k : Tensor[batch + 1], int32
        Prefix sums of ``cache_seqlens``, starting at 0 (FA2's varlen path).
    max_seqlen_q, max_seqlen_k : int
        Longest query and key run in the batch (tokens).
    window_size : tuple[int, int]
        See :func:`window_size`.
    softcap : float
        The soft cap, ``0.0`` when off.
    """

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_table: torch.Tensor
    cache_seqlens: torch.Tensor
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    window_size: tuple[int, int]
    softcap: float


def flash_attn_paged(inputs: PagedInputs) -> FlashAttnPaged:
    """Convert canonical inputs to FlashAttention's paged arguments (plain torch).

    Raises
    ------
    ValueError
        If the case's sliding window is invalid (see :func:`window_size`).
    """
    case = inputs.case
    kv_lens = inputs.kv_lens.to(torch.int32)
    cu_seqlens_k = torch.zeros(case.batch_size + 1, dtype=torch.int32, device=inputs.device)
    cu_seqlens_k[1:] = torch.cumsum(kv_lens, 0)
    return FlashAttnPaged(
        k_cache=inputs.k_cache.contiguous(),  # [num_blocks, block_size, hkv, d]
        v_cache=inputs.v_cache.contiguous(),
        block_table=inputs.block_tables.to(torch.int32).contiguous(),
        cache_seqlens=kv_lens.contiguous(),
        cu_seqlens_q=inputs.cu_seqlens_q.to(torch.int32).contiguous(),
        cu_seqlens_k=cu_seqlens_k,
        max_seqlen_q=max(case.q_lens_or_decode),
        max_seqlen_k=max(case.kv_lens),
        window_size=window_size(case.sliding_window),
        softcap=case.logits_soft_cap or 0.0,
    )


def _require_parameters(function, *parameters: str) -> None:
    """Raise :class:`PeerUnusable` naming the first of ``parameters`` that ``function``
    does not take."""
    taken = inspect.signature(function).parameters
    for parameter in parameters:
        if parameter not in taken:
            raise PeerUnusable(f"{function.__module__}.{function.__name__} has no "
                               f"{parameter!r} parameter")


class FlashAttn2(CudaPeerAdapter):
    """FA2: ``flash_attn_with_kvcache`` for decode, ``flash_attn_varlen_func`` otherwise."""

    name = "flash-attn2"
    description = "FlashAttention 2 paged kvcache/varlen kernels (CUDA, block_size % 256)"
    CAPABILITIES = FA2_CAPABILITIES
    peer_module = "flash_attn"
    install = "pip install flash-attn --no-build-isolation, which builds it from source"

    def import_peer(self, device: str) -> dict[str, str]:
        from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache

        _require_parameters(flash_attn_varlen_func, "block_table")
        _require_parameters(flash_attn_with_kvcache, "block_table")
        return {"decode": "flash_attn_with_kvcache", "prefill": "flash_attn_varlen_func"}

    def prepare(self, inputs: PagedInputs) -> Prepared:
        from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache

        case = inputs.case
        paged = flash_attn_paged(inputs)
        options = dict(softmax_scale=inputs.scale, causal=True, window_size=paged.window_size,
                       softcap=paged.softcap)
        if case.mode == "decode":
            call = functools.partial(
                flash_attn_with_kvcache,
                inputs.q.unsqueeze(1),  # [batch, 1, num_q_heads, head_dim]
                paged.k_cache, paged.v_cache,
                cache_seqlens=paged.cache_seqlens, block_table=paged.block_table, **options,
            )
        else:
            call = functools.partial(
                flash_attn_varlen_func,
                inputs.q, paged.k_cache, paged.v_cache, paged.cu_seqlens_q,
                paged.cu_seqlens_k, paged.max_seqlen_q, paged.max_seqlen_k,
                block_table=paged.block_table, **options,
            )
        return Prepared(call, out_shape=tuple(inputs.q.shape))


class FlashAttn3(CudaPeerAdapter):
    """FA3: ``flash_attn_with_kvcache`` with ``page_table`` and packed varlen queries."""

    name = "flash-attn3"
    description = "FlashAttention 3 paged kvcache kernel, varlen queries (CUDA, Hopper)"
    CAPABILITIES = FA3_CAPABILITIES
    peer_module = "flash_attn_3"
    install = "build it from github.com/Dao-AILab/flash-attention/tree/main/hopper"

    def import_peer(self, device: str) -> dict[str, str]:
        from flash_attn_3.flash_attn_interface import flash_attn_with_kvcache

        _require_parameters(flash_attn_with_kvcache, "page_table", "cu_seqlens_q")
        return {"decode": "flash_attn_with_kvcache", "prefill": "flash_attn_with_kvcache"}

    def prepare(self, inputs: PagedInputs) -> Prepared:
        from flash_attn_3.flash_attn_interface import flash_attn_with_kvcache

        paged = flash_attn_paged(inputs)
        call = functools.partial(
            flash_attn_with_kvcache,
            inputs.q, paged.k_cache, paged.v_cache,
            cache_seqlens=paged.cache_seqlens, page_table=paged.block_table,
            cu_seqlens_q=paged.cu_seqlens_q, max_seqlen_q=paged.max_seqlen_q,
            softmax_scale=inputs.scale, causal=True, window_size=paged.window_size,
            softcap=paged.softcap,
        )
        return Prepared(call, out_shape=tuple(inputs.q.shape))
