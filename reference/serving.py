"""The serving loop's reference: one persistent pool driven by the allocator through what an
engine does to it, and the logical K/V of every sequence at every step.

:class:`ServingModel` owns a :class:`~.allocator.BlockAllocator` (prefix caching on, a host
pool for swaps) and the token ids of every request. Each event (:meth:`~ServingModel.admit`,
:meth:`~ServingModel.step`, :meth:`~ServingModel.fork`, :meth:`~ServingModel.finish`,
:meth:`~ServingModel.preempt`, :meth:`~ServingModel.swap_out`,
:meth:`~ServingModel.swap_in`) changes the allocator and returns a :class:`Tick`: the block
copies an engine makes first, the new tokens' K/V it writes at their slots, and, for a
step, the batch a kernel then attends over. Blocks a finished request freed are handed out
again with its K/V still in them; nothing here clears a block.

A token's K and V are a function of its prefix (:func:`token_keys`, :func:`token_kv`), as a
model's are, so two requests sharing a prompt prefix have the same K/V there and a prefix-
cache hit is exact; a block reached another way holds other values.

The pool a loop allocates has block 0 for table padding (never handed out), the
allocator's ``num_blocks`` blocks after it, and spare blocks so that every batch's case
validates as if no block were shared (:attr:`ServingModel.pool_blocks`). The truth of a
step is :meth:`ServingModel.truth_inputs`: the same problem laid out compactly from the
logical K/V, never read back from the pool an implementation wrote.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import torch

from .allocator import BlockAllocator, BlockCopy, CopyKind, OutOfBlocksError
from .case import PagedCase
from .errors import PagedValueError
from .inputs import SINK_HIGH, SINK_LOW, PagedInputs, alibi_slopes
from .writes import draw_kv, outlier_gain, write_slots

#: Block 0 of a loop's pool: where table padding points (poisoned, never allocated).
PADDING_BLOCK = 0
#: Token ids are drawn below this (small, so prompts share prefixes when asked to).
VOCAB = 1000
#: Seed offsets of a loop's draws: K/V channel gains, sinks, each step's queries.
_GAIN, _SINKS, _QUERIES = 1, 2, 3
#: Tokens' K/V kept in this process (a token's are drawn once however often it is
#: written, read back for a truth, or replayed).
TOKENS_KEPT = 8192
_TOKENS: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def token_keys(token_ids: Sequence[int], previous: int = 0) -> list[int]:
    """The key of each position: BLAKE2b of the previous key and the token id, 63 bits.
    A position's key depends on its whole prefix (``previous``: the key before the first
    id, 0 at a sequence's start)."""
    keys = []
    for token in token_ids:
        digest = hashlib.blake2b(f"{previous}:{int(token)}".encode(), digest_size=8).digest()
        previous = int.from_bytes(digest, "little") >> 1
        keys.append(previous)
    return keys


def token_kv(keys: Sequence[int], template: PagedCase) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V (float32, before they are stored) of the tokens with ``keys``, each drawn
    from its own key with the template's magnitudes, outlier channels (fixed per loop) and
    MLA latent V.

    Returns
    -------
    tuple of Tensor[n, num_kv_heads, head_dim] and Tensor[n, num_kv_heads, v_head_dim]
    """
    gain = outlier_gain(template.num_kv_heads, template.head_dim,
                        torch.Generator().manual_seed(template.seed + _GAIN))
    shape = (template.num_kv_heads, template.head_dim, template.v_head_dim,
             template.qk_magnitude, template.v_magnitude, template.latent_cache, template.seed)
    ks, vs = [], []
    for key in keys:
        found = _TOKENS.get((shape, key))
        if found is None:
            found = _TOKENS[shape, key] = draw_kv(
                1, template.num_kv_heads, template.head_dim, template.v_head_dim,
                torch.Generator().manual_seed(key), qk_magnitude=template.qk_magnitude,
                v_magnitude=template.v_magnitude, channel_gain=gain,
                latent=template.latent_cache)
            if len(_TOKENS) > TOKENS_KEPT:
                _TOKENS.pop(next(iter(_TOKENS)))
        ks.append(found[0])
        vs.append(found[1])
    empty_k = torch.empty(0, template.num_kv_heads, template.head_dim)
    empty_v = torch.empty(0, template.num_kv_heads, template.v_head_dim)
    return (torch.cat(ks) if ks else empty_k), (torch.cat(vs) if vs else empty_v)


def step_queries(template: PagedCase, total_q: int, seed: int) -> torch.Tensor:
    """The queries of one step, ``Tensor[total_q, num_q_heads, head_dim]`` in the case
    dtype, drawn from ``seed``."""
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(total_q, template.num_q_heads, template.head_dim,
                    generator=generator) * template.qk_magnitude
    limit = torch.finfo(template.torch_dtype).max
    return q.clamp(-limit, limit).to(template.torch_dtype)


def loop_sinks(template: PagedCase) -> torch.Tensor | None:
    """The loop's sink logits, ``Tensor[num_q_heads]`` float32 (None without sinks)."""
    if not template.sinks:
        return None
    generator = torch.Generator().manual_seed(template.seed + _SINKS)
    return SINK_LOW + (SINK_HIGH - SINK_LOW) * torch.rand(template.num_q_heads,
                                                          generator=generator)


@dataclass(frozen=True)
class Batch:
    """One forward pass: the sequences scheduled (in row order), then ``pad`` empty rows.

    Attributes
    ----------
    seqs : tuple
        Sequence ids of the real rows.
    q_lens, kv_lens : tuple[int, ...]
        Per row (padding rows: 1 and 0), ``[batch]``.
    block_tables : tuple[tuple[int, ...], ...]
        Physical blocks of each row, padded to :attr:`ServingModel.table_columns` with
        :data:`PADDING_BLOCK`.
    q_seed : int
        Seeds the step's queries (:func:`step_queries`).
    prefill : tuple[bool, ...]
        Per real row: whether it computes prompt tokens (else it decodes).
    index : int
        The step's number in the loop (0 first).
    """

    index: int
    seqs: tuple[Hashable, ...]
    q_lens: tuple[int, ...]
    kv_lens: tuple[int, ...]
    block_tables: tuple[tuple[int, ...], ...]
    q_seed: int
    prefill: tuple[bool, ...]

    @property
    def pad(self) -> int:
        return len(self.q_lens) - len(self.seqs)


@dataclass(frozen=True)
class Tick:
    """What an engine does to its pool for one event, in order: the block ``copies``
    (device block ids are physical; host ids the host pool's), the new tokens' K/V at
    ``slots`` (physical ``block * block_size + offset``, one per ``keys``), then the
    ``batch`` it attends over (None for an event with no forward pass)."""

    copies: tuple[BlockCopy, ...] = ()
    slots: tuple[int, ...] = ()
    keys: tuple[int, ...] = ()
    batch: Batch | None = None

    @property
    def empty(self) -> bool:
        return not self.copies and not self.slots and self.batch is None


@dataclass
class _Request:
    tokens: list[int]
    keys: list[int]
    computed: int = 0  # leading tokens whose K/V are in the pool (committed)
    on_device: bool = False
    swapped: bool = False
    prefix_hit: int = 0  # tokens served by the prefix cache at its last admission


class ServingModel:
    """The reference side of a serving loop (see the module docstring).

    Parameters
    ----------
    template : PagedCase
        The loop's fixed axes (heads, head dims, block size, dtypes, scales, features,
        seed); its lengths are ignored.
    num_blocks : int
        Blocks the allocator hands out (>= 2).
    max_batch, max_tokens : int
        The most rows a step has and tokens a sequence holds (they size the pool's spare
        blocks and the block tables' columns).
    num_host_blocks : int
        The host pool's blocks, for swaps.

    Raises
    ------
    PagedValueError
        On sizes out of range.
    """

    def __init__(self, template: PagedCase, num_blocks: int, *, max_batch: int,
                 max_tokens: int, num_host_blocks: int = 8) -> None:
        for name, value, least in (("num_blocks", num_blocks, 2), ("max_batch", max_batch, 1),
                                   ("max_tokens", max_tokens, 1)):
            if not isinstance(value, int) or value < least:
                raise PagedValueError(name, value, f"an int >= {least}")
        self.template = template
        self.block_size = template.block_size
        self.table_columns = math.ceil(max_tokens / self.block_size)
        self.max_batch, self.max_tokens = max_batch, max_tokens
        self.pool_blocks = 1 + max(num_blocks, max_batch * self.table_columns)
        self.allocator = BlockAllocator(num_blocks, self.block_size, seed=template.seed,
                                        enable_prefix_caching=True,
                                        num_host_blocks=num_host_blocks)
        self.num_host_blocks = num_host_blocks
        self.requests: dict[Hashable, _Request] = {}
        self.steps = 0
        self._copies: list[BlockCopy] = []  # handed out, applied at the next tick

    # Queries -------------------------------------------------------------------------
    def physical(self, block: int) -> int:
        """The pool's block for the allocator's ``block``."""
        return block + 1

    def table(self, seq: Hashable) -> tuple[int, ...]:
        """``seq``'s physical blocks padded to :attr:`table_columns`."""
        blocks = [self.physical(b) for b in self.allocator.block_table(seq)]
        return tuple(blocks + [PADDING_BLOCK] * (self.table_columns - len(blocks)))

    def pending_prompt(self, seq: Hashable) -> int:
        """Tokens of ``seq`` on device whose K/V are still to be computed (its prompt's
        rest, after an admission)."""
        request = self.requests[seq]
        return request.on_device * (len(request.tokens) - request.computed)

    def decoding(self) -> list[Hashable]:
        """Sequences on device with nothing left to prefill."""
        return [s for s, r in self.requests.items() if r.on_device and not self.pending_prompt(s)]

    def prefilling(self) -> list[Hashable]:
        """Sequences on device with prompt tokens still to compute."""
        return [s for s, r in self.requests.items() if r.on_device and self.pending_prompt(s)]

    # Events ---------------------------------------------------------------------------
    def admit(self, seq: Hashable, prompt: Sequence[int]) -> Tick:
        """Admit ``seq`` with ``prompt`` (token ids; a preempted request comes back with
        every token it had): its prompt's blocks allocated, the cached prefix shared. The
        tick holds only the copies pending from earlier events.

        Raises
        ------
        PagedValueError
            If ``seq`` is on device or swapped out, or ``prompt`` is empty or too long.
        OutOfBlocksError
            If the pool cannot hold the prompt (nothing changes).
        """
        known = self.requests.get(seq)
        if known is not None and (known.on_device or known.swapped):
            raise PagedValueError("seq", seq, "a sequence not on device nor swapped out")
        if not 0 < len(prompt) <= self.max_tokens:
            raise PagedValueError("prompt", len(prompt), f"1..{self.max_tokens} tokens")
        tokens = [int(t) for t in prompt]
        hits = self.allocator.add_sequence(seq, tokens)
        self.requests[seq] = _Request(tokens, token_keys(tokens), computed=hits, on_device=True,
                                      prefix_hit=hits)
        return Tick(copies=self._take_copies())

    def step(self, rows: Sequence[tuple[Hashable, int]], *, pad: int = 0,
             decode_tokens: dict[Hashable, Sequence[int]] | None = None) -> Tick:
        """One forward pass over ``rows`` (sequence, tokens): a sequence with prompt left
        computes that many of its prompt tokens (chunked prefill); any other appends that
        many new tokens (``decode_tokens[seq]``, else drawn from the loop's seed) and
        attends with them (1: decode; 2-4: speculative or multi-token decode). ``pad``
        empty rows follow (``kv_len`` 0), as an engine pads a batch to a captured size.

        Raises
        ------
        PagedValueError
            If a row's sequence is not on device, its count is out of range, a sequence
            appears twice, or the batch exceeds ``max_batch``.
        OutOfBlocksError
            If the pool cannot hold the new tokens (nothing changes).
        """
        seqs = [seq for seq, _ in rows]
        if len(set(seqs)) != len(seqs) or not 0 < len(rows) + pad <= self.max_batch:
            raise PagedValueError("rows", seqs, f"distinct sequences, at most {self.max_batch} "
                                  "rows with the padding")
        plans = []
        for seq, count in rows:
            request = self.requests.get(seq)
            if request is None or not request.on_device:
                raise PagedValueError("rows", seq, "sequences on device")
            pending = self.pending_prompt(seq)
            most = pending if pending else self.max_tokens - len(request.tokens)
            if not 0 < count <= most:
                raise PagedValueError(f"rows[{seq!r}]", count, f"1..{most} tokens")
            plans.append((seq, count, bool(pending)))
        need = sum(self.allocator.blocks_needed(seq, n) for seq, n, prefill in plans
                   if not prefill)
        if need > self.allocator.num_free_blocks:  # all or nothing, as each append is
            raise OutOfBlocksError(f"a step of {len(plans)} sequences", need,
                                   self.allocator.num_free_blocks, self.allocator.num_blocks)
        slots, keys, q_lens, kv_lens, prefill_rows = [], [], [], [], []
        for seq, count, prefill in plans:
            request = self.requests[seq]
            start = request.computed
            if prefill:
                table = self.allocator.block_table(seq)
                new_slots = [self.physical(table[p // self.block_size]) * self.block_size
                             + p % self.block_size for p in range(start, start + count)]
            else:
                ids = list((decode_tokens or {}).get(seq) or self._drawn_tokens(seq, count))
                new_slots = [s + self.block_size for s in self.allocator.append_tokens(seq, ids)]
                request.keys += token_keys(ids, request.keys[-1] if request.keys else 0)
                request.tokens += ids
            slots += new_slots
            keys += request.keys[start : start + count]
            q_lens.append(count)
            kv_lens.append(start + count)
            prefill_rows.append(prefill)
        batch = Batch(
            index=self.steps, seqs=tuple(seqs), q_lens=tuple(q_lens) + (1,) * pad,
            kv_lens=tuple(kv_lens) + (0,) * pad,
            block_tables=tuple(self.table(s) for s in seqs)
            + ((PADDING_BLOCK,) * self.table_columns,) * pad,
            q_seed=(self.template.seed * 1_000_003 + _QUERIES + self.steps) % 2**31,
            prefill=tuple(prefill_rows))
        self.steps += 1
        return Tick(copies=self._take_copies(), slots=tuple(slots), keys=tuple(keys),
                    batch=batch)

    def done(self, tick: Tick) -> None:
        """The tick was carried out: its copies are done and its batch's tokens written."""
        self.allocator.copy_done([c for c in tick.copies
                                  if c in self.allocator.pending_copies()])
        if tick.batch is not None:
            for seq, kv_len in zip(tick.batch.seqs, tick.batch.kv_lens):
                self.requests[seq].computed = kv_len
                self.allocator.commit(seq, kv_len)

    def fork(self, parent: Hashable, child: Hashable) -> Tick:
        """``child`` shares every block of ``parent`` (parallel sampling, beam search); the
        first append to a shared, partly filled block copies it (copy-on-write)."""
        request = self.requests.get(parent)
        if request is None or not request.on_device or self.pending_prompt(parent):
            raise PagedValueError("parent", parent, "a sequence on device, its prompt computed")
        if child in self.requests:
            raise PagedValueError("child", child, "a new sequence id")
        self.allocator.fork(parent, child)
        self.requests[child] = _Request(list(request.tokens), list(request.keys),
                                        computed=request.computed, on_device=True)
        return Tick(copies=self._take_copies())

    def finish(self, seq: Hashable) -> Tick:
        """``seq`` is done: its blocks go back to the free queue with its K/V in them."""
        request = self.requests.pop(seq, None)
        if request is None or not (request.on_device or request.swapped):
            raise PagedValueError("seq", seq, "a sequence on device or swapped out")
        self.allocator.free(seq)
        return Tick(copies=self._take_copies())

    def preempt(self, seq: Hashable) -> tuple[Tick, list[int]]:
        """Preempt ``seq`` by recomputation: its blocks are freed; the tick, and the token
        ids to re-admit it with (:meth:`admit`)."""
        request = self.requests.get(seq)
        if request is None or not request.on_device or self.pending_prompt(seq):
            raise PagedValueError("seq", seq, "a sequence on device, its prompt computed")
        self.allocator.preempt(seq)
        request.on_device = False
        return Tick(copies=self._take_copies()), list(request.tokens)

    def swap_out(self, seq: Hashable) -> Tick:
        """Move ``seq``'s blocks to the host pool (the tick copies them)."""
        request = self.requests.get(seq)
        if request is None or not request.on_device or self.pending_prompt(seq):
            raise PagedValueError("seq", seq, "a sequence on device, its prompt computed")
        self._copies += self.allocator.swap_out(seq)
        request.on_device, request.swapped = False, True
        return Tick(copies=self._take_copies())

    def swap_in(self, seq: Hashable) -> Tick:
        """Bring a swapped-out ``seq`` back into new device blocks (the tick copies them)."""
        request = self.requests.get(seq)
        if request is None or not request.swapped:
            raise PagedValueError("seq", seq, "a swapped-out sequence")
        self._copies += self.allocator.swap_in(seq)
        request.on_device, request.swapped = True, False
        return Tick(copies=self._take_copies())

    # Truth ----------------------------------------------------------------------------
    def step_case(self, batch: Batch) -> PagedCase:
        """The case of ``batch``: the template's axes, its lengths, the loop's pool."""
        return self.template.with_(kv_lens=batch.kv_lens, q_lens=batch.q_lens,
                                   num_blocks=self.pool_blocks, shared_blocks=None,
                                   min_block_id=0, tag=f"loop-step{batch.index}")

    def truth_inputs(self, batch: Batch) -> PagedInputs:
        """The problem ``batch`` poses, laid out compactly from each sequence's logical K/V
        (its tokens' keys up to its ``kv_len``), with the step's queries: what its truth
        is computed from (before the next event changes the sequences)."""
        case = self.template.with_(kv_lens=batch.kv_lens, q_lens=batch.q_lens,
                                   num_blocks=None, shared_blocks=None, min_block_id=0,
                                   layout="contiguous", tag="loop-truth")
        return logical_inputs(case, step_queries(self.template, case.total_q, batch.q_seed),
                              [self.requests[s].keys[:n] for s, n in zip(batch.seqs, batch.kv_lens)]
                              + [[]] * batch.pad)

    # Internals ------------------------------------------------------------------------
    def _take_copies(self) -> tuple[BlockCopy, ...]:
        """The copies handed out since the last tick (copy-on-write from appends, swaps),
        with device ids made physical."""
        found = self._copies + self.allocator.pop_copies()
        self._copies = []
        return tuple(found)

    def _drawn_tokens(self, seq: Hashable, count: int) -> list[int]:
        """``count`` token ids ``seq`` generates next: from its id, length and last key, so
        that forks of one sequence diverge."""
        request = self.requests[seq]
        name = int.from_bytes(hashlib.blake2b(repr(seq).encode(), digest_size=7).digest(),
                              "little")
        base = token_keys([name, len(request.tokens)], request.keys[-1] if request.keys else 0)[-1]
        return [(base >> (10 * i)) % VOCAB for i in range(count)]


def physical_copy(copy: BlockCopy) -> tuple[str, int, int]:
    """``(kind, src, dst)`` of a copy in the pool's ids (device ids shifted past block 0;
    host ids as they are)."""
    src = copy.src + 1 if copy.kind in (CopyKind.COPY_ON_WRITE, CopyKind.SWAP_OUT) else copy.src
    dst = copy.dst + 1 if copy.kind in (CopyKind.COPY_ON_WRITE, CopyKind.SWAP_IN) else copy.dst
    return copy.kind.value, src, dst


def logical_inputs(case: PagedCase, q: torch.Tensor,
                   keys: Sequence[Sequence[int]]) -> PagedInputs:
    """``case``'s canonical inputs with queries ``q`` and sequence ``i``'s K/V the tokens
    with ``keys[i]`` (:func:`token_kv`, stored by the cache's rule), each sequence in
    blocks of its own from block 1 on (block 0 pads the tables; every unused slot NaN)."""
    bs = case.block_size
    cache = torch.full((case.pool_blocks, 2, bs, case.num_kv_heads, case.cache_head_dim),
                       float("nan"), dtype=case.kv_torch_dtype)
    tables = torch.zeros(case.batch_size, case.max_blocks_per_seq, dtype=torch.int32)
    next_block, slot_mapping = 1, []
    for i, seq_keys in enumerate(keys):
        blocks = list(range(next_block, next_block + math.ceil(len(seq_keys) / bs)))
        next_block += len(blocks)
        tables[i, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        slots = [blocks[t // bs] * bs + t % bs for t in range(len(seq_keys))]
        slot_mapping += slots
        k, v = token_kv(seq_keys, case)
        write_slots(cache, torch.tensor(slots, dtype=torch.int64), k, v, case.k_scale,
                    case.v_scale)
    cu = torch.zeros(case.batch_size + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(case.q_lens_or_decode, dtype=torch.int32), 0)
    return PagedInputs(
        case=case, q=q, kv_cache=cache, block_tables=tables,
        kv_lens=torch.tensor(case.kv_lens, dtype=torch.int32), cu_seqlens_q=cu,
        slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64), padding_block=0,
        alibi_slopes=alibi_slopes(case.num_q_heads) if case.alibi else None,
        sinks=loop_sinks(case))


__all__ = ["PADDING_BLOCK", "VOCAB", "Batch", "ServingModel", "Tick", "logical_inputs",
           "loop_sinks", "physical_copy", "step_queries", "token_keys", "token_kv"]
