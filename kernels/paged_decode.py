"""Paged decode attention in Triton: one program per (sequence, KV head).

Each program owns one sequence's query token for the group of query heads that share a KV
head (GQA: ``group_size = num_q_heads // num_kv_heads`` rows), walks the sequence's keys
in tiles of :data:`KV_TILE` logical positions, looks up each key's physical block in the
block table (``block_tables[seq, pos // block_size]``, slot ``pos % block_size``), and
keeps an online softmax in float32 (Milakov & Gimelshein 2018, arXiv:1805.02867; as in
FlashAttention, arXiv:2205.14135). Tiling logical positions, not blocks, as vLLM's
``unified_attention`` does, keeps the tile a power of two for any block size.

Rules the kernel keeps:

- K and V are read in place from the canonical ``kv_cache[num_blocks, 2, block_size,
  num_kv_heads, head_dim]`` through its strides.
- Keys outside ``[first_key, kv_len)`` are excluded by selects (``tl.where`` to ``-inf``)
  and masked loads, never by multiplying by zero: unused slots hold NaN in pagedbench's
  inputs, and ``0 * NaN`` is NaN.
- Rows and channels are padded to powers of two >= 16 (the smallest ``tl.dot`` operand on
  a GPU); float32 dots use ``input_precision="ieee"`` (a GPU's default TF32 would miss the
  float32 tolerance by orders of magnitude).
- Under Triton's interpreter (``TRITON_INTERPRET=1`` at import), bfloat16 ``tl.dot`` is
  wrong (triton-lang/triton#11584) and a float32 -> bfloat16 cast truncates (1.9999990
  becomes 1.9921875; torch gives 2.0), so there the launcher sets ``BF16_VIA_FP32``
  (:func:`~pagedbench.kernels.paged_features.bf16_via_fp32`): float32 dots,
  round-to-nearest-even by integer arithmetic.

Interpreted cost: :func:`program_steps`, charged by
:data:`pagedbench.adapters.triton_decode.INTERPRETER_BUDGET`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Unpack

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from .paged_args import (
    PagedFeatures,
    check_paged_args,
    launcher,
)
from .paged_features import (
    _decode_group,
    _load_kv_tile,
    _logits,
    _softmax_step,
    _store_group,
    _table_blocks,
    bf16_via_fp32,
    padded_dim,
)

#: Keys per loop step (logical positions, any block size). A power of two >= 16 so that
#: ``tl.dot`` shapes are legal on a GPU; vLLM's decode tiles are 16 or 32 keys.
KV_TILE = 32
#: Padded head_dim from which a program gets 8 warps instead of 4: with 4, the
#: bfloat16 kernel at head_dim 256 spills registers (``ptxas -v``, sm_90a, triton 3.9.0:
#: 255 registers and 156 bytes of spill stores; 8 warps: 207 registers, no spill), while
#: at head_dim 128 4 warps do not spill (209 registers).
WIDE_HEAD_DIM = 256
#: The features this kernel has (no ALiBi, sinks or fp8 cache).
DECODE_FEATURES = frozenset({"sliding_window", "logits_soft_cap"})


@triton.jit
def _paged_decode_kernel(
    q_ptr, kv_cache_ptr, block_tables_ptr, kv_lens_ptr, out_ptr,
    sm_scale, logits_soft_cap, sliding_window, group_size,
    stride_q_seq, stride_q_head, stride_q_dim,
    stride_cache_block, stride_cache_kv, stride_cache_slot, stride_cache_head,
    stride_cache_dim,
    stride_table_seq, stride_table_block,
    stride_out_seq, stride_out_head, stride_out_dim,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, GROUP_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, KV_TILE: tl.constexpr,
    HAS_SLIDING_WINDOW: tl.constexpr, HAS_SOFT_CAP: tl.constexpr,
    BF16_VIA_FP32: tl.constexpr,
):
    seq, kv_head, rows, dims, row_ok, dim_ok, q_heads, q = _decode_group(
        q_ptr, group_size, stride_q_seq, stride_q_head, stride_q_dim, HEAD_DIM, HEAD_DIM_PAD,
        GROUP_PAD, BF16_VIA_FP32)
    keys = tl.arange(0, KV_TILE)

    kv_len = tl.load(kv_lens_ptr + seq)
    if HAS_SLIDING_WINDOW:
        first_key = tl.maximum(kv_len - sliding_window, 0)
    else:
        first_key = 0
    table_row = block_tables_ptr + seq.to(tl.int64) * stride_table_seq
    head_offset = kv_head.to(tl.int64) * stride_cache_head
    no_slopes = tl.zeros([GROUP_PAD], dtype=tl.float32)  # decode has no ALiBi

    m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)  # running max, log2 units
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)  # running sum of exp2(s - m_i)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], dtype=tl.float32)
    for tile_start in range((first_key // KV_TILE) * KV_TILE, kv_len, KV_TILE):
        pos = tile_start + keys  # [KV_TILE] logical key positions
        live = (pos < kv_len) & (pos >= first_key)
        block = _table_blocks(table_row, stride_table_block, pos, live, BLOCK_SIZE)
        k = _load_kv_tile(kv_cache_ptr, block, pos, live, dims, dim_ok, stride_cache_block,
                          stride_cache_slot, head_offset, stride_cache_dim, q.dtype, BLOCK_SIZE)
        v = _load_kv_tile(kv_cache_ptr + stride_cache_kv, block, pos, live, dims, dim_ok,
                          stride_cache_block, stride_cache_slot, head_offset, stride_cache_dim,
                          q.dtype, BLOCK_SIZE)
        s = _logits(q, k, sm_scale, logits_soft_cap, no_slopes, rows, pos, live[None, :],
                    HAS_SOFT_CAP, False)  # [GROUP_PAD, KV_TILE]
        m_i, l_i, acc = _softmax_step(s, v, m_i, l_i, acc)

    # A row that saw no key (kv_len 0) stays all zeros (FlashAttention's convention).
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    _store_group(out_ptr, seq, q_heads, dims, row_ok[:, None] & dim_ok[None, :], out,
                 stride_out_seq, stride_out_head, stride_out_dim, BF16_VIA_FP32)

def kernel_is_interpreted() -> bool:
    """True when this module's kernel runs under the Triton interpreter.

    Triton decides when ``@triton.jit`` decorates, i.e. when this module is imported
    with ``TRITON_INTERPRET=1`` in the environment; setting it later changes nothing.
    """
    return isinstance(_paged_decode_kernel, InterpretedFunction)


def program_steps(
    kv_lens: Sequence[int], num_kv_heads: int, sliding_window: int | None = None
) -> int:
    """Iterations of the key loop over all programs of one launch.

    A program (sequence ``i``, one KV head) steps over the :data:`KV_TILE`-aligned
    tiles from the first visible key (``kv_len - sliding_window``, or 0) to ``kv_len``.

    Parameters
    ----------
    kv_lens : sequence of int
        Keys per sequence, ``[batch]``.
    num_kv_heads : int
    sliding_window : int or None
    """
    steps = 0
    for kv_len in kv_lens:
        first_key = 0 if sliding_window is None else max(kv_len - sliding_window, 0)
        steps += math.ceil(kv_len / KV_TILE) - first_key // KV_TILE
    return steps * num_kv_heads


@dataclass(frozen=True)
class DecodeLaunch:
    """A validated, fully planned launch of the kernel; calling it only launches.

    Built by :func:`plan_paged_decode`. Calling it (re)writes every element of
    :attr:`out` and returns it, so one plan can be launched many times (benchmarks).

    Attributes
    ----------
    out : Tensor[batch, num_q_heads, head_dim], dtype of q
    grid : tuple[int, int]
        ``(batch, num_kv_heads)``: one program per sequence and KV head.
    args : tuple
        Positional kernel arguments (tensors, scalars, strides).
    constexprs : dict[str, Any]
        The kernel's compile-time parameters (``UPPER_CASE``).
    num_warps : int
        Warps per program on a GPU (see :data:`WIDE_HEAD_DIM`).
    """

    out: torch.Tensor
    grid: tuple[int, int]
    args: tuple[Any, ...]
    constexprs: dict[str, Any]
    num_warps: int

    def __call__(self) -> torch.Tensor:
        _paged_decode_kernel[self.grid](*self.args, **self.constexprs, num_warps=self.num_warps)
        return self.out


def plan_paged_decode(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                      kv_lens: torch.Tensor, sm_scale: float, *,
                      out: torch.Tensor | None = None,
                      **features: Unpack[PagedFeatures]) -> DecodeLaunch:
    """Validate the arguments of :func:`paged_decode` and plan its launch (no launch).

    Takes the same arguments as :func:`paged_decode` and raises its errors; allocates
    ``out`` when it is None. Use it to keep validation and allocation out of a timed
    region. The checks are :func:`~pagedbench.kernels.paged_args.check_paged_args`
    (decode; of the features only the window and the soft cap, so no fp8 cache).
    """
    a = check_paged_args(q, kv_cache, block_tables, kv_lens, sm_scale, out=out, decode=True,
                         features=features, kernel="paged_decode", takes=DECODE_FEATURES)
    batch, _, head_dim = q.shape
    args = (
        q, kv_cache, block_tables, kv_lens, a.out,
        a.sm_scale,
        float(a.features["logits_soft_cap"] or 1.0),
        int(a.features["sliding_window"] or 0),
        a.group_size,
        *q.stride(), *kv_cache.stride(), *block_tables.stride(), *a.out.stride(),
    )
    constexprs = {
        "HEAD_DIM": head_dim,
        "HEAD_DIM_PAD": padded_dim(head_dim),
        "GROUP_PAD": padded_dim(a.group_size),
        "BLOCK_SIZE": a.block_size,
        "KV_TILE": KV_TILE,
        "HAS_SLIDING_WINDOW": a.features["sliding_window"] is not None,
        "HAS_SOFT_CAP": a.features["logits_soft_cap"] is not None,
        "BF16_VIA_FP32": bf16_via_fp32(q.dtype, kernel_is_interpreted()),
    }
    num_warps = 8 if constexprs["HEAD_DIM_PAD"] >= WIDE_HEAD_DIM else 4
    return DecodeLaunch(a.out, (batch, a.num_kv_heads), args, constexprs, num_warps)


paged_decode = launcher(plan_paged_decode, "paged_decode", """Decode attention (one query token per sequence) over a paged KV cache.

``out[i, h] = softmax(sm_scale * K_i @ q[i, h]) @ V_i`` where ``K_i, V_i`` are the
first ``kv_lens[i]`` tokens of sequence ``i`` read through ``block_tables[i]``, and
query head ``h`` reads KV head ``h // (num_q_heads // num_kv_heads)``.

Parameters
----------
q : Tensor[batch, num_q_heads, head_dim], float32 | float16 | bfloat16
    The query of each sequence's last token.
kv_cache : Tensor[num_blocks, 2, block_size, num_kv_heads, head_dim], dtype of q
    K at ``[:, 0]``, V at ``[:, 1]``; any strides (read in place).
block_tables : Tensor[batch, max_blocks_per_seq], int32
    Physical block of each logical block. Entries past a sequence's last block are
    never read.
kv_lens : Tensor[batch], int32
    Keys per sequence, each in ``[0, max_blocks_per_seq * block_size]`` (not checked:
    that would need a device-to-host copy); 0 gives a zero output row.
sm_scale : float
    Scale of the logits ``q @ k``, > 0 (usually ``1 / sqrt(head_dim)``).
out : Tensor[batch, num_q_heads, head_dim], dtype of q, optional
    Written in full and returned; allocated when None.
sliding_window : int or None
    The query (at position ``kv_len - 1``) sees only keys ``>= kv_len - sliding_window``
    (FlashAttention's ``window_size = (sliding_window - 1, 0)``).
logits_soft_cap : float or None
    Scaled logits ``s`` become ``logits_soft_cap * tanh(s / logits_soft_cap)``
    (Gemma 2; applied after ``sm_scale``, as in FlashInfer and vLLM).

Returns
-------
Tensor[batch, num_q_heads, head_dim], dtype of q
    ``out`` (the given buffer, or a new one).

Raises
------
TypeError
    If q, kv_cache, block_tables or kv_lens is not a tensor, or a keyword argument is
    none of the above (ALiBi, sinks and fp8 scales are the other kernels').
ValueError
    On a wrong rank, shape, dtype (block_tables and kv_lens must be int32; q and
    kv_cache one of float32/float16/bfloat16, the same), mixed devices, sm_scale <= 0,
    sliding_window < 1, logits_soft_cap <= 0, or an ``out`` unlike q.
""")
