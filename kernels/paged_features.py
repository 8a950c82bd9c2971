"""What pagedbench's Triton paged kernels share on the device: logit math, softmax, loads
and stores, bfloat16, the launch table (the host side, argument checks and launchers:
:mod:`~pagedbench.kernels.paged_args`). The ``@triton.jit`` helpers hold the
semantics that ``reference/dense.py`` pins, written once for the split-KV decode and
prefill kernels:

- logits ``s = sm_scale * q.k``; with an fp8 cache ``k = stored * k_scale``, so
  ``k_scale`` joins the scale and ``v_scale`` multiplies the accumulator once at the end
  (the same product as dequantizing every K and V element first, for two multiplies);
- soft cap ``c * tanh(s / c)``, then ALiBi ``- slope[h] * (query pos - key pos)``;
- keys outside ``[first visible, query pos]`` are ``-inf`` by a select, never by a
  multiply (the poison in unused slots is NaN, and ``0 * NaN`` is NaN);
- online softmax in base 2, float32 (Milakov & Gimelshein 2018, arXiv:1805.02867): a row
  that has seen no key keeps max ``-inf`` and weight 0 instead of ``exp2(-inf + inf)``;
- a sink is a logit with no value: the softmax starts from max ``sink``, sum 1.

K and V come through separate base pointers and strides, so a cache whose V has another
head_dim (MLA-style) needs a V-side head_dim constexpr, not new addressing. All three
kernels (:mod:`~pagedbench.kernels.paged_decode` too) take their padding
(:func:`padded_dim`), ``_tanh`` and the interpreter's bfloat16 workaround
(:func:`bf16_via_fp32`, ``_round_to_bf16``) from here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

#: log2(e): the kernels work in base 2 (``exp2``), as FlashAttention-2 does.
LOG2E = tl.constexpr(1.4426950408889634)
#: Smallest extent ``tl.dot`` accepts for each operand dimension on a GPU.
MIN_DOT_DIM = 16


def padded_dim(n: int) -> int:
    """``n`` rounded up to a power of two, at least :data:`MIN_DOT_DIM` (rows, channels)."""
    return max(MIN_DOT_DIM, triton.next_power_of_2(n))


def bf16_via_fp32(dtype: torch.dtype, interpreted: bool) -> bool:
    """Whether a kernel must do its bfloat16 work in float32 (``BF16_VIA_FP32``).

    Only bfloat16 under Triton's interpreter, where two operations on it are wrong in
    triton 3.9.0: ``tl.dot`` multiplies the raw 16-bit patterns as integers
    (triton-lang/triton#11584; Triton's debugging guide: cast bfloat16 to float32 first),
    and a float32 -> bfloat16 cast truncates instead of rounding to nearest even, even
    with ``fp_downcast_rounding="rtne"`` (1.9999990 becomes 1.9921875; torch and the GPU
    give 2.0). The kernels then upcast the dot operands and round the output with
    :func:`_round_to_bf16`. Compiled GPU code keeps bfloat16 dots for tensor cores.

    Parameters
    ----------
    dtype : torch.dtype
        Dtype of Q (and of K and V unless they are fp8).
    interpreted : bool
        Whether the kernel runs under the interpreter.
    """
    return interpreted and dtype == torch.bfloat16


#: Below this |x|, :func:`_tanh` sums its series (to x**7: truncation under 2e-9 of
#: tanh there; above it ``1 - exp(-2|x|)`` loses at most 3e-7, about 4 float32 ulps).
TANH_SERIES_BELOW = tl.constexpr(0.125)


@triton.jit
def _tanh(x):
    """tanh from one exponential, overflow-free: ``sign(x) (1 - e) / (1 + e)``,
    ``e = exp(-2|x|)`` (``libdevice.tanh`` does not run under the interpreter); below
    :data:`TANH_SERIES_BELOW` its Taylor series to x**7 instead, since ``1 - e`` cancels
    there (a soft cap of 1e4 over float32 logits of 1 lost 3e-4 of each logit)."""
    a = tl.abs(x)
    e = tl.exp(-2.0 * a)
    t = (1.0 - e) / (1.0 + e)
    a2 = a * a
    series = a * (1.0 + a2 * (-1.0 / 3.0 + a2 * (2.0 / 15.0 + a2 * (-17.0 / 315.0))))
    t = tl.where(a < TANH_SERIES_BELOW, series, t)
    return tl.where(x < 0, -t, t)


@triton.jit
def _round_to_bf16(x):
    """float32 -> bfloat16, round to nearest even, by integer arithmetic on the bits:
    add ``0x7FFF`` plus the lowest kept bit, then drop the low 16 bits (the carry moves
    into the exponent as it must)."""
    bits = x.to(tl.uint32, bitcast=True)
    rounded = bits + 0x7FFF + ((bits >> 16) & 1)
    return (rounded >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)


@dataclass(frozen=True)
class LaunchConfig:
    """Tile shape and GPU launch parameters of one kernel at one padded head_dim.

    Attributes
    ----------
    kv_tile : int
        Keys per loop step for a 16-bit or fp8 cache (a power of two >= 16, any block
        size); a float32 cache takes half, so one stage holds the same bytes.
    block_m : int
        Prefill: query rows per program (tokens x the GQA group); 0 for decode, whose
        rows are the group itself.
    num_warps, num_stages : int
        Passed to the launch; ``num_stages`` is the depth of Triton's software pipeline
        (buffers in shared memory for the next tiles' K and V).
    programs_per_sm : int
        Decode: programs one SM is assumed to hold at once (shared memory of
        ``num_stages`` K and V tiles against the 228 KB of an H100/H200 SM), which sets
        how many splits fill the GPU.
    """

    kv_tile: int
    block_m: int
    num_warps: int
    num_stages: int
    programs_per_sm: int

    def for_cache(self, element_size: int) -> LaunchConfig:
        """This config for a cache of ``element_size`` bytes (float32: half the tile)."""
        if element_size <= 2:
            return self
        return LaunchConfig(max(16, self.kv_tile // 2), self.block_m, self.num_warps,
                            self.num_stages, self.programs_per_sm)


#: Launch configs by kernel and padded head_dim: defaults taken from public kernels
#: (Triton's fused-attention tutorial, vLLM's Triton decode and unified attention,
#: FlashAttention-2's launch templates), NOT measured on a GPU; docs/KERNELS.md gives
#: each row's source and an empty column for the H200 measurement that should replace
#: it. ``num_stages`` 3 is the least depth at which the compiled key loop keeps the next
#: tiles' K/V copies in flight during the math (sm_80 and sm_90, triton 3.9; checked by
#: suites/kernels/test_triton_paged_kernels_compile.py); at 2 the copy waits for the math.
LAUNCH_CONFIGS: dict[tuple[str, int], LaunchConfig] = {
    ("split_decode", 16): LaunchConfig(64, 0, 4, 3, 4),
    ("split_decode", 32): LaunchConfig(64, 0, 4, 3, 4),
    ("split_decode", 64): LaunchConfig(64, 0, 4, 3, 4),
    ("split_decode", 128): LaunchConfig(64, 0, 4, 3, 2),
    ("split_decode", 256): LaunchConfig(32, 0, 8, 3, 2),
    ("prefill", 16): LaunchConfig(64, 64, 4, 3, 0),
    ("prefill", 32): LaunchConfig(64, 64, 4, 3, 0),
    ("prefill", 64): LaunchConfig(64, 64, 4, 3, 0),
    ("prefill", 128): LaunchConfig(64, 64, 4, 3, 0),
    ("prefill", 256): LaunchConfig(32, 64, 8, 3, 0),
}


def launch_config(kernel: str, head_dim: int, element_size: int) -> LaunchConfig:
    """The :data:`LAUNCH_CONFIGS` entry of ``kernel`` at ``head_dim`` (padded to a power
    of two >= 16) for a cache of ``element_size`` bytes.

    Raises
    ------
    ValueError
        If there is no entry (head_dim above 256, or an unknown kernel).
    """
    key = (kernel, padded_dim(head_dim))
    if key not in LAUNCH_CONFIGS:
        known = sorted({d for k, d in LAUNCH_CONFIGS if k == kernel})
        raise ValueError(f"no launch config for {kernel!r} at head_dim {head_dim} "
                         f"(padded head_dims with one: {known})")
    return LAUNCH_CONFIGS[key].for_cache(element_size)


@triton.jit
def _table_blocks(table_row, stride_table_block, pos, live, BLOCK_SIZE: tl.constexpr):
    """Physical block of each logical key position ``pos`` ([KV_TILE], int64; 0 where
    not ``live``)."""
    return tl.load(table_row + (pos // BLOCK_SIZE) * stride_table_block, mask=live,
                   other=0).to(tl.int64)


@triton.jit
def _load_kv_tile(cache_ptr, block, pos, live, dims, dim_ok, stride_block, stride_slot,
                  head_offset, stride_dim, compute_dtype, BLOCK_SIZE: tl.constexpr):
    """K or V of the keys at ``pos`` in physical blocks ``block`` (both [KV_TILE]) as
    ``[KV_TILE, HEAD_DIM_PAD]`` in ``compute_dtype``; dead keys and channels load 0."""
    slot = block * stride_block + (pos % BLOCK_SIZE) * stride_slot + head_offset  # [KV_TILE]
    offsets = slot[:, None] + dims[None, :] * stride_dim  # [KV_TILE, HEAD_DIM_PAD]
    tile = tl.load(cache_ptr + offsets, mask=live[:, None] & dim_ok[None, :], other=0.0)
    return tile.to(compute_dtype)


@triton.jit
def _logits(q, k, qk_scale, logits_soft_cap, slopes, q_pos, k_pos, visible,
            HAS_SOFT_CAP: tl.constexpr, HAS_ALIBI: tl.constexpr):
    """Logits in base-2 units, ``[ROWS, KV_TILE]`` float32: scale, soft cap, ALiBi, then
    ``-inf`` wherever ``visible`` is False. ``q_pos`` [ROWS], ``k_pos`` [KV_TILE]."""
    s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale
    if HAS_SOFT_CAP:
        s = logits_soft_cap * _tanh(s / logits_soft_cap)
    if HAS_ALIBI:
        s = s - slopes[:, None] * (q_pos[:, None] - k_pos[None, :]).to(tl.float32)
    return tl.where(visible, s * LOG2E, float("-inf"))


@triton.jit
def _softmax_step(s, v, m_i, l_i, acc):
    """One online-softmax update with logits ``s`` [ROWS, KV_TILE] (base 2) and values
    ``v`` [KV_TILE, HEAD_DIM_PAD]; returns the new (max, sum, accumulator)."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])  # [ROWS, KV_TILE]
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    return m_new, l_i, acc


@triton.jit
def _softmax_start(sinks_ptr, q_heads, row_ok, ROWS: tl.constexpr, HAS_SINKS: tl.constexpr):
    """Initial (max, sum) of each row: ``(-inf, 0)``, or ``(sink, 1)`` with sinks."""
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + q_heads, mask=row_ok, other=0.0)
        m_i = sink * LOG2E
        l_i = tl.full([ROWS], 1.0, dtype=tl.float32)
    else:
        m_i = tl.full([ROWS], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([ROWS], dtype=tl.float32)
    return m_i, l_i


@triton.jit
def _store_rows(out_ptr, offsets, x, mask, BF16_VIA_FP32: tl.constexpr):
    """Store float32 ``x`` in the output's dtype (bfloat16 rounded to nearest even by
    integer arithmetic under the interpreter: :func:`bf16_via_fp32`)."""
    if BF16_VIA_FP32:
        y = _round_to_bf16(x)
    else:
        y = x.to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + offsets, y, mask=mask)


@triton.jit
def _group_rows(group_size, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
                GROUP_PAD: tl.constexpr):
    """A decode program's rows: the query heads of KV head ``program_id(1)``'s GQA group
    for sequence ``program_id(0)``. Returns ``(seq, kv_head, rows, dims, row_ok, dim_ok,
    q_heads)``: row and channel indices padded to GROUP_PAD and HEAD_DIM_PAD, their
    masks, and the query head of each row."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    rows = tl.arange(0, GROUP_PAD)
    dims = tl.arange(0, HEAD_DIM_PAD)
    row_ok = rows < group_size
    dim_ok = dims < HEAD_DIM
    return seq, kv_head, rows, dims, row_ok, dim_ok, kv_head * group_size + rows


@triton.jit
def _decode_group(q_ptr, group_size, stride_q_seq, stride_q_head, stride_q_dim,
                  HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, GROUP_PAD: tl.constexpr,
                  BF16_VIA_FP32: tl.constexpr):
    """:func:`_group_rows` and their query, ``q`` [GROUP_PAD, HEAD_DIM_PAD] with padding
    rows and channels 0 (float32 under ``BF16_VIA_FP32``), appended to its tuple."""
    seq, kv_head, rows, dims, row_ok, dim_ok, q_heads = _group_rows(group_size, HEAD_DIM,
                                                                    HEAD_DIM_PAD, GROUP_PAD)
    q_offsets = (seq.to(tl.int64) * stride_q_seq + q_heads[:, None] * stride_q_head
                 + dims[None, :] * stride_q_dim)
    q = tl.load(q_ptr + q_offsets, mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    if BF16_VIA_FP32:
        q = q.to(tl.float32)
    return seq, kv_head, rows, dims, row_ok, dim_ok, q_heads, q


@triton.jit
def _load_kv_ahead(k_cache_ptr, v_cache_ptr, block, pos, first_key, key_end, table_row,
                   stride_table_block, dims, dim_ok, stride_k_block, stride_k_slot, k_head,
                   stride_k_dim, stride_v_block, stride_v_slot, v_head, stride_v_dim, dtype,
                   BLOCK_SIZE: tl.constexpr, KV_TILE: tl.constexpr):
    """The tile of keys ``pos`` (``block``: their block numbers): ``(k, v, live,
    next_block)``, ``live`` the keys in ``[first_key, key_end)``, and the next tile's
    block numbers, loaded now so that the next K/V addresses never wait on a load of their
    own iteration (Triton's pipeliner can then overlap the copies with the math)."""
    live = (pos < key_end) & (pos >= first_key)
    k = _load_kv_tile(k_cache_ptr, block, pos, live, dims, dim_ok, stride_k_block,
                      stride_k_slot, k_head, stride_k_dim, dtype, BLOCK_SIZE)
    v = _load_kv_tile(v_cache_ptr, block, pos, live, dims, dim_ok, stride_v_block,
                      stride_v_slot, v_head, stride_v_dim, dtype, BLOCK_SIZE)
    next_pos = pos + KV_TILE
    return k, v, live, _table_blocks(table_row, stride_table_block, next_pos,
                                     next_pos < key_end, BLOCK_SIZE)


@triton.jit
def _store_group(out_ptr, seq, q_heads, dims, mask, x, stride_out_seq, stride_out_head,
                 stride_out_dim, BF16_VIA_FP32: tl.constexpr):
    """Write a decode program's rows ``x`` [GROUP_PAD, HEAD_DIM_PAD] (float32) to
    ``out[seq, q_heads, dims]`` where ``mask``, in out's dtype."""
    offsets = (seq.to(tl.int64) * stride_out_seq + q_heads[:, None] * stride_out_head
               + dims[None, :] * stride_out_dim)
    _store_rows(out_ptr, offsets, x, mask, BF16_VIA_FP32)


def kernels_are_interpreted() -> bool:
    """True when these helpers (and so the kernels importing them) run under the Triton
    interpreter: decided at import, by ``TRITON_INTERPRET=1`` in the environment."""
    return isinstance(_logits, InterpretedFunction)
