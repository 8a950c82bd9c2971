"""Faults in what a kernel keeps beside its pool from one call to the next, and in the paths
a serving engine takes that a fresh call does not: a plan or a captured graph replayed on
new metadata, per-block state outliving the block's owner, a prefix-cache hit, a
multi-token decode, a returned log-sum-exp.

The first four keep state across calls of one pool, keyed by that pool (as an engine's
caches live with its KV cache): a fresh pool per call, as the per-call conformance suite
makes, never meets them; the serving loop (``suites/serving``) must. Each class is
:class:`~.kernel.PagedKernel` with one step replaced by the faulty one of the public report
its docstring cites.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import replace
from typing import Any

import torch

from pagedbench.adapters.base import Prepared
from pagedbench.reference import PagedInputs

from .kernel import PagedKernel


class PoolState:
    """State a kernel keeps per pool, as an engine's caches live with its KV cache: one
    dict per pool tensor, dropped when the tensor is (so a fresh pool starts empty)."""

    def __init__(self) -> None:
        self._by_pool: dict[int, dict[Any, Any]] = {}

    def of(self, inputs: PagedInputs) -> dict[Any, Any]:
        pool = inputs.kv_cache
        if id(pool) not in self._by_pool:
            self._by_pool[id(pool)] = {}
            weakref.finalize(pool, self._by_pool.pop, id(pool), None)
        return self._by_pool[id(pool)]


class BlockKeyedDerivedCache(PagedKernel):
    """Keeps each full block's K and V, dequantized to float32, in a cache keyed by (pool,
    physical block), and never invalidates an entry: right while a full block keeps its
    owner, wrong once a finished request's block is handed out again and rewritten. Imitates
    sgl-project/sglang#26019's class of state not refreshed across replays (per-block
    metadata cached beside the pool, stale once the block is reused)."""

    name = "fault-block-keyed-derived-cache"
    imitates = "sgl-project/sglang#26019"
    trigger = "a freed block rewritten for another request in the same pool"
    keeps_state = True

    def __init__(self) -> None:
        self._blocks = PoolState()

    def gather(self, inputs, i, pos_k, q_len):
        case = inputs.case
        bs, table = case.block_size, self.block_table(inputs, i)
        full = len(pos_k) // bs
        blocks = self._blocks.of(inputs)
        ks, vs = [], []
        for j in range(full):
            block = int(table[j])
            fresh = (self.dequantize(inputs.kv_cache[block, 0].clone(), case.k_scale, case, q_len),
                     self.dequantize(inputs.kv_cache[block, 1].clone(), case.v_scale, case, q_len))
            cached = blocks.setdefault(block, fresh)
            if not torch.equal(cached[0], fresh[0]):
                self.fired()
            ks.append(cached[0])
            vs.append(cached[1])
        rest = pos_k[full * bs:]
        k, v = super().gather(inputs, i, rest, q_len) if len(rest) else (None, None)
        ks += [k] if k is not None else []
        vs += [v] if v is not None else []
        if not ks:
            return super().gather(inputs, i, pos_k, q_len)
        return torch.cat(ks), torch.cat(vs)


class PlanKeyedByPageCount(PagedKernel):
    """Plans each batch's key ranges once per (pool, batch size, pages used) and reuses
    the plan whenever that key comes back: a decode step that stays inside every
    sequence's last block has the same key and reads the previous step's lengths, missing
    the token just written. Imitates flashinfer-ai/flashinfer#4014 (a plan cache whose key
    left out what changed between calls, replayed silently)."""

    name = "fault-plan-keyed-by-page-count"
    imitates = "flashinfer-ai/flashinfer#4014"
    trigger = "a step whose batch and page counts equal an earlier step's of the same pool"
    keeps_state = True

    def __init__(self) -> None:
        self._plans = PoolState()

    def attend(self, inputs):
        kv_lens = inputs.kv_lens.tolist()
        bs = inputs.case.block_size
        key = (len(kv_lens), *(math.ceil(n / bs) for n in kv_lens))
        planned = self._plans.of(inputs).setdefault(key, kv_lens)
        if planned != kv_lens:
            self.fired()
        return super().attend(_with_lengths(inputs, planned))


class GraphTableNotRefilled(PagedKernel):
    """A captured graph: ``prepare`` copies the block table into the graph's own buffer,
    and a replay (``refresh``) leaves it as captured, so every later step of that batch
    shape reads the first step's blocks. Imitates sgl-project/sglang#26019 (the page table
    not populated at CUDA-graph replay)."""

    name = "fault-graph-table-not-refilled"
    imitates = "sgl-project/sglang#26019"
    trigger = "a replayed plan whose batch's blocks changed since its capture"
    keeps_state = True

    def prepare(self, inputs):
        captured = inputs.block_tables.clone()
        staged = _with_tables(inputs, captured)
        return super().prepare(staged)

    def refresh(self, prepared: Prepared, inputs: PagedInputs) -> Prepared:
        self.fired()
        return prepared  # the captured table stays as it was


class SkippedRowsKeepOutput(PagedKernel):
    """Writes its output into a buffer kept per (pool, batch shape), as a captured graph
    does, and skips the rows of sequences with no keys, trusting the buffer's zeros: a
    padding row holds whatever the sequence in that row wrote the step before. Imitates
    vllm-project/vllm#57017's class (kv_len-0 padding rows of a captured batch left as
    they were)."""

    name = "fault-skipped-rows-keep-output"
    imitates = "vllm-project/vllm#57017"
    trigger = "a padding row (kv_len 0) that held a sequence at an earlier step of that shape"
    keeps_state = True

    def __init__(self) -> None:
        self._outputs = PoolState()

    def attend(self, inputs):
        case = inputs.case
        key = (case.batch_size, case.total_q)
        out = self._outputs.of(inputs).setdefault(key, torch.zeros(
            case.total_q, case.num_q_heads, case.head_dim, dtype=case.torch_dtype))
        cu = inputs.cu_seqlens_q.tolist()
        for i, kv_len in enumerate(inputs.kv_lens.tolist()):
            if kv_len == 0:
                if out[cu[i] : cu[i + 1]].any():
                    self.fired()
                continue
            q = self.queries(inputs, cu[i], cu[i + 1]).float()
            out[cu[i] : cu[i + 1]] = self.sequence(inputs, i, q, kv_len).to(case.torch_dtype)
        return out.clone()


class PrefixPathDropsFp8Scales(PagedKernel):
    """On a row that extends a sequence past keys it did not compute in this call (a
    cached prefix, or earlier chunks), dequantizes those keys' fp8 values without
    ``k_scale``/``v_scale``; the keys the call's own rows bring keep them. Right for a first
    prefill, wrong for every prefix-cache hit. Imitates sgl-project/sglang#18904 (the
    prefix-cache path dropped k_scale/v_scale)."""

    name = "fault-prefix-path-drops-fp8-scales"
    imitates = "sgl-project/sglang#18904"
    trigger = "an fp8 cache with scales != 1 and a prefill row after a cached prefix"

    def gather(self, inputs, i, pos_k, q_len):
        case = inputs.case
        k, v = super().gather(inputs, i, pos_k, q_len)
        kv_len = int(inputs.kv_lens[i])
        prefix = pos_k < kv_len - q_len  # keys this call's rows did not bring
        if case.kv_cache_dtype == "auto" or q_len <= 1 or not bool(prefix.any()):
            return k, v
        self.fired()
        k, v = k.clone(), v.clone()
        k[prefix] /= case.k_scale
        v[prefix] /= case.v_scale
        return k, v


class MultiTokenDecodeTableByRow(PagedKernel):
    """Indexes the block table by query row instead of by sequence for a batch of
    decodes of several tokens each (speculative verification), so sequence ``i`` reads the
    table of row ``cu_seqlens_q[i]``. Imitates vllm-project/vllm#51848 (multi-token decode
    indexing the block table by query row)."""

    name = "fault-multi-token-decode-table-by-row"
    imitates = "vllm-project/vllm#51848"
    trigger = "two or more sequences, one with 2 to 4 query tokens after the first"

    def block_table(self, inputs, i):
        q_lens = (inputs.cu_seqlens_q[1:] - inputs.cu_seqlens_q[:-1]).tolist()
        if not 1 < max(q_lens) <= 4:
            return super().block_table(inputs, i)
        row = int(inputs.cu_seqlens_q[i])
        if row != i and row < inputs.block_tables.shape[0]:
            self.fired()
            return inputs.block_tables[row].long()
        return super().block_table(inputs, i)


class LseBaseTwo(PagedKernel):
    """Returns the log-sum-exp in base 2 (``log2(sum(2^x))`` of logits scaled by
    ``log2 e``, an exp2 fast path), where the contract is the natural log, so a caller
    merging partial states weights them wrongly. The output is right. Imitates
    lightseekorg/tokenspeed#571 (base-2 LSE stored against a natural-log contract;
    FlashInfer's base-2 LSE fed to a natural-log merge: sgl-project/sglang#40903)."""

    name = "fault-lse-base-two"
    imitates = "lightseekorg/tokenspeed#571"
    trigger = "any row that sees a key, its log-sum-exp judged"
    output_exact = True

    def row_lse(self, state):
        self.fired()
        return state.lse / math.log(2.0)


def _with_lengths(inputs: PagedInputs, kv_lens: list[int]) -> PagedInputs:
    """``inputs`` whose ``kv_lens`` tensor holds ``kv_lens`` (same case)."""
    return replace(inputs, kv_lens=torch.tensor(kv_lens, dtype=torch.int32,
                                                 device=inputs.device))


def _with_tables(inputs: PagedInputs, block_tables: torch.Tensor) -> PagedInputs:
    """``inputs`` reading ``block_tables`` instead of its own."""
    return replace(inputs, block_tables=block_tables)


__all__ = ["BlockKeyedDerivedCache", "GraphTableNotRefilled", "LseBaseTwo",
           "MultiTokenDecodeTableByRow", "PlanKeyedByPageCount", "PrefixPathDropsFp8Scales",
           "PoolState", "SkippedRowsKeepOutput"]
