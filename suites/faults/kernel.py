"""The catalogue's fault-free kernel: paged attention in plain PyTorch, step by step.

:class:`PagedKernel` computes what every paged kernel computes, in the steps kernels
split it into, so that each fault of the catalogue overrides exactly one step: read the
query rows, choose the token positions to read, look their blocks up in the block table,
gather and dequantize K and V, map query heads to KV heads, form the logits (scale, soft
cap, ALiBi, mask), and reduce them with V into attention states that are merged (sinks,
split-KV). The math runs in float32 and the output is rounded once to the case dtype
(docs/tolerance.md: the ``round_once`` calibration variant), so it passes the suite.

A fault calls :meth:`PagedKernel.fired` when it takes its faulty branch; with
``PAGEDBENCH_FAULT_LOG`` set, the first firing appends the implementation's name to that
file, which is how ``pagedbench selftest`` tells a fault the suite never exercised from
one it exercised and missed.
"""

from __future__ import annotations

import functools
import math
import os
from typing import ClassVar

import torch

from pagedbench.adapters.base import (FEATURES, Adapter, Availability, Capabilities,
                                      Prepared)
from pagedbench.reference import PagedCase, PagedInputs
from pagedbench.reference.axes import KV_CACHE_DTYPES, LAYOUTS

#: Every feature but a V head dim of its own (the steps read K and V at ``head_dim``;
#: no fault of the catalogue is about MLA), the degenerate rows included (kv_len 0,
#: q_len 0 and rows that see no key give 0: :meth:`PagedKernel.state`). It indexes q and
#: the cache through their strides, so every input layout; it returns its own output,
#: so no output buffer to stride. One sequence at a time in float32: batch invariant.
CAPABILITIES = Capabilities(
    devices=frozenset({"cpu", "cuda"}),
    dtypes=frozenset({"float32", "float16", "bfloat16"}),
    modes=frozenset({"decode", "prefill"}),
    features=FEATURES - {"head_dim_v"},
    kv_cache_dtypes=frozenset(KV_CACHE_DTYPES),
    layouts=frozenset(LAYOUTS) - {"strided_out"},
    batch_invariant=True,
    kv_cache_in_place=True,
    plan_reuse=True,
    returns_lse=True,
    notes={"features": "reads K and V at head_dim (no head_dim_v)",
           "layouts": "returns its own output tensor"},
)
#: Environment variable naming the file a fault appends its name to when it first fires.
FAULT_LOG = "PAGEDBENCH_FAULT_LOG"
NEG_INF = float("-inf")


class State:
    """An attention state over some keys: the normalized output ``o`` (``Tensor[q_len,
    num_q_heads, head_dim]``, float32) and the log-sum-exp of its logits ``lse``
    (``Tensor[q_len, num_q_heads]``, float32; ``-inf`` over no key), as split-KV kernels
    and FlashInfer's ``merge_state`` carry them."""

    def __init__(self, o: torch.Tensor, lse: torch.Tensor) -> None:
        self.o, self.lse = o, lse


def merge(a: State, b: State) -> State:
    """The state over the keys of ``a`` and ``b`` (FlashInfer's ``merge_state``), with
    the union of two empty states empty (zero output, ``-inf``)."""
    m = torch.maximum(a.lse, b.lse)  # [q_len, hq]
    shift = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    wa, wb = torch.exp(a.lse - shift), torch.exp(b.lse - shift)  # 0 for empty states
    total = wa + wb
    safe = torch.where(total > 0, total, torch.ones_like(total))
    o = (a.o * wa[..., None] + b.o * wb[..., None]) / safe[..., None]
    return State(o, torch.where(total > 0, shift + torch.log(safe), m))


class PagedKernel(Adapter):
    """Correct paged attention, every step overridable (see the module docstring).

    Class attributes describe a fault for ``pagedbench selftest``: ``imitates`` (the
    public report, ``owner/repo#N``), ``trigger`` (the inputs on which it is wrong) and
    ``trigger_batch`` (the fewest sequences those need).
    """

    name = "catalogue-control"
    description = "the fault catalogue's correct kernel (float32 math, rounded once)"
    imitates: ClassVar[str] = ""
    trigger: ClassVar[str] = ""
    #: Whether the fault lives in state kept across calls of one pool (only a serving
    #: loop, one pool for many calls, can meet it).
    keeps_state: ClassVar[bool] = False
    #: Whether the fault leaves the output exact everywhere (only what it returns beside
    #: it, the log-sum-exp, is wrong).
    output_exact: ClassVar[bool] = False
    #: The fewest sequences of a batch on which the fault can be wrong (the self-test
    #: bounds a fault's shrunk case by it).
    trigger_batch: ClassVar[int] = 1
    #: Logit given to a masked key.
    masked_logit: ClassVar[float] = NEG_INF

    def capabilities(self, device: str) -> Capabilities:
        return CAPABILITIES

    def available(self, device: str = "cpu") -> Availability:
        return Availability(True, version="catalogue", details={
            "imitates": self.imitates, "trigger": self.trigger, "keeps_state": self.keeps_state})

    def prepare(self, inputs: PagedInputs) -> Prepared:
        """Bind the inputs (read at each call: a refreshed plan sees their new values) and
        an LSE buffer; every step runs in the call."""
        case = inputs.case
        lse = torch.full((case.total_q, case.num_q_heads), float("nan"), device=inputs.device)
        return Prepared(functools.partial(self.attend_with_lse, inputs, lse), lse=lse)

    def attend_with_lse(self, inputs: PagedInputs, lse: torch.Tensor) -> torch.Tensor:
        """:meth:`attend`, then each row's log-sum-exp into ``lse`` (``[total_q,
        num_q_heads]``, float32) from :meth:`sequence_state`."""
        out = self.attend(inputs)
        cu = inputs.cu_seqlens_q.tolist()
        for i, kv_len in enumerate(inputs.kv_lens.tolist()):
            q = self.queries(inputs, cu[i], cu[i + 1]).float()
            lse[cu[i] : cu[i + 1]] = self.row_lse(self.sequence_state(inputs, i, q, kv_len))
        return out

    def fired(self) -> None:
        """Record that this fault took its faulty branch (once per process)."""
        log = os.environ.get(FAULT_LOG)
        if log and not getattr(self, "_logged", False):
            self._logged = True
            with open(log, "a") as f:
                f.write(f"{self.name}\n")

    # The steps, in order ------------------------------------------------------------
    def attend(self, inputs: PagedInputs) -> torch.Tensor:
        """``Tensor[total_q, num_q_heads, head_dim]`` in the case dtype, sequence by
        sequence."""
        case = inputs.case
        cu = inputs.cu_seqlens_q.tolist()
        out = torch.empty(case.total_q, case.num_q_heads, case.head_dim,
                          dtype=case.torch_dtype, device=inputs.device)
        for i, kv_len in enumerate(inputs.kv_lens.tolist()):
            q = self.queries(inputs, cu[i], cu[i + 1]).float()  # [q_len, hq, d]
            out[cu[i] : cu[i + 1]] = self.sequence(inputs, i, q, kv_len).to(case.torch_dtype)
        return out

    def queries(self, inputs: PagedInputs, start: int, stop: int) -> torch.Tensor:
        """Query rows ``start:stop`` of ``inputs.q``, ``[q_len, num_q_heads, head_dim]``."""
        return inputs.q[start:stop]

    def sequence(self, inputs: PagedInputs, i: int, q: torch.Tensor,
                 kv_len: int) -> torch.Tensor:
        """Attention of sequence ``i`` (``q``: ``[q_len, hq, d]`` float32) over its
        ``kv_len`` keys: ``[q_len, hq, d]`` float32."""
        return self.sequence_state(inputs, i, q, kv_len).o

    def sequence_state(self, inputs: PagedInputs, i: int, q: torch.Tensor,
                       kv_len: int) -> State:
        """The attention state of sequence ``i`` (its output and log-sum-exp)."""
        case = inputs.case
        q_len = q.shape[0]
        pos_k = self.positions(kv_len, case.block_size, q_len)  # [n] tokens read
        k, v = self.gather(inputs, i, pos_k, q_len)  # [n, hkv, d] float32 each
        heads = self.kv_heads(case.num_q_heads, case.num_kv_heads)  # [hq]
        k, v = k[:, heads], v[:, heads]  # [n, hq, d]
        pos_q = torch.arange(kv_len - q_len, kv_len, device=q.device)  # [q_len]
        logits = self.logits(q, k, case, pos_q, pos_k, kv_len, inputs.alibi_slopes)
        return self.reduce(logits, v, inputs.sinks, case, q_len)

    def row_lse(self, state: State) -> torch.Tensor:
        """The log-sum-exp a caller gets, ``[q_len, hq]`` float32: natural log."""
        return state.lse

    def positions(self, kv_len: int, block_size: int, q_len: int) -> torch.Tensor:
        """Token positions whose K and V are read, ``[n]`` int64: the live ones."""
        return torch.arange(kv_len)

    def block_table(self, inputs: PagedInputs, i: int) -> torch.Tensor:
        """Row ``i`` of the block table, ``[max_blocks_per_seq]`` int64."""
        return inputs.block_tables[i].long()

    def block_ids(self, table: torch.Tensor, pos_k: torch.Tensor,
                  block_size: int) -> torch.Tensor:
        """Physical block of each position, ``[n]`` int64."""
        return table[pos_k // block_size]

    def gather(self, inputs: PagedInputs, i: int, pos_k: torch.Tensor,
               q_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V at ``pos_k`` through the block table, dequantized to float32, ``[n,
        num_kv_heads, head_dim]`` each."""
        case = inputs.case
        blocks = self.block_ids(self.block_table(inputs, i), pos_k, case.block_size)
        offsets = pos_k % case.block_size
        k = inputs.kv_cache[blocks, 0, offsets]  # [n, hkv, d]
        v = inputs.kv_cache[blocks, 1, offsets]
        return (self.dequantize(k, case.k_scale, case, q_len),
                self.dequantize(v, case.v_scale, case, q_len))

    def dequantize(self, x: torch.Tensor, scale: float, case: PagedCase,
                   q_len: int) -> torch.Tensor:
        """Cache values as float32: ``stored * scale`` for an fp8 cache."""
        if case.kv_cache_dtype == "auto":
            return x.float()
        return x.float() * scale

    def kv_heads(self, num_q_heads: int, num_kv_heads: int) -> torch.Tensor:
        """KV head of each query head, ``[num_q_heads]`` int64: ``h // group size``."""
        return torch.arange(num_q_heads) // (num_q_heads // num_kv_heads)

    def logits(self, q: torch.Tensor, k: torch.Tensor, case: PagedCase,
               pos_q: torch.Tensor, pos_k: torch.Tensor, kv_len: int,
               alibi_slopes: torch.Tensor | None) -> torch.Tensor:
        """Scaled, soft-capped, ALiBi-biased and masked logits, ``[hq, q_len, n]``."""
        s = self.soft_cap(self.scores(q, k, case), case)
        if alibi_slopes is not None:
            s = s + self.alibi(alibi_slopes, pos_q, pos_k)
        return s.masked_fill(~self.visible(pos_q, pos_k, kv_len, case), self.masked_logit)

    def scores(self, q: torch.Tensor, k: torch.Tensor, case: PagedCase) -> torch.Tensor:
        """``scale * q . k`` in float32, ``[hq, q_len, n]``."""
        return torch.einsum("qhd,khd->hqk", q, k) * case.scale

    def soft_cap(self, s: torch.Tensor, case: PagedCase) -> torch.Tensor:
        """``c * tanh(s / c)`` when the case sets a soft cap ``c``."""
        cap = case.logits_soft_cap
        return s if cap is None else cap * torch.tanh(s / cap)

    def alibi(self, slopes: torch.Tensor, pos_q: torch.Tensor,
              pos_k: torch.Tensor) -> torch.Tensor:
        """ALiBi bias ``-slope[h] * (query position - key position)``, ``[hq, q_len, n]``."""
        distance = (pos_q[:, None] - pos_k[None, :]).float()  # [q_len, n]
        return -slopes.float()[:, None, None] * distance

    def visible(self, pos_q: torch.Tensor, pos_k: torch.Tensor, kv_len: int,
                case: PagedCase) -> torch.Tensor:
        """Which keys each query row sees, ``[q_len, n]`` bool: live, causal (aligned
        bottom-right) and inside the sliding window."""
        seen = (pos_k[None, :] <= pos_q[:, None]) & (pos_k[None, :] < kv_len)
        if case.sliding_window is not None:
            seen &= pos_k[None, :] > pos_q[:, None] - case.sliding_window
        return seen

    def reduce(self, logits: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None,
               case: PagedCase, q_len: int) -> State:
        """The state over all keys (``logits``: ``[hq, q_len, n]``, ``v``: ``[n, hq,
        d]``), merged with the sink's (no value) when the case has sinks."""
        state = self.state(logits, v)
        return state if sinks is None else merge(state, self.sink_state(sinks, state))

    def state(self, logits: torch.Tensor, v: torch.Tensor) -> State:
        """Softmax of ``logits`` applied to ``v`` as a :class:`State`; rows that see no
        key give output 0 and ``lse`` ``-inf``."""
        hq, q_len = logits.shape[:2]
        if logits.shape[2] == 0:
            m = torch.full((hq, q_len, 1), NEG_INF)
        else:
            m = logits.amax(-1, keepdim=True)  # [hq, q_len, 1]
        shift = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        p = torch.exp(logits - shift)  # [hq, q_len, n]
        total = p.sum(-1)  # [hq, q_len]
        acc = torch.einsum("hqk,khd->qhd", p, v)  # [q_len, hq, d]
        o = self.normalize(acc, total.transpose(0, 1))
        lse = torch.where(total > 0, shift[..., 0] + torch.log(total), NEG_INF)
        return State(o, lse.transpose(0, 1))

    def normalize(self, acc: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
        """``acc / total`` (``[q_len, hq, d]`` by ``[q_len, hq]``), 0 where no key was
        seen."""
        safe = torch.where(total > 0, total, torch.ones_like(total))
        return acc / safe[..., None]

    @staticmethod
    def sink_state(sinks: torch.Tensor, like: State) -> State:
        """The state of the sink logits alone: no value, ``lse`` = the sink."""
        lse = sinks.float()[None, :].expand_as(like.lse)  # [q_len, hq]
        return State(torch.zeros_like(like.o), lse)


def round_up(n: int, multiple: int) -> int:
    """The smallest multiple of ``multiple`` >= ``n``."""
    return math.ceil(n / multiple) * multiple


__all__ = ["CAPABILITIES", "FAULT_LOG", "PagedKernel", "State", "merge", "round_up"]
