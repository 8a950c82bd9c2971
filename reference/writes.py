"""Writing K and V into a pool: the cache-write rule, and new values written in place.

:func:`store` is how every K/V value lands in the cache (an fp8 cache holds ``x /
scale``, saturated, as vLLM's ``reshape_and_cache`` writes it). :func:`write_slots`
writes K and V at physical slots (``block * block_size + offset``), as an engine's cache
write does with its ``slot_mapping``; :func:`draw_kv` draws them as
:func:`~.inputs.materialize` does.
"""

from __future__ import annotations


import torch

from .errors import PagedValueError

#: Fraction of K channels scaled up, and by how much: real models' keys have a few
#: high-magnitude channels, which stress the low-precision dot products.
OUTLIER_CHANNEL_FRACTION = 1 / 16
OUTLIER_CHANNEL_GAIN = 4.0
FP8_TYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def store(x: torch.Tensor, scale: float, kv_dtype: torch.dtype) -> torch.Tensor:
    """``x`` (float32) as the cache stores it: for fp8 divided by ``scale`` first; clamped
    to ``kv_dtype``'s finite range (float16 and E5M2 would overflow to inf), then rounded
    to it."""
    if kv_dtype in FP8_TYPES:
        x = x / scale
    limit = torch.finfo(kv_dtype).max
    return x.clamp(-limit, limit).to(kv_dtype)


def write_slots(kv_cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor, k_scale: float, v_scale: float) -> None:
    """Write ``k`` and ``v`` (float32) at physical ``slots`` of ``kv_cache``, stored by
    :func:`store`.

    Parameters
    ----------
    kv_cache : Tensor[num_blocks, 2, block_size, num_kv_heads, cache_head_dim]
        Any strides; K is ``[:, 0, ..., :head_dim]``, V ``[:, 1, ..., :v_head_dim]``.
    slots : Tensor[n], int64
        ``block * block_size + offset`` of each token.
    k : Tensor[n, num_kv_heads, head_dim], float32
    v : Tensor[n, num_kv_heads, v_head_dim], float32

    Raises
    ------
    PagedValueError
        If a slot is outside the pool or the shapes disagree.
    """
    block_size = kv_cache.shape[2]
    if slots.numel() and not 0 <= int(slots.min()) <= int(slots.max()) < kv_cache.shape[0] * block_size:
        raise PagedValueError("slots", [int(slots.min()), int(slots.max())],
                              f"in 0..{kv_cache.shape[0] * block_size - 1}")
    if k.shape[0] != slots.numel() or v.shape[0] != slots.numel():
        raise PagedValueError("k", tuple(k.shape), f"{slots.numel()} rows, one per slot")
    block, offset = slots // block_size, slots % block_size  # [n] each
    kv_dtype = kv_cache.dtype
    kv_cache[block, 0, offset, :, : k.shape[2]] = store(k, k_scale, kv_dtype)
    kv_cache[block, 1, offset, :, : v.shape[2]] = store(v, v_scale, kv_dtype)


def draw_kv(n: int, num_kv_heads: int, head_dim: int, v_head_dim: int,
            generator: torch.Generator, *, qk_magnitude: float = 1.0,
            v_magnitude: float = 1.0, channel_gain: torch.Tensor | None = None,
            offset_channel: float = 0.0, latent: bool = False
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` tokens' K and V, float32, on ``generator``'s device: K normal with standard
    deviation ``qk_magnitude`` times ``channel_gain`` (``Tensor[num_kv_heads, head_dim]``),
    channel 0 set to ``offset_channel`` when it is not 0; V normal with ``v_magnitude``,
    or K's first ``v_head_dim`` channels when ``latent`` (MLA's one latent cache).

    Returns
    -------
    tuple of Tensor[n, num_kv_heads, head_dim] and Tensor[n, num_kv_heads, v_head_dim]
    """
    where = generator.device
    k = torch.randn(n, num_kv_heads, head_dim, generator=generator, device=where) * qk_magnitude
    if channel_gain is not None:
        k = k * channel_gain
    v = torch.randn(n, num_kv_heads, v_head_dim, generator=generator, device=where) * v_magnitude
    if offset_channel:
        k[..., 0] = offset_channel
    if latent:
        v = k[..., :v_head_dim]
    return k, v


def outlier_gain(num_kv_heads: int, head_dim: int, generator: torch.Generator) -> torch.Tensor:
    """``Tensor[num_kv_heads, head_dim]``, float32: :data:`OUTLIER_CHANNEL_GAIN` on a random
    :data:`OUTLIER_CHANNEL_FRACTION` of the channels, 1 elsewhere."""
    outliers = torch.rand(num_kv_heads, head_dim, generator=generator,
                          device=generator.device) < OUTLIER_CHANNEL_FRACTION
    return torch.where(outliers, OUTLIER_CHANNEL_GAIN, 1.0)


__all__ = ["OUTLIER_CHANNEL_FRACTION", "OUTLIER_CHANNEL_GAIN", "FP8_TYPES", "draw_kv",
           "outlier_gain", "store", "write_slots"]
