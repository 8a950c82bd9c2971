"""Faults in the arithmetic: precision of the logits and of the softmax state, split-KV
merges, fp8 dequantization and the final division.

Each class is :class:`~.kernel.PagedKernel` with one step replaced by the faulty one of
the public report its docstring cites; everywhere else it is the fault-free kernel.
"""

from __future__ import annotations

import math

import torch

from .kernel import NEG_INF, PagedKernel, State, merge, round_up


class QkReductionLowPrecision(PagedKernel):
    """Accumulates the Q.K dot products in the case dtype, 16 channels at a time (as
    FlashInfer's ``allow_fp16_qk_reduction`` does in fp16), so every logit carries the
    rounding of a 16-bit sum. Imitates flashinfer-ai/flashinfer#4298 (the
    FP16_QK_REDUCTION path decoded its QK logits wrongly)."""

    name = "fault-qk-reduction-low-precision"
    imitates = "flashinfer-ai/flashinfer#4298"
    trigger = "float16 or bfloat16 logits of large magnitude"
    CHUNK = 16

    def scores(self, q, k, case):
        low = case.torch_dtype
        if low == torch.float32:
            return super().scores(q, k, case)
        self.fired()
        acc = torch.zeros(q.shape[1], q.shape[0], k.shape[0], dtype=low)  # [hq, q_len, n]
        for c in range(0, q.shape[2], self.CHUNK):
            part = torch.einsum("qhd,khd->hqk", q[..., c : c + self.CHUNK],
                                k[..., c : c + self.CHUNK])
            acc = (acc.float() + part).to(low)
        return acc.float() * case.scale


class LowPrecisionAccumulator(PagedKernel):
    """Runs the online softmax over tiles of 16 keys with its running sum and output
    accumulator stored in the case dtype between tiles (the max stays float32), so their
    rounding error grows with the number of tiles. Imitates the intermediate attention
    state kept in the output dtype of flashinfer-ai/flashinfer#5107 (split-KV partial
    outputs rounded to bf16 in a workspace sized for float32)."""

    name = "fault-low-precision-accumulator"
    imitates = "flashinfer-ai/flashinfer#5107"
    trigger = "float16 or bfloat16 with more than one 16-key tile; large at long contexts"
    TILE = 16

    def reduce(self, logits, v, sinks, case, q_len):
        low = case.torch_dtype
        hq, q_len, n = logits.shape
        if low == torch.float32 or n <= self.TILE:
            return super().reduce(logits, v, sinks, case, q_len)
        self.fired()
        m = torch.full((hq, q_len), NEG_INF)
        total = torch.zeros(hq, q_len, dtype=low)
        acc = torch.zeros(q_len, hq, v.shape[2], dtype=low)
        for start in range(0, n, self.TILE):
            s = logits[..., start : start + self.TILE]  # [hq, q_len, tile]
            m_new = torch.maximum(m, s.amax(-1))
            shift = torch.where(torch.isfinite(m_new), m_new, torch.zeros_like(m_new))
            alpha = torch.exp(m - shift)  # [hq, q_len]; 0 while nothing was seen
            p = torch.exp(s - shift[..., None])
            total = (total.float() * alpha + p.sum(-1)).to(low)
            pv = torch.einsum("hqk,khd->qhd", p.to(low).float(), v[start : start + self.TILE])
            acc = (acc.float() * alpha.transpose(0, 1)[..., None] + pv).to(low)
            m = m_new
        o = self.normalize(acc.float(), total.float().transpose(0, 1))
        lse = torch.where(total > 0, m + torch.log(total.float()), NEG_INF)
        state = State(o, lse.transpose(0, 1))
        return state if sinks is None else merge(state, self.sink_state(sinks, state))


def merge_unguarded(a: State, b: State) -> State:
    """:func:`~.kernel.merge` without the empty-state guard: ``exp(-inf - -inf)`` is NaN
    when both states are empty."""
    m = torch.maximum(a.lse, b.lse)
    wa, wb = torch.exp(a.lse - m), torch.exp(b.lse - m)
    o = (a.o * wa[..., None] + b.o * wb[..., None]) / (wa + wb)[..., None]
    return State(o, m + torch.log(wa + wb))


class SplitKvEmptyMerge(PagedKernel):
    """Splits every sequence of a batch whose longest context exceeds 128 tokens into 4
    block-aligned key ranges and merges their states pairwise; a short sequence (or a
    large block) leaves the last two ranges empty, and merging two empty states gives
    NaN. Imitates flashinfer-ai/flashinfer#4051 ("cascade state merging returns NaN when
    all input states are empty")."""

    name = "fault-split-kv-empty-merge"
    imitates = "flashinfer-ai/flashinfer#4051"
    trigger = "a batch with a context > 128 tokens and a sequence short enough for two empty splits"
    SPLITS, MIN_KV_LEN = 4, 128

    def reduce(self, logits, v, sinks, case, q_len):
        n = logits.shape[2]
        if max(case.kv_lens) <= self.MIN_KV_LEN:
            return super().reduce(logits, v, sinks, case, q_len)
        size = round_up(math.ceil(n / self.SPLITS), case.block_size)
        states = [self.state(logits[..., a : a + size], v[a : a + size])
                  for a in range(0, self.SPLITS * size, size)]
        if 2 * size >= n:  # the right pair is empty
            self.fired()
        state = merge_unguarded(merge_unguarded(*states[:2]), merge_unguarded(*states[2:]))
        return state if sinks is None else merge(state, self.sink_state(sinks, state))


class Fp8ScalesIgnoredInPrefill(PagedKernel):
    """Dequantizes an fp8 cache without ``k_scale``/``v_scale`` on the prefill path
    (decode applies them). Imitates flashinfer-ai/flashinfer#1023 ("FP8 scaling factors
    (k_scale/v_scale) not taking effect in BatchPrefillWithPagedKVCacheWrapper")."""

    name = "fault-fp8-scales-ignored-in-prefill"
    imitates = "flashinfer-ai/flashinfer#1023"
    trigger = "an fp8 KV cache with a scale != 1 and a sequence with q_len > 1"

    def dequantize(self, x, scale, case, q_len):
        if case.kv_cache_dtype == "auto" or q_len == 1:
            return super().dequantize(x, scale, case, q_len)
        if scale != 1.0:
            self.fired()
        return x.float()


class KvLenZeroNan(PagedKernel):
    """Divides the accumulator by the softmax sum without a zero guard, so a sequence
    with no keys (kv_len 0: a CUDA-graph padding slot) comes out ``0 / 0 = NaN``.
    Imitates vllm-project/vllm#57017 (Triton decode attention's ``acc / e_sum`` on
    ``seq_lens=0`` pad rows; fixed in #57094)."""

    name = "fault-kv-len-zero-nan"
    imitates = "vllm-project/vllm#57017"
    trigger = "a sequence with kv_len 0"

    def normalize(self, acc, total):
        if bool((total == 0).any()):
            self.fired()
        return acc / total[..., None]


class MaskedTileMaxZero(PagedKernel):
    """Runs the online softmax over tiles of one block and, to keep ``exp(-inf - -inf)``
    from making NaN, replaces the max of a tile whose keys a row sees none of (a tile
    outside its sliding window or past its causal edge) by 0 instead of leaving the
    running max alone. Exact while the logits lie near 0; when every logit a row sees is
    far below 0 the running max is then 0, every weight underflows to 0 and the row comes
    out 0. Imitates the all-masked-row guard of flashinfer-ai/flashinfer#4401 (a masked
    row's max must not become a number the valid logits sit far below)."""

    name = "fault-masked-tile-max-zero"
    imitates = "flashinfer-ai/flashinfer#4401"
    trigger = "a tile of keys a row sees none of, with that row's logits far below 0"

    def reduce(self, logits, v, sinks, case, q_len):
        hq, q_len, n = logits.shape
        starts = range(0, n, case.block_size)
        dead = [~torch.isfinite(logits[..., s : s + case.block_size]).any(-1) for s in starts]
        live_row = torch.isfinite(logits).any(-1)  # [hq, q_len]
        if not any(bool((d & live_row).any()) for d in dead):
            return super().reduce(logits, v, sinks, case, q_len)
        self.fired()
        m = torch.full((hq, q_len), NEG_INF)
        total = torch.zeros(hq, q_len)
        acc = torch.zeros(q_len, hq, v.shape[-1])
        for s in starts:
            tile = logits[..., s : s + case.block_size]  # [hq, q_len, tile]
            tile_max = tile.amax(-1)
            tile_max = torch.where(torch.isfinite(tile_max), tile_max, 0.0)  # the fault
            new = torch.maximum(m, tile_max)
            alpha = torch.exp(m - new)  # 0 where m was -inf
            p = torch.exp(tile - new[..., None])
            total = total * alpha + p.sum(-1)
            acc = acc * alpha.T[..., None] + torch.einsum("hqk,khd->qhd", p,
                                                          v[s : s + case.block_size])
            m = new
        o = self.normalize(acc, total.T)
        lse = torch.where(total > 0, m + torch.log(total), NEG_INF).T  # [q_len, hq]
        state = State(o, lse)
        return state if sinks is None else merge(state, self.sink_state(sinks, state))


__all__ = ["Fp8ScalesIgnoredInPrefill", "KvLenZeroNan", "LowPrecisionAccumulator",
           "MaskedTileMaxZero", "QkReductionLowPrecision", "SplitKvEmptyMerge", "merge_unguarded"]
