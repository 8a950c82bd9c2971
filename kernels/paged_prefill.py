"""Paged prefill, chunked prefill and multi-token decode in Triton, GQA-packed.

Queries are packed varlen (``cu_seqlens_q``): sequence ``i`` owns rows
``cu_seqlens_q[i]:cu_seqlens_q[i + 1]``, its ``q_len`` last tokens, and attends causally
bottom-right to its ``kv_len`` keys (query ``j`` sits at position ``kv_len - q_len + j``,
as ``reference/dense.py`` pins it), so a batch can mix decodes (``q_len`` 1), chunks of
a prompt (``q_len < kv_len``) and whole prompts in one launch. One program takes
``block_m`` rows that are ``block_m // group_size`` consecutive tokens x the whole group
of query heads sharing one KV head (GQA packing, as FlashAttention-3's ``PackGQA`` and
vLLM's unified attention pack them), so every K/V tile it loads serves the whole group.

The work list (program -> sequence, first token) is planned on the host from
``cu_seqlens_q`` and ``kv_lens`` (as FlashInfer's ``plan`` does), longest key range
first so that the last wave holds the short items. Keys are tiled over logical
positions, any block size; each program walks from the first key its first token's
window can see to its last token's position. The next tile's block numbers are loaded
one iteration ahead, so Triton's pipeliner can overlap the K/V copies with the math (see
:mod:`~pagedbench.kernels.paged_split_decode`). Features, fp8 caches and the
interpreter's bfloat16 workaround: :mod:`pagedbench.kernels.paged_features`.
"""

from __future__ import annotations

from collections.abc import Sequence
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
    LaunchConfig,
    _load_kv_ahead,
    _logits,
    _softmax_start,
    _softmax_step,
    _store_rows,
    _table_blocks,
    bf16_via_fp32,
    kernels_are_interpreted,
    launch_config,
    padded_dim,
)


@triton.jit
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, kv_lens_ptr, cu_seqlens_q_ptr,
    work_seq_ptr, work_token_ptr, alibi_slopes_ptr, sinks_ptr, out_ptr,
    qk_scale, v_scale, logits_soft_cap, sliding_window, group_size, tokens_per_program,
    stride_q_token, stride_q_head, stride_q_dim,
    stride_k_block, stride_k_slot, stride_k_head, stride_k_dim,
    stride_v_block, stride_v_slot, stride_v_head, stride_v_dim,
    stride_table_seq, stride_table_block,
    stride_out_token, stride_out_head, stride_out_dim,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, KV_TILE: tl.constexpr,
    HAS_SLIDING_WINDOW: tl.constexpr, HAS_SOFT_CAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    HAS_SINKS: tl.constexpr, BF16_VIA_FP32: tl.constexpr,
):
    item = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = tl.load(work_seq_ptr + item)
    first_token = tl.load(work_token_ptr + item)  # within the sequence
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    kv_len = tl.load(kv_lens_ptr + seq)

    rows = tl.arange(0, BLOCK_M)
    dims = tl.arange(0, HEAD_DIM_PAD)
    keys = tl.arange(0, KV_TILE)
    token = first_token + rows // group_size  # [BLOCK_M] token of each row
    q_heads = kv_head * group_size + rows % group_size  # [BLOCK_M] its query head
    row_ok = (rows < tokens_per_program * group_size) & (token < q_len)
    dim_ok = dims < HEAD_DIM
    q_pos = kv_len - q_len + token  # [BLOCK_M] absolute positions

    q_offsets = ((q_start + token).to(tl.int64)[:, None] * stride_q_token
                 + q_heads[:, None] * stride_q_head + dims[None, :] * stride_q_dim)
    q = tl.load(q_ptr + q_offsets, mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    if BF16_VIA_FP32:
        q = q.to(tl.float32)
    if HAS_ALIBI:
        slopes = tl.load(alibi_slopes_ptr + q_heads, mask=row_ok, other=0.0)
    else:
        slopes = tl.zeros([BLOCK_M], dtype=tl.float32)

    # Keys from the first row's window start to the last row's position.
    last_pos = kv_len - q_len + tl.minimum(first_token + tokens_per_program, q_len) - 1
    key_end = last_pos + 1
    if HAS_SLIDING_WINDOW:
        first_key = tl.maximum(kv_len - q_len + first_token - sliding_window + 1, 0)
    else:
        first_key = kv_len * 0
    table_row = block_tables_ptr + seq.to(tl.int64) * stride_table_seq
    k_head = kv_head.to(tl.int64) * stride_k_head
    v_head = kv_head.to(tl.int64) * stride_v_head

    m_i, l_i = _softmax_start(sinks_ptr, q_heads, row_ok, BLOCK_M, HAS_SINKS)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    tile_start = (first_key // KV_TILE) * KV_TILE
    pos = tile_start + keys
    block = _table_blocks(table_row, stride_table_block, pos,
                          (pos < key_end) & (pos >= first_key), BLOCK_SIZE)
    for start in range(tile_start, key_end, KV_TILE):
        pos = start + keys  # [KV_TILE] logical key positions
        k, v, live, block = _load_kv_ahead(
            k_cache_ptr, v_cache_ptr, block, pos, first_key, key_end, table_row,
            stride_table_block, dims, dim_ok, stride_k_block, stride_k_slot, k_head,
            stride_k_dim, stride_v_block, stride_v_slot, v_head, stride_v_dim, q.dtype,
            BLOCK_SIZE, KV_TILE)
        visible = live[None, :] & (pos[None, :] <= q_pos[:, None])  # causal, bottom-right
        if HAS_SLIDING_WINDOW:
            visible = visible & (pos[None, :] > q_pos[:, None] - sliding_window)
        s = _logits(q, k, qk_scale, logits_soft_cap, slopes, q_pos, pos, visible,
                    HAS_SOFT_CAP, HAS_ALIBI)  # [BLOCK_M, KV_TILE]
        m_i, l_i, acc = _softmax_step(s, v, m_i, l_i, acc)

    out = acc * v_scale / tl.where(l_i > 0, l_i, 1.0)[:, None]
    out_offsets = ((q_start + token).to(tl.int64)[:, None] * stride_out_token
                   + q_heads[:, None] * stride_out_head + dims[None, :] * stride_out_dim)
    _store_rows(out_ptr, out_offsets, out, row_ok[:, None] & dim_ok[None, :], BF16_VIA_FP32)


@dataclass(frozen=True)
class PrefillPlan:
    """The work list of one launch (from the lengths alone; see :func:`plan_prefill`).

    Attributes
    ----------
    config : LaunchConfig
        The prefill row of :data:`~pagedbench.kernels.paged_features.LAUNCH_CONFIGS` for
        this head_dim and cache element size.
    block_m : int
        Rows per program (a power of two >= 16 and >= ``group_size``).
    tokens_per_program : int
        ``block_m // group_size``.
    work : tuple[tuple[int, int], ...]
        ``(sequence, first token)`` of each program, longest key range first.
    key_tiles : tuple[int, ...]
        Key-loop steps of each program, in the same order.
    """

    config: LaunchConfig
    block_m: int
    tokens_per_program: int
    work: tuple[tuple[int, int], ...]
    key_tiles: tuple[int, ...]

    def steps(self, num_kv_heads: int) -> int:
        """The interpreter's cost unit over all programs: one per program, and
        ``block_m // 16`` per loop iteration (a step over 16 rows costs about what a
        decode step of :meth:`.paged_split_plan.SplitPlan.steps` costs)."""
        return (sum(self.key_tiles) * (self.block_m // 16) + len(self.work)) * num_kv_heads


def plan_prefill(
    q_lens: Sequence[int],
    kv_lens: Sequence[int],
    group_size: int,
    head_dim: int,
    cache_element_size: int,
    sliding_window: int | None = None,
) -> PrefillPlan:
    """Rows per program and the work list, from the lengths.

    ``block_m`` is the table's, shrunk to ``group_size x`` the longest ``q_len`` (a
    decode-only batch needs no more rows than its group; FlashAttention-3's
    ``should_pack_gqa`` reasons the same way), and grown to cover one whole group.

    Raises
    ------
    ValueError
        If a ``q_len`` is outside ``[0, kv_len]``.
    """
    for i, (nq, nk) in enumerate(zip(q_lens, kv_lens)):
        if not 0 <= nq <= nk:
            raise ValueError(f"sequence {i}: q_len {nq} must be in [0, kv_len = {nk}] "
                             "(the queries are the last q_len of the kv_len tokens)")
    config = launch_config("prefill", head_dim, cache_element_size)
    need = padded_dim(group_size * max(max(q_lens), 1))
    block_m = max(padded_dim(group_size), min(config.block_m, need))
    tokens = block_m // group_size
    items = []
    for seq, (nq, nk) in enumerate(zip(q_lens, kv_lens)):
        for first in range(0, nq, tokens):
            last_pos = nk - nq + min(first + tokens, nq) - 1
            first_key = 0 if sliding_window is None else max(nk - nq + first
                                                             - sliding_window + 1, 0)
            tiles = -(-(last_pos + 1) // config.kv_tile) - first_key // config.kv_tile
            items.append((tiles, seq, first))
    items.sort(key=lambda item: -item[0])  # stable: ties keep sequence order
    return PrefillPlan(config, block_m, tokens, tuple((s, f) for _, s, f in items),
                       tuple(t for t, _, _ in items))


@dataclass(frozen=True)
class PrefillLaunch:
    """A validated, fully planned prefill; calling it launches and returns :attr:`out`,
    rewritten in full each time.

    Attributes
    ----------
    out : Tensor[total_q, num_q_heads, head_dim], dtype of q
    plan : PrefillPlan
    grid : tuple[int, int]
        ``(programs, num_kv_heads)``.
    args : tuple
    constexprs : dict[str, Any]
    """

    out: torch.Tensor
    plan: PrefillPlan
    grid: tuple[int, int]
    args: tuple[Any, ...]
    constexprs: dict[str, Any]

    def __call__(self) -> torch.Tensor:
        if self.grid[0]:
            _prefill_kernel[self.grid](*self.args, **self.constexprs,
                                       num_warps=self.plan.config.num_warps,
                                       num_stages=self.plan.config.num_stages)
        return self.out


def plan_paged_prefill(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                       kv_lens: torch.Tensor, cu_seqlens_q: torch.Tensor, sm_scale: float, *,
                       out: torch.Tensor | None = None,
                       **features: Unpack[PagedFeatures]) -> PrefillLaunch:
    """Validate the arguments of :func:`paged_prefill` and plan its launch (no launch).

    Takes the same arguments and raises the same errors. Reads ``cu_seqlens_q`` and
    ``kv_lens`` on the host once (a device sync) to build the work list; the plan holds
    for these lengths.
    """
    a = check_paged_args(q, kv_cache, block_tables, kv_lens, sm_scale, out=out, decode=False,
                         features=features, kernel="paged_prefill")
    batch = kv_lens.shape[0]
    if not isinstance(cu_seqlens_q, torch.Tensor):
        raise TypeError(f"cu_seqlens_q must be a torch.Tensor, got {type(cu_seqlens_q).__name__}")
    if (cu_seqlens_q.dtype != torch.int32 or tuple(cu_seqlens_q.shape) != (batch + 1,)
            or cu_seqlens_q.device != q.device):
        raise ValueError(f"cu_seqlens_q must be an int32 Tensor[batch + 1 = {batch + 1}] on "
                         f"{q.device}, got {cu_seqlens_q.dtype} {tuple(cu_seqlens_q.shape)} "
                         f"on {cu_seqlens_q.device}")
    cu = cu_seqlens_q.tolist()
    if cu[0] != 0 or cu[-1] != q.shape[0] or any(b < a_ for a_, b in zip(cu, cu[1:])):
        raise ValueError(f"cu_seqlens_q must rise from 0 to total_q = {q.shape[0]} "
                         f"(q's first dimension), got {cu}")
    lens = kv_lens.tolist()
    check_kv_lens_fit(lens, block_tables.shape[1], a.block_size)
    head_dim = q.shape[2]
    plan = plan_prefill([b - a_ for a_, b in zip(cu, cu[1:])], lens, a.group_size, head_dim,
                        kv_cache.element_size(), a.features["sliding_window"])
    work_seq = torch.tensor([s for s, _ in plan.work], dtype=torch.int32, device=q.device)
    work_token = torch.tensor([f for _, f in plan.work], dtype=torch.int32, device=q.device)
    alibi_ptr, sinks_ptr, qk_scale, v_scale, cap, window = a.feature_args()
    args = (
        q, a.k_cache, a.v_cache, block_tables, kv_lens, cu_seqlens_q, work_seq, work_token,
        alibi_ptr, sinks_ptr, a.out, qk_scale, v_scale, cap, window, a.group_size,
        plan.tokens_per_program,
        *q.stride(), *a.k_cache.stride(), *a.v_cache.stride(), *block_tables.stride(),
        *a.out.stride(),
    )
    constexprs = {
        "HEAD_DIM": head_dim,
        "HEAD_DIM_PAD": padded_dim(head_dim),
        "BLOCK_M": plan.block_m,
        "BLOCK_SIZE": a.block_size,
        "KV_TILE": plan.config.kv_tile,
        **a.feature_constexprs(),
        "BF16_VIA_FP32": bf16_via_fp32(q.dtype, kernels_are_interpreted()),
    }
    return PrefillLaunch(a.out, plan, (len(plan.work), a.num_kv_heads), args, constexprs)


paged_prefill = launcher(plan_paged_prefill, "paged_prefill", """Causal attention of packed varlen queries over a paged KV cache.

Query ``j`` of sequence ``i`` (row ``cu_seqlens_q[i] + j``) sits at position
``kv_lens[i] - q_len_i + j`` and attends to the keys at positions up to its own
(bottom-right causal), through ``block_tables[i]``; query head ``h`` reads KV head
``h // (num_q_heads // num_kv_heads)``. Decodes (``q_len`` 1), chunked prefills and
whole prompts mix freely. Semantics of every feature: ``reference/dense.py``.

Parameters
----------
q : Tensor[total_q, num_q_heads, head_dim], float32 | float16 | bfloat16
kv_cache : Tensor[num_blocks, 2, block_size, num_kv_heads, head_dim], q's dtype or fp8
    Read in place through its strides; fp8 values stand for ``stored * k_scale``
    (``v_scale``). Must already hold the queries' own keys and values.
block_tables : Tensor[batch, max_blocks_per_seq], int32
kv_lens : Tensor[batch], int32
    Keys per sequence, each in ``[q_len_i, max_blocks_per_seq * block_size]``.
cu_seqlens_q : Tensor[batch + 1], int32
    Prefix sums of the query lengths, from 0 to ``total_q``.
sm_scale : float
out, sliding_window, logits_soft_cap, alibi_slopes, sinks, k_scale, v_scale
    As :func:`~pagedbench.kernels.paged_split_decode.paged_split_decode`, per query
    position (a window ``W`` shows query position ``p`` the keys ``p - W + 1 .. p``).

Returns
-------
Tensor[total_q, num_q_heads, head_dim], dtype of q

Raises
------
TypeError
    If a tensor argument is not a tensor, or a keyword argument is none of the above.
ValueError
    Naming the parameter: wrong rank, shape or dtype, mixed devices, ``cu_seqlens_q``
    not rising from 0 to ``total_q``, a ``q_len`` above its ``kv_len``, a kv_len out
    of range, an invalid scale, window, cap, slope or sink vector, or an ``out``
    unlike q.
""")
