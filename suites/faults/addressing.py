"""Faults in how a kernel finds its keys: which slots it reads, how it walks the block
table, which KV head a query head reads, how it reads its query rows, and where it keeps
what it found per block and per sequence.

Each class is :class:`~.kernel.PagedKernel` with one step replaced by the faulty one of
the public report its docstring cites; everywhere else it is the fault-free kernel.
"""

from __future__ import annotations

import torch

from pagedbench.reference import PagedInputs

from .kernel import PagedKernel, round_up


class NanTailTimesZero(PagedKernel):
    """Reads whole blocks and masks the slots past ``kv_len`` only in the logits, so the
    zero probabilities still multiply the tail's V: ``0 * NaN = NaN`` when the tail holds
    NaN (stale or never-written memory), while it declares ``nan_safe_tail=True``.
    Imitates vllm-project/vllm#641 (fixed by zeroing V past the context in #936)."""

    name = "fault-nan-tail-times-zero"
    imitates = "vllm-project/vllm#641"
    trigger = "a partly filled last block whose unused V slots hold NaN"

    def positions(self, kv_len: int, block_size: int, q_len: int) -> torch.Tensor:
        if kv_len % block_size:
            self.fired()
        return torch.arange(round_up(kv_len, block_size))


class LastBlockUnmasked(PagedKernel):
    """A decode row attends to every slot of the blocks it reads: no upper mask at
    ``kv_len``, so the unused slots of a partly filled last block join the softmax
    (prefill rows are still masked causally). Imitates pytorch/pytorch#160861
    (FlexAttention's paged decode applied no ``kv_len`` mask, fixes #159247)."""

    name = "fault-last-block-unmasked"
    imitates = "pytorch/pytorch#160861"
    trigger = "a decode sequence whose kv_len is not a multiple of block_size"

    def positions(self, kv_len: int, block_size: int, q_len: int) -> torch.Tensor:
        if q_len == 1 and kv_len % block_size:
            self.fired()
        return torch.arange(round_up(kv_len, block_size))

    def visible(self, pos_q, pos_k, kv_len, case):
        if pos_q.numel() == 1:  # decode: every slot read is taken
            return torch.ones(1, pos_k.numel(), dtype=torch.bool)
        return super().visible(pos_q, pos_k, kv_len, case)


class ShortSequenceZeros(PagedKernel):
    """A sequence after the first whose whole context fits in one partly filled block
    comes out all zeros (its work item is scheduled from the previous sequence's page
    count). Imitates flashinfer-ai/flashinfer#725 ("the second output state is all
    zeros" for sequences shorter than a page)."""

    name = "fault-short-sequence-zeros"
    imitates = "flashinfer-ai/flashinfer#725"
    trigger = "a sequence other than the first with kv_len < block_size"

    def sequence(self, inputs: PagedInputs, i: int, q: torch.Tensor,
                 kv_len: int) -> torch.Tensor:
        if i > 0 and 0 < kv_len < inputs.case.block_size:
            self.fired()
            return torch.zeros_like(q)
        return super().sequence(inputs, i, q, kv_len)


class BlockSizeAssumed16(PagedKernel):
    """Computes a token's slot as ``table[t // 16] * block_size + t % 16`` whatever the
    block size, i.e. a launcher specialised for 16-token blocks that accepts others.
    Imitates vllm-project/vllm#57614 (ROCm Navi paged attention silently accepts
    block_size 32 and is wrong from the 17th token on)."""

    name = "fault-block-size-assumed-16"
    imitates = "vllm-project/vllm#57614"
    trigger = "block_size != 16 with more tokens than min(block_size, 16)"
    ASSUMED = 16

    def gather(self, inputs, i, pos_k, q_len):
        case = inputs.case
        bs = case.block_size
        if bs == self.ASSUMED:
            return super().gather(inputs, i, pos_k, q_len)
        if pos_k.numel() > min(bs, self.ASSUMED):
            self.fired()
        table = self.block_table(inputs, i)
        index = (pos_k // self.ASSUMED).clamp(max=table.numel() - 1)
        slot = table[index] * bs + pos_k % self.ASSUMED  # [n], over the flat pool
        slot = slot.clamp(0, inputs.kv_cache.shape[0] * bs - 1)
        flat = inputs.kv_cache.transpose(1, 2).reshape(-1, 2, case.num_kv_heads,
                                                       case.head_dim)  # [nb * bs, 2, hkv, d]
        k, v = flat[slot, 0], flat[slot, 1]
        return (self.dequantize(k, case.k_scale, case, q_len),
                self.dequantize(v, case.v_scale, case, q_len))


class BlockIds16Bit(PagedKernel):
    """Holds block ids in 16 bits: an id of 32768 or more wraps negative and reads a
    block counted from the end of the pool. Imitates the narrow page-index arithmetic of
    flashinfer-ai/flashinfer#3130 (MLA decode returns zeros once page ids are large: the
    page offset was computed in 32 bits, fixed in #3136), at the width a CPU test can
    reach."""

    name = "fault-block-ids-16-bit"
    imitates = "flashinfer-ai/flashinfer#3130"
    trigger = "a block id >= 32768"

    def block_table(self, inputs: PagedInputs, i: int) -> torch.Tensor:
        table = super().block_table(inputs, i)
        if bool((table >= 2**15).any()):
            self.fired()
        return table.to(torch.int16).long()


class StaleBlockTable(PagedKernel):
    """Plans once per case and keeps the block table it saw then: a second call on the
    same case after its blocks moved (a swap-in, a prefix-cache hit on other blocks)
    reads the old physical blocks. Imitates flashinfer-ai/flashinfer#3509 (the wrapper's
    ``run()`` silently replaces what the call is given with the state saved at plan
    time)."""

    name = "fault-stale-block-table"
    imitates = "flashinfer-ai/flashinfer#3509"
    trigger = "the same case run again with its blocks at other physical places"

    def __init__(self) -> None:
        self._plans: dict[object, torch.Tensor] = {}

    def block_table(self, inputs: PagedInputs, i: int) -> torch.Tensor:
        planned = self._plans.setdefault(inputs.case, inputs.block_tables.clone())
        if not torch.equal(planned, inputs.block_tables):
            self.fired()
        return planned[i].long()


class GqaHeadTileBleed(PagedKernel):
    """Processes query heads in tiles of 4 and gives each tile the KV head of its first
    head; when the group size exceeds the tile and is not a multiple of it, a tile spans
    two groups and its later heads read the wrong KV head. Imitates the head mapping
    flagged in vllm-project/vllm#40792 (review: CTAs "bleed" across KV-head boundaries
    when the group size exceeds BLOCK_H and is not a multiple of it)."""

    name = "fault-gqa-head-tile-bleed"
    imitates = "vllm-project/vllm#40792"
    trigger = "a GQA group size > 4 that is not a multiple of 4, with >= 2 KV heads"
    TILE = 4

    def kv_heads(self, num_q_heads: int, num_kv_heads: int) -> torch.Tensor:
        group = num_q_heads // num_kv_heads
        tile = self.TILE if group > self.TILE else group
        first = torch.arange(num_q_heads) // tile * tile  # first head of each head's tile
        heads = first // group
        if not torch.equal(heads, super().kv_heads(num_q_heads, num_kv_heads)):
            self.fired()
        return heads


class NonContiguousQuery(PagedKernel):
    """Reads the query rows as if ``q`` were contiguous (row stride ``num_q_heads *
    head_dim``), ignoring the strides of a view such as a slice of a fused QKV
    projection. Imitates Dao-AILab/flash-attention#2670 (a forward kernel hardcoded
    contiguous strides and scrambled non-contiguous inputs)."""

    name = "fault-non-contiguous-query"
    imitates = "Dao-AILab/flash-attention#2670"
    trigger = "q given as a non-contiguous view"

    def queries(self, inputs: PagedInputs, start: int, stop: int) -> torch.Tensor:
        q = inputs.q
        if q.is_contiguous():
            return q[start:stop]
        self.fired()
        _, hq, d = q.shape
        dense = torch.as_strided(q, q.shape, (hq * d, d, 1), q.storage_offset())
        return dense[start:stop]


class BlockKeyedScratch(PagedKernel):
    """Keeps each block's logits in scratch keyed by the physical block id (and the
    query row, counted from the last), written for every sequence first and read back
    for the softmax, as a split-KV kernel sizes its workspace per block: right while
    every block belongs to one sequence, wrong when tables share a block (prefix
    caching, a beam fork), where the sequence written last overwrites the others'
    logits. Imitates kekzl/imp#1189 (per-block state kept in a pool indexed by block id,
    read back at that id for a block that is not the one it was written for)."""

    name = "fault-block-keyed-scratch"
    imitates = "kekzl/imp#1189"
    trigger = "block tables that share a physical block"

    def attend(self, inputs):
        case = inputs.case
        cu = inputs.cu_seqlens_q.tolist()
        scratch = {}  # block id -> (sequence, logits [hq, q_len, slots]), rows from the last
        written = []
        for i, kv_len in enumerate(inputs.kv_lens.tolist()):
            q = self.queries(inputs, cu[i], cu[i + 1]).float()  # [q_len, hq, d]
            q_len = q.shape[0]
            pos_k = self.positions(kv_len, case.block_size, q_len)
            k, v = self.gather(inputs, i, pos_k, q_len)
            heads = self.kv_heads(case.num_q_heads, case.num_kv_heads)
            k, v = k[:, heads], v[:, heads]
            pos_q = torch.arange(kv_len - q_len, kv_len)
            logits = self.logits(q, k, case, pos_q, pos_k, kv_len, inputs.alibi_slopes)
            blocks = self.block_ids(self.block_table(inputs, i), pos_k, case.block_size)
            for block in blocks.unique().tolist():
                scratch[block] = (i, logits[:, :, blocks == block])
            written.append((blocks, logits, v))
        out = torch.empty(case.total_q, case.num_q_heads, case.head_dim,
                          dtype=case.torch_dtype, device=inputs.device)
        for i, (blocks, logits, v) in enumerate(written):
            q_len = logits.shape[1]
            for block in blocks.unique().tolist():
                owner, saved = scratch[block]
                cols = blocks == block
                rows = min(q_len, saved.shape[1])
                if owner != i and rows and saved.shape[-1] == int(cols.sum()):
                    self.fired()
                    logits[:, q_len - rows :, cols] = saved[:, saved.shape[1] - rows :]
            state = self.reduce(logits, v, inputs.sinks, case, q_len)
            out[cu[i] : cu[i + 1]] = state.o.to(case.torch_dtype)
        return out


class PerSequenceStateIn16(PagedKernel):
    """Keeps each sequence's output in a table of 16 slots, the sequence's number modulo
    16, written for the whole batch first and read back after, as a kernel sizes its
    per-sequence scratch (work list, split plan, partial results) for a fixed batch:
    right up to 16 sequences; from a 17th on, each sequence overwrites the slot of the one
    16 before it, whose output is then the later one's (its last rows, zeros before
    where that one had fewer). Imitates gittensor-ai-lab/sparkinfer#21 (a decode
    runner's scratch buffers sized for ``max_batch`` sequences, silently overrun by a
    larger batch), at 16 slots so that a CPU test reaches it."""

    name = "fault-per-sequence-state-16"
    imitates = "gittensor-ai-lab/sparkinfer#21"
    trigger = "a batch of 17 sequences or more"
    trigger_batch = 17
    SLOTS = 16

    def attend(self, inputs: PagedInputs) -> torch.Tensor:
        case = inputs.case
        cu = inputs.cu_seqlens_q.tolist()
        batch = len(cu) - 1
        slots: list[torch.Tensor] = []  # [q_len, hq, d] float32 each
        for i, kv_len in enumerate(inputs.kv_lens.tolist()):
            q = self.queries(inputs, cu[i], cu[i + 1]).float()  # [q_len, hq, d]
            state = self.sequence(inputs, i, q, kv_len)
            if i < self.SLOTS:
                slots.append(state)
            else:
                slots[i % self.SLOTS] = state
        if batch > self.SLOTS:
            self.fired()
        out = torch.empty(case.total_q, case.num_q_heads, case.head_dim,
                          dtype=case.torch_dtype, device=inputs.device)
        for i in range(batch):
            q_len, saved = cu[i + 1] - cu[i], slots[i % self.SLOTS]
            rows = saved[saved.shape[0] - min(q_len, saved.shape[0]):]  # its last rows
            missing = q_len - rows.shape[0]
            if missing:
                rows = torch.cat([rows.new_zeros(missing, *rows.shape[1:]), rows])
            out[cu[i] : cu[i + 1]] = rows.to(case.torch_dtype)
        return out


__all__ = ["BlockIds16Bit", "BlockKeyedScratch", "BlockSizeAssumed16", "GqaHeadTileBleed",
           "LastBlockUnmasked", "NanTailTimesZero", "NonContiguousQuery", "PerSequenceStateIn16",
           "ShortSequenceZeros", "StaleBlockTable"]
