"""Faults in what a query row sees and how its logits are formed: causal alignment,
sliding window, soft cap, ALiBi, sinks and masking sentinels.

Each class is :class:`~.kernel.PagedKernel` with one step replaced by the faulty one of
the public report its docstring cites; everywhere else it is the fault-free kernel.
"""

from __future__ import annotations

import torch

from .kernel import NEG_INF, PagedKernel, State


class CausalTopLeft(PagedKernel):
    """Aligns the causal mask of a prefill chunk top-left: query row ``i`` sees keys
    ``0..i`` instead of ``0..kv_len - q_len + i``, as FlashAttention before 2.1 did
    (decode rows are handled apart and stay right). Imitates Dao-AILab/flash-attention#951
    (2.1 changed the alignment; the old one is what a kernel written against 2.0 keeps)."""

    name = "fault-causal-top-left"
    imitates = "Dao-AILab/flash-attention#951"
    trigger = "a prefill chunk with 1 < q_len < kv_len"

    def visible(self, pos_q, pos_k, kv_len, case):
        q_len = pos_q.numel()
        if q_len == 1 or q_len == kv_len:
            return super().visible(pos_q, pos_k, kv_len, case)
        self.fired()
        return super().visible(pos_q - (kv_len - q_len), pos_k, kv_len, case)


class CausalOneAhead(PagedKernel):
    """Masks ``key > kv_len + q_idx - q_len`` one position too late, so every prefill row
    but the last also sees the next key. Imitates flashinfer-ai/flashinfer#348 (the
    prefill kernel and the CPU reference used ``>`` where ``>=`` was meant)."""

    name = "fault-causal-one-ahead"
    imitates = "flashinfer-ai/flashinfer#348"
    trigger = "a prefill chunk with q_len >= 2"

    def visible(self, pos_q, pos_k, kv_len, case):
        if pos_q.numel() < 2:
            return super().visible(pos_q, pos_k, kv_len, case)
        self.fired()
        return super().visible(pos_q + 1, pos_k, kv_len, case)


class SlidingWindowOneTooMany(PagedKernel):
    """Treats the window size ``W`` as the number of keys *before* the query (FlashAttention's
    ``window_size=(W, 0)``), so each row sees ``W + 1`` keys. Imitates
    vllm-project/vllm#3385 (a window of 2048 masks differently from Hugging Face's and
    FlashAttention's 2049)."""

    name = "fault-sliding-window-one-too-many"
    imitates = "vllm-project/vllm#3385"
    trigger = "a sliding window shorter than the keys before some query row"

    def visible(self, pos_q, pos_k, kv_len, case):
        window = case.sliding_window
        if window is None:
            return super().visible(pos_q, pos_k, kv_len, case)
        if int(pos_q.max()) >= window:
            self.fired()
        return super().visible(pos_q, pos_k, kv_len, case.with_(sliding_window=window + 1))


class WindowOnDecodeOnly(PagedKernel):
    """Applies the sliding window to decode rows only: a prefill chunk (several query
    rows) attends causally to every key before it, as a prefill path that takes a
    ``sliding_window`` argument and does not mask with it. Imitates
    vllm-project/vllm#4405 (the prefix-prefill Triton kernel that chunked prefill and
    prefix caching run did not apply the sliding window; the decode kernel did)."""

    name = "fault-window-on-decode-only"
    imitates = "vllm-project/vllm#4405"
    trigger = "a sliding window shorter than the keys before some row of a prefill chunk"

    def visible(self, pos_q, pos_k, kv_len, case):
        window = case.sliding_window
        if window is None or pos_q.numel() < 2:
            return super().visible(pos_q, pos_k, kv_len, case)
        if int(pos_q.max()) >= window:
            self.fired()
        return super().visible(pos_q, pos_k, kv_len, case.with_(sliding_window=None))


class SoftCapAfterMask(PagedKernel):
    """Applies the soft cap after masking, so a masked logit becomes ``-cap`` instead of
    staying ``-inf`` and masked keys get weight ``exp(-cap - max)``. Imitates
    flashinfer-ai/flashinfer#350 ("logits soft cap should be applied before masking", a
    fix to the decode kernel)."""

    name = "fault-soft-cap-after-mask"
    imitates = "flashinfer-ai/flashinfer#350"
    trigger = "a soft cap with keys masked (prefill rows, or a sliding window)"

    def logits(self, q, k, case, pos_q, pos_k, kv_len, alibi_slopes):
        if case.logits_soft_cap is None:
            return super().logits(q, k, case, pos_q, pos_k, kv_len, alibi_slopes)
        s = self.scores(q, k, case)
        if alibi_slopes is not None:
            s = s + self.alibi(alibi_slopes, pos_q, pos_k)
        seen = self.visible(pos_q, pos_k, kv_len, case)
        if not bool(seen.all()):
            self.fired()
        return self.soft_cap(s.masked_fill(~seen, NEG_INF), case)


class AlibiIgnored(PagedKernel):
    """Accepts ALiBi slopes and computes attention without them. Imitates
    vllm-project/vllm#57614 (ROCm Navi paged attention: "with alibi_slopes supplied, the
    output matches attention without ALiBi")."""

    name = "fault-alibi-ignored"
    imitates = "vllm-project/vllm#57614"
    trigger = "ALiBi"

    def alibi(self, slopes, pos_q, pos_k):
        self.fired()
        return torch.zeros(slopes.numel(), pos_q.numel(), pos_k.numel())


class AlibiFromChunkStart(PagedKernel):
    """Measures the ALiBi distance as ``|i - j|`` from the start of the query chunk
    instead of from the query's position in the sequence (``|i + kv_len - q_len - j|``),
    right only when the chunk is the whole sequence. Imitates
    Dao-AILab/flash-attention#907 (ALiBi outputs of ``flash_attn_with_kvcache`` differ
    from the varlen path's)."""

    name = "fault-alibi-from-chunk-start"
    imitates = "Dao-AILab/flash-attention#907"
    trigger = "ALiBi with fewer query rows than keys (decode, chunked prefill)"

    def alibi(self, slopes, pos_q, pos_k):
        offset = int(pos_q[0]) if pos_q.numel() else 0
        if offset:
            self.fired()
        distance = (pos_q[:, None] - offset - pos_k[None, :]).abs().float()  # [q_len, n]
        return -slopes.float()[:, None, None] * distance


class SinksIgnoredInPrefill(PagedKernel):
    """Drops the attention sinks of prefill sequences (decode rows keep them), as a
    prefill path that accepts a ``sinks`` argument and does not apply it. Imitates
    vllm-project/vllm#52148 (FlashInfer's FA2 prefill on SM12x ignored sinks while XQA
    decode applied them)."""

    name = "fault-sinks-ignored-in-prefill"
    imitates = "vllm-project/vllm#52148"
    trigger = "sinks on a sequence with q_len > 1"

    def reduce(self, logits, v, sinks, case, q_len):
        if sinks is not None and q_len > 1:
            self.fired()
            sinks = None
        return super().reduce(logits, v, sinks, case, q_len)


class FiniteMaskSentinel(PagedKernel):
    """Starts its running max at a finite sentinel of ``-5e4`` rather than ``-inf``: a
    row whose logits all lie far below it underflows to zero weight everywhere and comes
    out 0. Imitates flashinfer-ai/flashinfer#4450 ("classic paged decode returns zeros
    for valid finite logits below the -5e4 sentinel")."""

    name = "fault-finite-mask-sentinel"
    imitates = "flashinfer-ai/flashinfer#4450"
    trigger = "a query row whose largest logit is below about -5e4"
    SENTINEL = -5e4

    def state(self, logits, v):
        hq, q_len, n = logits.shape
        m = torch.full((hq, q_len, 1), self.SENTINEL)
        if n:
            m = torch.maximum(m, logits.amax(-1, keepdim=True))
        p = torch.exp(logits - m)  # [hq, q_len, n]
        total = p.sum(-1)
        if bool(((total == 0) & torch.isfinite(logits).any(-1)).any()):
            self.fired()
        acc = torch.einsum("hqk,khd->qhd", p, v)
        lse = torch.where(total > 0, m[..., 0] + torch.log(total), NEG_INF)
        return State(self.normalize(acc, total.transpose(0, 1)), lse.transpose(0, 1))


class FullyMaskedRowAverages(PagedKernel):
    """Masks with a finite ``-1e30`` instead of ``-inf``: a query row that sees no key at
    all (causal with q_len > kv_len) softmaxes the sentinels to a uniform average of the
    V it read instead of 0, and a finite log-sum-exp. Imitates
    flashinfer-ai/flashinfer#4452 ("paged causal prefill returns finite LSE for fully
    masked rows when qo_len > kv_len")."""

    name = "fault-fully-masked-row-averages"
    imitates = "flashinfer-ai/flashinfer#4452"
    trigger = "a query row that sees no key (causal, q_len > kv_len)"
    masked_logit = -1e30

    def state(self, logits, v):
        if logits.shape[2] and bool((logits.amax(-1) <= self.masked_logit).any()):
            self.fired()
        return super().state(logits, v)


__all__ = ["AlibiFromChunkStart", "AlibiIgnored", "CausalOneAhead", "CausalTopLeft",
           "FiniteMaskSentinel", "FullyMaskedRowAverages",
           "SinksIgnoredInPrefill", "SlidingWindowOneTooMany", "SoftCapAfterMask",
           "WindowOnDecodeOnly"]
