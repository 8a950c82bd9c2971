"""Split-KV paged decode (flash-decoding) in Triton: a grid over (sequence, KV head, split).

One query token per sequence. Each program takes one sequence's whole GQA group of query
heads (``group_size`` rows, one K/V read for all of them) over one contiguous range of
its key tiles, and writes a float32 partial (running max, sum, unnormalised output); a
merge kernel combines the partials of each (sequence, KV head) in split order. This is
FlashDecoding (Dao, Haziza, Massa, Sizov, "Flash-Decoding for long-context inference",
2023): splitting the keys puts a batch of 1 on every SM. The split count comes from
:func:`~pagedbench.kernels.paged_split_plan.plan_splits` (FlashAttention's heuristic).
One split writes the output directly, without partials.

Batch-invariant mode (``batch_invariant=True``) fixes the split size in keys instead: a
sequence's splits, their arithmetic and the merge's loop depend on that sequence alone,
so its output is bitwise the same whatever else is in the batch. Splits are counted from
the first tile that holds a visible key; a split with no key (balanced mode, a context
shorter than the split count) writes max ``-inf``, sum 0, and weighs 0 in the merge.

The key loop's addresses depend only on the loop index (block-table entry, then K and
V), never on the softmax state, so Triton's software pipeliner can issue the next
tiles' copies while the current tile computes (``num_stages`` from
:data:`~pagedbench.kernels.paged_features.LAUNCH_CONFIGS`). Features, fp8 caches and the
interpreter's bfloat16 workaround: :mod:`pagedbench.kernels.paged_features`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Unpack

import torch
import triton
import triton.language as tl

from .paged_args import (
    PagedFeatures,
    check_kv_lens_fit,
    check_paged_args,
    launcher,
)
from .paged_features import (
    _decode_group,
    _group_rows,
    _load_kv_ahead,
    _logits,
    _softmax_start,
    _softmax_step,
    _store_group,
    _table_blocks,
    bf16_via_fp32,
    kernels_are_interpreted,
    padded_dim,
)
from .paged_split_plan import (
    BATCH_INVARIANT_SPLIT_SIZE,
    SplitPlan,
    device_sm_count,
    plan_splits,
)

#: Warps of the merge kernel (it reads ``group x head_dim`` floats per split).
MERGE_NUM_WARPS = 4
#: ln 2: the kernels' base-2 log-sum-exp made natural.
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _visible_tiles(kv_len, sliding_window, KV_TILE: tl.constexpr,
                   HAS_SLIDING_WINDOW: tl.constexpr):
    """(first visible key, its tile, tiles from that one to the last key)."""
    if HAS_SLIDING_WINDOW:
        first_key = tl.maximum(kv_len - sliding_window, 0)
    else:
        first_key = kv_len * 0
    tile0 = first_key // KV_TILE
    return first_key, tile0, tl.cdiv(kv_len, KV_TILE) - tile0


@triton.jit
def _split_decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, kv_lens_ptr,
    alibi_slopes_ptr, sinks_ptr, out_ptr, lse_ptr, part_acc_ptr, part_m_ptr, part_l_ptr,
    qk_scale, v_scale, logits_soft_cap, sliding_window,
    group_size, num_splits, tiles_per_split,
    stride_q_seq, stride_q_head, stride_q_dim,
    stride_k_block, stride_k_slot, stride_k_head, stride_k_dim,
    stride_v_block, stride_v_slot, stride_v_head, stride_v_dim,
    stride_table_seq, stride_table_block,
    stride_out_seq, stride_out_head, stride_out_dim, stride_lse_seq,
    stride_part_seq, stride_part_head, stride_part_split,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, GROUP_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, KV_TILE: tl.constexpr,
    HAS_SLIDING_WINDOW: tl.constexpr, HAS_SOFT_CAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    FIXED_SPLIT: tl.constexpr, DIRECT_OUTPUT: tl.constexpr, BF16_VIA_FP32: tl.constexpr,
):
    seq, kv_head, rows, dims, row_ok, dim_ok, q_heads, q = _decode_group(
        q_ptr, group_size, stride_q_seq, stride_q_head, stride_q_dim, HEAD_DIM, HEAD_DIM_PAD,
        GROUP_PAD, BF16_VIA_FP32)
    split = tl.program_id(2)
    keys = tl.arange(0, KV_TILE)
    if HAS_ALIBI:
        slopes = tl.load(alibi_slopes_ptr + q_heads, mask=row_ok, other=0.0)
    else:
        slopes = tl.zeros([GROUP_PAD], dtype=tl.float32)

    kv_len = tl.load(kv_lens_ptr + seq)
    first_key, tile0, num_tiles = _visible_tiles(kv_len, sliding_window, KV_TILE,
                                                 HAS_SLIDING_WINDOW)
    if FIXED_SPLIT:
        t_lo = split * tiles_per_split
        t_hi = tl.minimum(t_lo + tiles_per_split, num_tiles)
    else:  # balanced: split s takes tiles [s T / S, (s + 1) T / S)
        t_lo = split * num_tiles // num_splits
        t_hi = (split + 1) * num_tiles // num_splits
    q_pos = tl.full([GROUP_PAD], 0, tl.int32) + (kv_len - 1)  # the query's position
    table_row = block_tables_ptr + seq.to(tl.int64) * stride_table_seq
    k_head = kv_head.to(tl.int64) * stride_k_head
    v_head = kv_head.to(tl.int64) * stride_v_head

    if DIRECT_OUTPUT:
        m_i, l_i = _softmax_start(sinks_ptr, q_heads, row_ok, GROUP_PAD, HAS_SINKS)
    else:  # the merge adds the sink once
        m_i, l_i = _softmax_start(sinks_ptr, q_heads, row_ok, GROUP_PAD, False)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], dtype=tl.float32)
    # The block numbers of tile t + 1 are loaded during tile t (past the split's end they
    # are still valid table entries): _load_kv_ahead (2 buffers at num_stages 3).
    pos = (tile0 + t_lo) * KV_TILE + keys
    block = _table_blocks(table_row, stride_table_block, pos,
                          (pos < kv_len) & (pos >= first_key), BLOCK_SIZE)
    for t in range(t_lo, t_hi):
        pos = (tile0 + t) * KV_TILE + keys  # [KV_TILE] logical key positions
        k, v, live, block = _load_kv_ahead(
            k_cache_ptr, v_cache_ptr, block, pos, first_key, kv_len, table_row,
            stride_table_block, dims, dim_ok, stride_k_block, stride_k_slot, k_head,
            stride_k_dim, stride_v_block, stride_v_slot, v_head, stride_v_dim, q.dtype,
            BLOCK_SIZE, KV_TILE)
        s = _logits(q, k, qk_scale, logits_soft_cap, slopes, q_pos, pos, live[None, :],
                    HAS_SOFT_CAP, HAS_ALIBI)  # [GROUP_PAD, KV_TILE]
        m_i, l_i, acc = _softmax_step(s, v, m_i, l_i, acc)

    acc = acc * v_scale
    if DIRECT_OUTPUT:
        # A row that saw no key (kv_len 0) stays all zeros (FlashAttention's convention).
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        _store_group(out_ptr, seq, q_heads, dims, row_ok[:, None] & dim_ok[None, :], out,
                     stride_out_seq, stride_out_head, stride_out_dim, BF16_VIA_FP32)
        _store_lse(lse_ptr, seq, q_heads, row_ok, m_i, l_i, stride_lse_seq)
    else:
        part = (seq.to(tl.int64) * stride_part_seq + q_heads * stride_part_head
                + split * stride_part_split)  # [GROUP_PAD]
        tl.store(part_m_ptr + part, m_i, mask=row_ok)
        tl.store(part_l_ptr + part, l_i, mask=row_ok)
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + dims[None, :], acc,
                 mask=row_ok[:, None] & dim_ok[None, :])


@triton.jit
def _store_lse(lse_ptr, seq, q_heads, row_ok, m, l, stride_lse_seq):
    """Each row's natural log-sum-exp from its base-2 max ``m`` and sum ``l`` (relative to
    ``2^m``): ``ln 2 (m + log2 l)``, ``-inf`` for a row that saw no key and no sink."""
    lse = tl.where(l > 0, (m + tl.log2(tl.where(l > 0, l, 1.0))) * LN2, float("-inf"))
    tl.store(lse_ptr + seq.to(tl.int64) * stride_lse_seq + q_heads, lse, mask=row_ok)


@triton.jit
def _merge_kernel(
    kv_lens_ptr, sinks_ptr, out_ptr, lse_ptr, part_acc_ptr, part_m_ptr, part_l_ptr,
    sliding_window, group_size, num_splits, tiles_per_split,
    stride_out_seq, stride_out_head, stride_out_dim, stride_lse_seq,
    stride_part_seq, stride_part_head, stride_part_split,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, GROUP_PAD: tl.constexpr,
    KV_TILE: tl.constexpr, HAS_SLIDING_WINDOW: tl.constexpr, HAS_SINKS: tl.constexpr,
    FIXED_SPLIT: tl.constexpr, BF16_VIA_FP32: tl.constexpr,
):
    """Combine the partials of one (sequence, KV head): ``m = max_s m_s``, ``out = sum_s
    2^(m_s - m) acc_s / sum_s 2^(m_s - m) l_s``, splits in order (two passes)."""
    seq, kv_head, rows, dims, row_ok, dim_ok, q_heads = _group_rows(group_size, HEAD_DIM,
                                                                    HEAD_DIM_PAD, GROUP_PAD)
    if FIXED_SPLIT:  # only this sequence's own splits: the loop must not see the batch
        kv_len = tl.load(kv_lens_ptr + seq)
        _, _, num_tiles = _visible_tiles(kv_len, sliding_window, KV_TILE,
                                         HAS_SLIDING_WINDOW)
        splits = tl.cdiv(num_tiles, tiles_per_split)
    else:
        splits = num_splits
    part = seq.to(tl.int64) * stride_part_seq + q_heads * stride_part_head  # [GROUP_PAD]

    m_sink, l_sink = _softmax_start(sinks_ptr, q_heads, row_ok, GROUP_PAD, HAS_SINKS)
    m = m_sink
    for s in range(0, splits):
        m = tl.maximum(m, tl.load(part_m_ptr + part + s * stride_part_split, mask=row_ok,
                                  other=float("-inf")))
    m_safe = tl.where(m == float("-inf"), 0.0, m)  # no key and no sink: weight 0
    l_sum = l_sink * tl.exp2(m_sink - m_safe)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], dtype=tl.float32)
    for s in range(0, splits):
        at = part + s * stride_part_split
        w = tl.exp2(tl.load(part_m_ptr + at, mask=row_ok, other=float("-inf")) - m_safe)
        l_sum += w * tl.load(part_l_ptr + at, mask=row_ok, other=0.0)
        acc += w[:, None] * tl.load(part_acc_ptr + at[:, None] * HEAD_DIM + dims[None, :],
                                    mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    out = acc / tl.where(l_sum > 0, l_sum, 1.0)[:, None]
    _store_group(out_ptr, seq, q_heads, dims, row_ok[:, None] & dim_ok[None, :], out,
                 stride_out_seq, stride_out_head, stride_out_dim, BF16_VIA_FP32)
    _store_lse(lse_ptr, seq, q_heads, row_ok, m_safe, l_sum, stride_lse_seq)


@dataclass(frozen=True)
class SplitDecodeLaunch:
    """A validated, fully planned split-KV decode; calling it launches and returns
    :attr:`out`, rewritten in full each time.

    Attributes
    ----------
    out : Tensor[batch, num_q_heads, head_dim], dtype of q
    lse : Tensor[batch, num_q_heads], float32
        Each row's natural log-sum-exp (the sink included; ``-inf`` for a row that saw
        no key), rewritten with :attr:`out` at each call.
    plan : SplitPlan
    grid, merge_grid : tuple[int, ...]
        ``(batch, num_kv_heads, num_splits)`` and ``(batch, num_kv_heads)`` (no merge
        when :attr:`SplitPlan.direct_output`).
    args, merge_args : tuple
    constexprs, merge_constexprs : dict[str, Any]
    """

    out: torch.Tensor
    lse: torch.Tensor
    plan: SplitPlan
    grid: tuple[int, int, int]
    merge_grid: tuple[int, int]
    args: tuple[Any, ...]
    merge_args: tuple[Any, ...]
    constexprs: dict[str, Any]
    merge_constexprs: dict[str, Any]

    def __call__(self) -> torch.Tensor:
        config = self.plan.config
        _split_decode_kernel[self.grid](*self.args, **self.constexprs,
                                        num_warps=config.num_warps,
                                        num_stages=config.num_stages)
        if not self.plan.direct_output:
            _merge_kernel[self.merge_grid](*self.merge_args, **self.merge_constexprs,
                                           num_warps=MERGE_NUM_WARPS)
        return self.out


def plan_paged_split_decode(q: torch.Tensor, kv_cache: torch.Tensor,
                            block_tables: torch.Tensor, kv_lens: torch.Tensor, sm_scale: float,
                            *, out: torch.Tensor | None = None, batch_invariant: bool = False,
                            split_size: int = BATCH_INVARIANT_SPLIT_SIZE,
                            num_splits: int | None = None, num_sms: int | None = None,
                            **features: Unpack[PagedFeatures]) -> SplitDecodeLaunch:
    """Validate the arguments of :func:`paged_split_decode` and plan its launch.

    Takes the same arguments and raises the same errors; allocates ``out`` (when None)
    and the float32 partials, and reads ``kv_lens`` on the host once (a device sync) to
    choose the splits. Use it to keep all of that out of a timed region; the plan holds
    for these ``kv_lens``.
    """
    a = check_paged_args(q, kv_cache, block_tables, kv_lens, sm_scale, out=out, decode=True,
                         features=features, kernel="paged_split_decode")
    batch, num_q_heads, head_dim = q.shape
    lens = kv_lens.tolist()
    check_kv_lens_fit(lens, block_tables.shape[1], a.block_size)
    plan = plan_splits(lens, a.num_kv_heads, head_dim, kv_cache.element_size(),
                       a.features["sliding_window"], batch_invariant=batch_invariant,
                       split_size=split_size, num_splits=num_splits,
                       num_sms=device_sm_count(q.device) if num_sms is None else num_sms)
    splits = 1 if plan.direct_output else plan.num_splits
    part_m = torch.empty(batch, num_q_heads, splits, dtype=torch.float32, device=q.device)
    part_l = torch.empty_like(part_m)
    part_acc = torch.empty(batch, num_q_heads, splits, head_dim, dtype=torch.float32,
                           device=q.device)
    lse = torch.empty(batch, num_q_heads, dtype=torch.float32, device=q.device)
    alibi_ptr, sinks_ptr, qk_scale, v_scale, cap, window = a.feature_args()
    args = (
        q, a.k_cache, a.v_cache, block_tables, kv_lens, alibi_ptr, sinks_ptr, a.out, lse,
        part_acc, part_m, part_l, qk_scale, v_scale, cap, window, a.group_size,
        plan.num_splits, plan.tiles_per_split,
        *q.stride(), *a.k_cache.stride(), *a.v_cache.stride(), *block_tables.stride(),
        *a.out.stride(), lse.stride(0), *part_m.stride(),
    )
    features = a.feature_constexprs()
    shared = {
        "HEAD_DIM": head_dim,
        "HEAD_DIM_PAD": padded_dim(head_dim),
        "GROUP_PAD": padded_dim(a.group_size),
    }
    interpreted_bf16 = bf16_via_fp32(q.dtype, kernels_are_interpreted())
    constexprs = {
        **shared,
        "BLOCK_SIZE": a.block_size,
        "KV_TILE": plan.config.kv_tile,
        **features,
        "FIXED_SPLIT": plan.batch_invariant,
        "DIRECT_OUTPUT": plan.direct_output,
        "BF16_VIA_FP32": interpreted_bf16,
    }
    merge_args = (kv_lens, sinks_ptr, a.out, lse, part_acc, part_m, part_l, window,
                  a.group_size, plan.num_splits, plan.tiles_per_split, *a.out.stride(),
                  lse.stride(0), *part_m.stride())
    merge_constexprs = {
        **shared,
        "KV_TILE": plan.config.kv_tile,
        "HAS_SLIDING_WINDOW": features["HAS_SLIDING_WINDOW"],
        "HAS_SINKS": features["HAS_SINKS"],
        "FIXED_SPLIT": plan.batch_invariant,
        "BF16_VIA_FP32": interpreted_bf16,
    }
    return SplitDecodeLaunch(a.out, lse, plan, (batch, a.num_kv_heads, plan.num_splits),
                             (batch, a.num_kv_heads), args, merge_args, constexprs,
                             merge_constexprs)


paged_split_decode = launcher(plan_paged_split_decode, "paged_split_decode", """Decode attention (one query token per sequence) over a paged KV cache, split-KV.

``out[i, h] = softmax(logits) @ V_i`` over the first ``kv_lens[i]`` tokens of sequence
``i`` read through ``block_tables[i]``; query head ``h`` reads KV head
``h // (num_q_heads // num_kv_heads)``; the query sits at position ``kv_lens[i] - 1``.
Semantics of every feature: ``reference/dense.py``.

Parameters
----------
q : Tensor[batch, num_q_heads, head_dim], float32 | float16 | bfloat16
kv_cache : Tensor[num_blocks, 2, block_size, num_kv_heads, head_dim], q's dtype or fp8
    K at ``[:, 0]``, V at ``[:, 1]``, any strides (read in place); float8_e4m3fn or
    float8_e5m2 values stand for ``stored * k_scale`` (``v_scale``).
block_tables : Tensor[batch, max_blocks_per_seq], int32
    Entries past a sequence's last block are never read.
kv_lens : Tensor[batch], int32
    Keys per sequence, each in ``[0, max_blocks_per_seq * block_size]`` (checked on the
    host); 0 gives a zero output row.
sm_scale : float
    Scale of ``q @ k``, > 0.
out : Tensor[batch, num_q_heads, head_dim], dtype of q, optional
sliding_window : int or None
    The query sees keys ``>= kv_len - sliding_window``.
logits_soft_cap : float or None
    Scaled logits ``s`` become ``logits_soft_cap * tanh(s / logits_soft_cap)``.
alibi_slopes : Tensor[num_q_heads], float32, or None
    Adds ``-slope[h] * (kv_len - 1 - key position)`` after the soft cap.
sinks : Tensor[num_q_heads], float32, or None
    One extra logit per query head in the softmax denominator, with no value.
k_scale, v_scale : float
    Dequantization scales of an fp8 cache; 1.0 otherwise.
batch_invariant : bool
    Fixed ``split_size`` keys per split: each output row bitwise independent of the
    other sequences of the batch.
split_size : int
    Keys per split in batch-invariant mode (:data:`BATCH_INVARIANT_SPLIT_SIZE`).
num_splits : int or None
    Force the balanced split count (None: :func:`plan_splits` chooses).
num_sms : int or None
    SMs to plan for; None: the device's (:func:`device_sm_count`).

Returns
-------
Tensor[batch, num_q_heads, head_dim], dtype of q

Raises
------
TypeError
    If q, kv_cache, block_tables or kv_lens is not a tensor, or a keyword argument is
    none of the above.
ValueError
    Naming the parameter: wrong rank, shape or dtype, mixed devices, a kv_len out of
    range, an invalid scale, window, cap, slope or sink vector, split option, or an
    ``out`` unlike q.
""")
