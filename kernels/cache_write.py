"""Writing new tokens' K and V into the paged cache: the cache-write op our kernels' serving
loop uses (vLLM's ``reshape_and_cache_flash``, SGLang's buffer setter).

One program per (token, KV head) stores the token's K and V at its slot
``slot_mapping[t] = block * block_size + offset`` of ``kv_cache[num_blocks, 2,
block_size, num_kv_heads, head_dim]`` (any strides): the value as is for a 16- or 32-bit
cache, ``x / k_scale`` (``x / v_scale``) clamped to the type's finite range and rounded for
an fp8 one, the rule ``reference/writes.py`` states. A slot of -1 is skipped (vLLM's
padding token).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .paged_args import FP8_DTYPES
from .paged_features import padded_dim


@triton.jit
def _write_kernel(
    key_ptr, value_ptr, cache_ptr, slots_ptr, k_scale, v_scale, limit,
    stride_key_token, stride_key_head, stride_key_dim,
    stride_value_token, stride_value_head, stride_value_dim,
    stride_cache_block, stride_cache_kv, stride_cache_slot, stride_cache_head,
    stride_cache_dim,
    HEAD_DIM: tl.constexpr, V_HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, FP8: tl.constexpr,
):
    token = tl.program_id(0)
    head = tl.program_id(1)
    slot = tl.load(slots_ptr + token)
    if slot >= 0:
        block = slot // BLOCK_SIZE
        offset = slot % BLOCK_SIZE
        dims = tl.arange(0, DIM_PAD)
        base = (cache_ptr + block * stride_cache_block + offset * stride_cache_slot
                + head * stride_cache_head + dims * stride_cache_dim)
        k = tl.load(key_ptr + token * stride_key_token + head * stride_key_head
                    + dims * stride_key_dim, mask=dims < HEAD_DIM, other=0.0)
        v = tl.load(value_ptr + token * stride_value_token + head * stride_value_head
                    + dims * stride_value_dim, mask=dims < V_HEAD_DIM, other=0.0)
        if FP8:
            k = k / k_scale
            v = v / v_scale
        k = tl.minimum(tl.maximum(k, -limit), limit)  # saturate: fp16 and E5M2 would be inf
        v = tl.minimum(tl.maximum(v, -limit), limit)
        element = cache_ptr.dtype.element_ty
        tl.store(base, k.to(element), mask=dims < HEAD_DIM)
        tl.store(base + stride_cache_kv, v.to(element), mask=dims < V_HEAD_DIM)


def write_kv(kv_cache: torch.Tensor, slot_mapping: torch.Tensor, key: torch.Tensor,
             value: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Store ``key`` and ``value`` at ``slot_mapping`` in ``kv_cache``.

    Parameters
    ----------
    kv_cache : Tensor[num_blocks, 2, block_size, num_kv_heads, cache_head_dim]
        float32, float16, bfloat16 or an fp8 type; any strides; written in place.
    slot_mapping : Tensor[n], int64
        The slot of each token; -1 skips it.
    key : Tensor[n, num_kv_heads, head_dim], float32
    value : Tensor[n, num_kv_heads, v_head_dim], float32
        ``v_head_dim`` and ``head_dim`` at most the cache's last dimension.
    k_scale, v_scale : float
        An fp8 cache's scales (the stored value ``s`` means ``s * scale``).

    Raises
    ------
    ValueError
        Naming the argument whose shape, dtype or device does not fit.
    """
    if kv_cache.dim() != 5 or kv_cache.shape[1] != 2:
        raise ValueError(f"kv_cache must be [num_blocks, 2, block_size, num_kv_heads, "
                         f"head_dim], got {tuple(kv_cache.shape)}")
    n, heads = key.shape[0], kv_cache.shape[3]
    for name, t in (("key", key), ("value", value)):
        if t.dim() != 3 or t.shape[0] != n or t.shape[1] != heads or t.shape[2] > kv_cache.shape[4]:
            raise ValueError(f"{name} must be [{n}, {heads}, <= {kv_cache.shape[4]}], got "
                             f"{tuple(t.shape)}")
        if t.dtype != torch.float32 or t.device != kv_cache.device:
            raise ValueError(f"{name} must be float32 on {kv_cache.device}, got {t.dtype} "
                             f"on {t.device}")
    if slot_mapping.shape != (n,) or slot_mapping.dtype != torch.int64:
        raise ValueError(f"slot_mapping must be [{n}] int64, got {tuple(slot_mapping.shape)} "
                         f"{slot_mapping.dtype}")
    if n == 0:
        return
    _write_kernel[(n, heads)](
        key, value, kv_cache, slot_mapping, k_scale, v_scale,
        torch.finfo(kv_cache.dtype).max,
        *key.stride(), *value.stride(), *kv_cache.stride(),
        HEAD_DIM=key.shape[2], V_HEAD_DIM=value.shape[2],
        DIM_PAD=padded_dim(max(key.shape[2], value.shape[2])),
        BLOCK_SIZE=kv_cache.shape[2], FP8=kv_cache.dtype in FP8_DTYPES)


__all__ = ["write_kv"]
