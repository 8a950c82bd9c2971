"""The reference block allocator: one pool of fixed-size blocks and a table per sequence.

This is the memory model of paged attention (Kwon et al., "Efficient Memory Management
for Large Language Model Serving with PagedAttention", SOSP 2023, section 4): the KV cache
is cut into ``num_blocks`` blocks of ``block_size`` token slots; each sequence owns an
ordered list of blocks (its block table); a block is taken only when the sequence's last
block is full; blocks are reference-counted so that forked sequences (parallel sampling,
beam search) share them, and a shared, partially filled block is copied before it is
written (copy-on-write, section 4.4). Preemption frees a sequence for recomputation
(section 4.5) or swaps its blocks to a host pool and back. Host-only Python ints, no torch,
so stateful tests run in milliseconds. The pool, its eviction order and the prefix cache
are :mod:`~pagedbench.reference.block_pool`.

Data in flight is explicit. The caller reserves slots (:meth:`BlockAllocator.add_sequence`,
:meth:`~BlockAllocator.append_tokens`), writes K/V there, then says so with
:meth:`~BlockAllocator.commit`; every copy the allocator asks for (a :class:`BlockCopy`:
copy-on-write, swap out, swap in) is pending until :meth:`~BlockAllocator.copy_done`.
With prefix caching (vLLM's automatic prefix caching, ``docs/design/prefix_caching.md``)
a sequence's full blocks become matchable in table order, each once it is committed and
no copy into it is pending, so no request can hit K/V that is not written yet. A block
that a pending copy reads or writes is pinned: it is neither reused nor evicted, even
when no table holds it any more, until the copy is done.

:meth:`BlockAllocator.check_invariants` recomputes the whole state from the tables for the
tests to call after every step. (This file is long on purpose: one class whose public
methods' docstrings are its specification, and the checker beside the state it checks.)
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field

from .errors import PagedTypeError, PagedValueError, is_integer
from .block_pool import (
    ROOT_HASH,
    AllocatorInvariantError,
    BlockCopy,
    BlockPool,
    CopyKind,
    HostPool,
    OutOfBlocksError,
    chain_hash,
    invariant,
)

__all__ = [
    "AllocatorInvariantError",
    "AllocatorUsage",
    "BlockAllocator",
    "BlockCopy",
    "CopyKind",
    "OutOfBlocksError",
    "chain_hash",
]

_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


@dataclass(frozen=True)
class AllocatorUsage:
    """Memory accounting of the device pool at one moment.

    Every block is exactly one of used, in flight, free or cached, so
    ``blocks_used + blocks_in_flight + blocks_free + blocks_cached == num_blocks``.

    Attributes
    ----------
    num_blocks : int
        Blocks in the pool.
    blocks_used : int
        Blocks referenced by at least one sequence (shared blocks count once).
    blocks_free : int
        Unreferenced blocks holding nothing reusable.
    blocks_cached : int
        Unreferenced full blocks kept for prefix caching; reusable by a request with the
        same prefix until evicted, and allocatable (evicted) like a free block.
    tokens_stored : int
        Token slots holding a token in used blocks (a shared block counts once).
    slots_allocated : int
        ``blocks_used * block_size``.
    fragmentation_slots : int
        Internal fragmentation: ``slots_allocated - tokens_stored``, the allocated slots
        that hold no token (the unfilled tail of each partially filled block).
    host_blocks_used : int
        Host (swap) pool blocks held by swapped-out sequences or pinned by a pending copy.
    blocks_in_flight : int
        Unreferenced blocks that a pending copy pins (not allocatable until it is done).
    """

    num_blocks: int
    blocks_used: int
    blocks_free: int
    blocks_cached: int
    tokens_stored: int
    slots_allocated: int
    fragmentation_slots: int
    host_blocks_used: int
    blocks_in_flight: int


@dataclass
class _SequenceState:
    """One sequence's allocator state."""

    blocks: list[int] = field(default_factory=list)  # device block table; empty if swapped
    num_tokens: int = 0
    num_committed: int = 0  # leading tokens whose K/V the caller has written
    # Chained keys of the leading full blocks whose token ids are all known (kept only
    # with prefix caching), and how many of those blocks are registered in the cache.
    hashes: list[bytes] = field(default_factory=list)
    num_registered: int = 0
    host_blocks: list[int] | None = None  # host block table while swapped out


class BlockAllocator:
    """A pool of ``num_blocks`` KV blocks with on-demand, all-or-nothing allocation.

    Parameters
    ----------
    num_blocks : int
        Blocks in the device pool, >= 1. Block ids are ``0 .. num_blocks - 1``.
    block_size : int
        Token slots per block, >= 1. Slot ``s`` of block ``b`` is physical slot
        ``b * block_size + s`` (vLLM's ``slot_mapping`` convention).
    seed : int or None
        Seeds the shuffle of the initial free list; ``None`` keeps ascending order.
    enable_prefix_caching : bool
        Share full, committed blocks between sequences with the same prefix.
    num_host_blocks : int or None
        Blocks in the host pool that :meth:`swap_out` copies to; ``None`` means
        ``num_blocks``. May be 0 (swapping then always fails).

    Raises
    ------
    PagedValueError
        If ``num_blocks`` or ``block_size`` is not an int >= 1, or ``num_host_blocks``
        is not None or an int >= 0.

    Notes
    -----
    Sequence ids are any hashable values; a method given an id that is not a known
    sequence (never added, or already freed) raises ``KeyError`` naming it. Every mutation
    either completes or raises before changing anything.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        seed: int | None = 0,
        enable_prefix_caching: bool = False,
        num_host_blocks: int | None = None,
    ) -> None:
        for name, value in (("num_blocks", num_blocks), ("block_size", block_size)):
            if not is_integer(value) or value < 1:
                raise PagedValueError(name, value, "an int >= 1")
        if num_host_blocks is None:
            num_host_blocks = num_blocks
        if not is_integer(num_host_blocks) or num_host_blocks < 0:
            raise PagedValueError("num_host_blocks", num_host_blocks, "None or an int >= 0")
        self.num_blocks = int(num_blocks)
        self.block_size = int(block_size)
        self.enable_prefix_caching = bool(enable_prefix_caching)
        self.num_host_blocks = int(num_host_blocks)
        self._pool = BlockPool(self.num_blocks, self.block_size, seed, self.enable_prefix_caching)

        self._host = HostPool(self.num_host_blocks)

        self._seqs: dict[Hashable, _SequenceState] = {}
        self._copies: list[BlockCopy] = []  # copy-on-write copies not yet popped
        self._pending: dict[BlockCopy, Hashable] = {}  # pending copy -> its sequence's id
        self._filling: set[int] = set()  # device blocks a pending copy writes

    # Queries ------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take now: free plus evictable cached blocks."""
        return self._pool.num_free

    def block_table(self, seq_id: Hashable) -> list[int]:
        """The physical block ids of ``seq_id``, in logical order (a copy; empty while
        the sequence is swapped out).
        """
        return list(self._seq(seq_id).blocks)

    def num_tokens(self, seq_id: Hashable) -> int:
        """Tokens ``seq_id`` holds (on device, or on host while swapped out).
        """
        return self._seq(seq_id).num_tokens

    def num_committed(self, seq_id: Hashable) -> int:
        """Leading tokens of ``seq_id`` whose K/V are written (see :meth:`commit`).
        """
        return self._seq(seq_id).num_committed

    def __contains__(self, seq_id: Hashable) -> bool:
        """Whether ``seq_id`` is a known sequence (on device or swapped out), in O(1)."""
        return seq_id in self._seqs

    def sequences(self) -> list[Hashable]:
        """Ids of all known sequences (on device or swapped out), in insertion order."""
        return list(self._seqs)

    def is_swapped_out(self, seq_id: Hashable) -> bool:
        """Whether ``seq_id`` is in the host pool.
        """
        return self._seq(seq_id).host_blocks is not None

    def blocks_needed(self, seq_id: Hashable, num_new_tokens: int) -> int:
        """Free blocks an append of ``num_new_tokens`` to ``seq_id`` would take.

        Counts new blocks for the overflow past the last block, plus one when the last
        block is shared and partially filled (it is copied before the write).

        Raises
        ------
        PagedValueError
            If ``num_new_tokens`` < 0 or the sequence is swapped out.
        """
        seq = self._on_device(seq_id)
        if not is_integer(num_new_tokens) or num_new_tokens < 0:
            raise PagedValueError("num_new_tokens", num_new_tokens, "an int >= 0")
        copy_on_write = num_new_tokens > 0 and self._last_block_shared_partial(seq)
        return self._blocks_needed(seq, num_new_tokens, copy_on_write)

    def can_append(self, seq_id: Hashable, num_new_tokens: int) -> bool:
        """Whether :meth:`append_tokens` of ``num_new_tokens`` would succeed now."""
        return self.blocks_needed(seq_id, num_new_tokens) <= self._pool.num_free

    def blocks_needed_for_prompt(self, token_ids: Sequence[int]) -> int:
        """Free blocks :meth:`add_sequence` with this prompt would take now.

        That is the prompt's blocks less its prefix-cache hits on blocks outside the free
        queue (a hit on a free cached block still takes it out of the queue).

        Raises
        ------
        PagedValueError
            If a token id is not an int64.
        """
        return self._plan_prompt(_check_token_ids(token_ids))[1]

    def prefix_hit(self, token_ids: Sequence[int]) -> int:
        """Prompt tokens :meth:`add_sequence` with this prompt would serve from the prefix
        cache now (a multiple of ``block_size``; 0 without prefix caching).

        Raises
        ------
        PagedValueError
            If a token id is not an int64.
        """
        return len(self._pool.match_prefix(_check_token_ids(token_ids))) * self.block_size

    def usage(self) -> AllocatorUsage:
        """Memory accounting now (see :class:`AllocatorUsage`)."""
        pool = self._pool
        slots = pool.blocks_used * self.block_size
        return AllocatorUsage(
            num_blocks=self.num_blocks,
            blocks_used=pool.blocks_used,
            blocks_free=pool.num_free - pool.blocks_cached,
            blocks_cached=pool.blocks_cached,
            tokens_stored=pool.tokens_stored,
            slots_allocated=slots,
            fragmentation_slots=slots - pool.tokens_stored,
            host_blocks_used=self.num_host_blocks - self._host.num_free,
            blocks_in_flight=pool.blocks_in_flight,
        )

    def cached_blocks(self) -> dict[int, bytes]:
        """Blocks filed in the prefix cache now, with their keys (a copy): one that leaves
        it without being freed was evicted."""
        return {b: key for b, key in enumerate(self._pool.block_hash) if key is not None}

    def pop_copies(self) -> list[BlockCopy]:
        """Copy-on-write copies made since the last call.

        The caller copies the K/V of ``src`` into ``dst`` before the new tokens at the
        slots the append returned are read, then reports it with :meth:`copy_done`.
        """
        copies, self._copies = self._copies, []
        return copies

    def pending_copies(self) -> list[BlockCopy]:
        """Every copy handed out and not yet reported done, oldest first."""
        return list(self._pending)

    # Mutations ----------------------------------------------------------------------------
    def add_sequence(self, seq_id: Hashable, token_ids: Sequence[int] = ()) -> int:
        """Start a sequence and allocate its prompt's blocks, all or nothing.

        With prefix caching, the longest run of leading full blocks already cached is
        shared instead of allocated, capped so that at least one prompt token is left to
        compute (a prompt that is a whole number of cached blocks recomputes its last
        block: vLLM's ``max_cache_hit_length = num_tokens - 1``, ``kv_cache_manager.py``).
        Of several blocks cached under one key, the one registered first is shared.

        Parameters
        ----------
        seq_id : Hashable
            A new id.
        token_ids : Sequence[int]
            The prompt's token ids (int64 range), ``[prompt_len]``; may be empty.

        Returns
        -------
        int
            Prompt tokens served from the prefix cache (a multiple of ``block_size``;
            they count as committed). The caller computes K/V for the rest, writes them at
            ``block_table(seq_id)[pos // block_size] * block_size + pos % block_size`` and
            calls :meth:`commit`.

        Raises
        ------
        PagedValueError
            If ``seq_id`` is already known, or a token id is not an int64.
        PagedTypeError
            If ``token_ids`` is not a sequence.
        OutOfBlocksError
            If the pool cannot hold the prompt; nothing is allocated.
        """
        if seq_id in self._seqs:
            raise PagedValueError("seq_id", seq_id, "an id not in use",
                                  f"sequence {seq_id!r} already exists")
        ids = _check_token_ids(token_ids)
        hits, need = self._plan_prompt(ids)
        if need > self._pool.num_free:
            action = f"adding sequence {seq_id!r} with a {len(ids)}-token prompt"
            raise self._out_of_blocks(action, need)
        seq = _SequenceState()
        for block in hits:
            self._pool.acquire(block)
            seq.blocks.append(block)
            seq.hashes.append(self._pool.block_hash[block])
        seq.num_tokens = seq.num_committed = len(hits) * self.block_size
        seq.num_registered = len(hits)
        self._seqs[seq_id] = seq
        self._write(seq, ids[seq.num_tokens :])
        return len(hits) * self.block_size

    def append_tokens(self, seq_id: Hashable, tokens: int | Sequence[int]) -> list[int]:
        """Reserve slots for new tokens of ``seq_id``: its slot mapping for the batch.

        A new block is taken only when the last one is full. If the last block is shared
        (after :meth:`fork`) and partially filled, it is first copied to a new block that
        replaces it in this table (copy-on-write, reported by :meth:`pop_copies`).
        All-or-nothing: if the pool cannot hold every new token, nothing changes.

        Parameters
        ----------
        seq_id : Hashable
            A sequence on device.
        tokens : int or Sequence[int]
            Either the new tokens' ids (int64 range), or a count of tokens appended
            without ids (such tokens never make their block prefix-cacheable).

        Returns
        -------
        list[int]
            The physical slot of each new token, ``[num_new_tokens]`` (``slot_mapping``).
            The tokens are uncommitted until :meth:`commit`.

        Raises
        ------
        PagedValueError
            If the sequence is swapped out, a count is negative, or an id is not an int64.
        PagedTypeError
            If ``tokens`` is neither an integer nor a sequence.
        OutOfBlocksError
            If the append needs more free blocks than there are; the message names the
            shortfall.
        """
        if is_integer(tokens):
            if tokens < 0:
                raise PagedValueError("tokens", tokens, "a count >= 0 or a sequence of ids")
            ids: list[int | None] = [None] * int(tokens)
        else:
            ids = list(_check_token_ids(tokens))
        seq = self._on_device(seq_id)
        copy_on_write = bool(ids) and self._last_block_shared_partial(seq)
        need = self._blocks_needed(seq, len(ids), copy_on_write)
        if need > self._pool.num_free:
            raise self._out_of_blocks(f"appending {len(ids)} tokens to sequence {seq_id!r}", need)
        if copy_on_write:
            src = seq.blocks[-1]
            dst = self._pool.take()
            self._pool.fill(dst, self._pool.content[src])
            copy = BlockCopy(src, dst, CopyKind.COPY_ON_WRITE)
            self._start_copy(copy, seq_id)
            self._pool.release(src)
            seq.blocks[-1] = dst
            self._copies.append(copy)
        return self._write(seq, ids)

    def commit(self, seq_id: Hashable, num_tokens: int) -> None:
        """Record that the K/V of ``seq_id``'s first ``num_tokens`` tokens are written.

        Call it after the prefill or decode step that wrote them (vLLM's
        ``num_computed_tokens``). With prefix caching, each full block whose tokens are
        all committed, whose ids are known and into which no copy is pending becomes
        matchable, in table order.

        Raises
        ------
        PagedValueError
            If the sequence is swapped out, or ``num_tokens`` is not an int between the
            tokens committed so far and the tokens it holds.
        """
        seq = self._on_device(seq_id)
        if not is_integer(num_tokens) or not seq.num_committed <= num_tokens <= seq.num_tokens:
            raise PagedValueError(
                "num_tokens", num_tokens,
                f"an int in [{seq.num_committed}, {seq.num_tokens}] (committed so far, held)",
                f"commit: num_tokens of sequence {seq_id!r} must be an int in "
                f"[{seq.num_committed}, {seq.num_tokens}] (committed so far, held), "
                f"got {num_tokens!r}")
        seq.num_committed = int(num_tokens)
        self._register_ready(seq)

    def copy_done(self, copies: Iterable[BlockCopy]) -> None:
        """Record that the caller has made ``copies``; unpin their blocks.

        A block that no table holds any more returns to the free queue now; a block
        copied into becomes matchable (with prefix caching) once its sequence's earlier
        blocks are. All-or-nothing: every copy is checked before any is marked done.

        Raises
        ------
        PagedTypeError
            If an element is not a :class:`BlockCopy`.
        PagedValueError
            If a copy is not pending (never handed out, or already done), or appears twice.
        """
        copies = list(copies)
        for copy in copies:
            if not isinstance(copy, BlockCopy):
                raise PagedTypeError("copies", copy, "BlockCopy objects",
                                     f"copy_done takes BlockCopy objects, got {copy!r}")
        unknown = [copy for copy in copies if copy not in self._pending]
        if unknown:
            raise PagedValueError("copies", unknown, "pending copies", f"copy_done: {unknown} are "
                                  "not pending (never handed out, or done)")
        if len(set(copies)) != len(copies):
            raise PagedValueError("copies", copies, "distinct copies",
                                  "copy_done: a copy appears more than once")
        for copy in copies:
            seq_id = self._pending.pop(copy)
            if copy.kind is CopyKind.SWAP_OUT:
                self._host.filling.discard(copy.dst)
                self._pool.unpin(copy.src)
                self._host.unpin(copy.dst)
                continue
            self._filling.discard(copy.dst)
            if copy.kind is CopyKind.COPY_ON_WRITE:
                self._pool.unpin(copy.src)
            else:
                self._host.unpin(copy.src)
            self._pool.unpin(copy.dst)
            seq = self._seqs.get(seq_id)
            if seq is not None and seq.host_blocks is None:
                self._register_ready(seq)

    def fork(self, parent_id: Hashable, child_id: Hashable) -> None:
        """Start ``child_id`` as a copy of ``parent_id`` that shares all its blocks.

        No block is allocated: each of the parent's blocks gains a reference. The first
        append to a shared, partially filled last block copies it (copy-on-write).

        Raises
        ------
        PagedValueError
            If ``child_id`` already exists, the parent is swapped out, or its K/V are not
            all written (uncommitted tokens, or a copy into its blocks pending).
        """
        parent = self._on_device(parent_id)
        if child_id in self._seqs:
            raise PagedValueError("child_id", child_id, "an id not in use",
                                  f"fork: child sequence {child_id!r} already exists")
        self._require_written(parent, parent_id, "fork")
        for block in parent.blocks:
            self._pool.acquire(block)
        self._seqs[child_id] = _SequenceState(
            blocks=list(parent.blocks),
            num_tokens=parent.num_tokens,
            num_committed=parent.num_committed,
            hashes=list(parent.hashes),
            num_registered=parent.num_registered,
        )

    def free(self, *seq_ids: Hashable) -> None:
        """End the given sequences and drop their references to blocks.

        A block whose last reference goes returns to the free queue (see
        :mod:`~pagedbench.reference.block_pool` for the order), or stays pinned while a
        pending copy uses it. A table is released last block first, so a sequence's tail
        is evicted before its prefix (vLLM ``KVCacheManager.free``). Host blocks of
        swapped-out sequences return to the host pool. All-or-nothing: every id is checked
        before anything is freed.

        Raises
        ------
        PagedValueError
            If no id is given, or an id appears more than once in this call.
        KeyError
            If an id is not a known sequence (never added, or already freed).
        """
        if not seq_ids:
            raise PagedValueError("seq_ids", seq_ids, "at least one seq_id",
                                  "free needs at least one seq_id")
        repeated = [seq_id for seq_id, n in Counter(seq_ids).items() if n > 1]
        if repeated:
            raise PagedValueError("seq_ids", seq_ids, "distinct ids", f"free got duplicate "
                                  f"seq_ids {repeated}; each may be freed once")
        seqs = [self._seq(seq_id) for seq_id in seq_ids]
        for seq_id, seq in zip(seq_ids, seqs):
            for block in reversed(seq.blocks):
                self._pool.release(block)
            for host in seq.host_blocks or ():
                self._host.release(host)
            del self._seqs[seq_id]

    def preempt(self, seq_id: Hashable) -> int:
        """Preempt ``seq_id`` by recomputation: drop it and all its K/V.

        The id is forgotten, so the caller re-admits the sequence later with
        :meth:`add_sequence` (whose return value says how much the prefix cache still
        serves) and recomputes the rest (vLLM v1 preempts by freeing the request's
        blocks and resetting ``num_computed_tokens`` to 0; Kwon et al. section 4.5).

        Returns
        -------
        int
            Tokens whose K/V must be recomputed: all the sequence's tokens.
        """
        num_tokens = self._seq(seq_id).num_tokens
        self.free(seq_id)
        return num_tokens

    def swap_out(self, seq_id: Hashable) -> list[BlockCopy]:
        """Move ``seq_id``'s blocks to the host pool, all or nothing.

        Each device block is copied to its own host block and the sequence drops its
        device references (a block shared with another sequence stays on device for it);
        a device block stays pinned until its copy is done.

        Returns
        -------
        list[BlockCopy]
            ``SWAP_OUT`` copies (device ``src``, host ``dst``) in table order (vLLM v0
            ``BlockSpaceManager.swap_out``'s mapping).

        Raises
        ------
        PagedValueError
            If it is already swapped out, or its K/V are not all written.
        OutOfBlocksError
            If the host pool has too few free blocks.
        """
        seq = self._on_device(seq_id)
        self._require_written(seq, seq_id, "swap_out")
        if len(seq.blocks) > self._host.num_free:
            raise self._out_of_blocks(f"swapping out sequence {seq_id!r}", len(seq.blocks), True)
        copies = []
        for block in seq.blocks:
            host = self._host.take()
            self._host.content[host] = list(self._pool.content[block])
            copy = BlockCopy(block, host, CopyKind.SWAP_OUT)
            self._start_copy(copy, seq_id)
            copies.append(copy)
        for block in reversed(seq.blocks):
            self._pool.release(block)
        seq.host_blocks = [copy.dst for copy in copies]
        seq.blocks = []
        seq.num_registered = 0
        return copies

    def swap_in(self, seq_id: Hashable) -> list[BlockCopy]:
        """Bring a swapped-out ``seq_id`` back into new device blocks, all or nothing.

        One new block per host block, without a prefix-cache lookup (the table is
        restored from its host copy; sharing it had before the swap is not restored).
        With prefix caching its full blocks become matchable again as their copies are
        done.

        Returns
        -------
        list[BlockCopy]
            ``SWAP_IN`` copies (host ``src``, device ``dst``) in table order.

        Raises
        ------
        PagedValueError
            If it is not swapped out, or its swap-out copies are still pending.
        OutOfBlocksError
            If the device pool has too few free blocks.
        """
        seq = self._seq(seq_id)
        if seq.host_blocks is None:
            raise PagedValueError("seq_id", seq_id, "a swapped-out sequence",
                                  f"swap_in: sequence {seq_id!r} is not swapped out")
        pending = [host for host in seq.host_blocks if host in self._host.filling]
        if pending:
            raise PagedValueError(
                "seq_id", seq_id, "a sequence whose swap-out copies are done",
                f"swap_in: the swap-out copies of sequence {seq_id!r} into host blocks "
                f"{pending} are pending; call copy_done first"
            )
        if len(seq.host_blocks) > self._pool.num_free:
            raise self._out_of_blocks(f"swapping in sequence {seq_id!r}", len(seq.host_blocks))
        copies = []
        for host in seq.host_blocks:
            block = self._pool.take()
            self._pool.fill(block, self._host.content[host])
            self._host.content[host] = []
            seq.blocks.append(block)
            copy = BlockCopy(host, block, CopyKind.SWAP_IN)
            self._start_copy(copy, seq_id)
            copies.append(copy)
        for host in seq.host_blocks:
            self._host.release(host)
        seq.host_blocks = None
        return copies

    # Invariants ---------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Recompute the whole state from the tables and compare; raise on any mismatch.

        Checked: every block is exactly one of used (referenced), in flight (pinned by a
        pending copy), free or cached, and the free queue holds exactly the unreferenced,
        unpinned blocks; a block's reference count equals the number of tables holding it
        and its pins the pending copies using it; no table holds a block twice; each
        table has ``ceil(num_tokens / block_size)`` blocks, full but for the last; every
        cache entry points to a full block whose content hashes to its key, no copy
        writes into it, and block keys and entries agree; each sequence's chained hashes
        match its blocks' content; conversely, each sequence's leading full blocks that
        are hashed, committed and free of pending copies are registered under their keys,
        and no block of a table is registered past its committed tokens (so nothing
        unwritten is matchable); the running totals behind :meth:`usage` match a recount;
        host blocks are each free, or held once or pinned.

        Raises
        ------
        AllocatorInvariantError
            Naming the broken invariant and the block or sequence.
        """
        holders: Counter[int] = Counter()
        for seq_id, seq in self._seqs.items():
            invariant(
                len(set(seq.blocks)) == len(seq.blocks),
                f"sequence {seq_id!r} holds a block twice: {seq.blocks}",
            )
            holders.update(seq.blocks)
            self._check_sequence(seq_id, seq)
        pins: Counter[int] = Counter()
        host_pins: Counter[int] = Counter()
        for copy in self._pending:
            (host_pins if copy.kind is CopyKind.SWAP_IN else pins)[copy.src] += 1
            (host_pins if copy.kind is CopyKind.SWAP_OUT else pins)[copy.dst] += 1
        filling = {c.dst for c in self._pending if c.kind is not CopyKind.SWAP_OUT}
        invariant(
            self._filling == filling,
            f"pending copies: blocks {sorted(self._filling ^ filling)} are marked as being "
            "written but are no copy's target, or the reverse",
        )
        self._pool.check(holders, pins, filling)
        self._host.check(
            Counter(h for seq in self._seqs.values() for h in seq.host_blocks or ()),
            host_pins,
            {c.dst for c in self._pending if c.kind is CopyKind.SWAP_OUT},
        )

    def _check_sequence(self, seq_id: Hashable, seq: _SequenceState) -> None:
        bs = self.block_size
        on_host = seq.host_blocks is not None
        expected_blocks = 0 if on_host else -(-seq.num_tokens // bs)
        invariant(
            len(seq.blocks) == expected_blocks,
            f"table length: sequence {seq_id!r} has {seq.num_tokens} tokens in "
            f"{len(seq.blocks)} device blocks, expected {expected_blocks}",
        )
        invariant(
            0 <= seq.num_committed <= seq.num_tokens,
            f"commit: sequence {seq_id!r} has {seq.num_committed} of {seq.num_tokens} "
            "tokens committed",
        )
        content = self._host.content if on_host else self._pool.content
        table = seq.host_blocks if on_host else seq.blocks
        for index, block in enumerate(table):
            fill = min(bs, seq.num_tokens - index * bs)
            invariant(
                len(content[block]) == fill,
                f"block fill: block {block} at index {index} of sequence {seq_id!r} "
                f"holds {len(content[block])} tokens, expected {fill}",
            )
        parent = ROOT_HASH
        for index, key in enumerate(seq.hashes):
            ids = content[table[index]]
            invariant(
                len(ids) == bs and None not in ids and chain_hash(parent, ids) == key,
                f"sequence hash: key {index} of sequence {seq_id!r} does not match "
                f"the content of block {table[index]}",
            )
            parent = key
        if on_host:
            return
        # The converse of the cache entries: the leading blocks that are ready are filed.
        ready = 0
        limit = min(len(seq.hashes), seq.num_committed // bs)
        while ready < limit and seq.blocks[ready] not in self._filling:
            ready += 1
        block_hash = self._pool.block_hash
        invariant(
            seq.num_registered == ready
            and all(block_hash[seq.blocks[i]] == seq.hashes[i] for i in range(ready)),
            f"prefix cache: sequence {seq_id!r} has {ready} full, committed blocks with "
            f"settled copies, but {seq.num_registered} are registered (or under other keys)",
        )
        invariant(
            all(
                block_hash[block] is None or (index + 1) * bs <= seq.num_committed
                for index, block in enumerate(seq.blocks)
            ),
            f"prefix cache: sequence {seq_id!r} has a block registered past its "
            f"{seq.num_committed} committed tokens",
        )

    # Internals ----------------------------------------------------------------------------
    def _seq(self, seq_id: Hashable) -> _SequenceState:
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise KeyError(f"unknown sequence {seq_id!r} (never added, or already freed)") from None

    def _on_device(self, seq_id: Hashable) -> _SequenceState:
        seq = self._seq(seq_id)
        if seq.host_blocks is not None:
            raise PagedValueError("seq_id", seq_id, "a sequence on the device",
                                  f"sequence {seq_id!r} is swapped out; swap_in it first")
        return seq

    def _require_written(self, seq: _SequenceState, seq_id: Hashable, action: str) -> None:
        """Refuse an operation that reads ``seq``'s K/V before all of it is written."""
        uncommitted = seq.num_tokens - seq.num_committed
        filling = [block for block in seq.blocks if block in self._filling]
        if uncommitted or filling:
            raise PagedValueError(
                "seq_id", seq_id, "a sequence whose K/V is all written",
                f"{action}: sequence {seq_id!r} has {uncommitted} uncommitted tokens and "
                f"pending copies into blocks {filling}; commit and copy_done them first"
            )

    def _out_of_blocks(self, action: str, need: int, host: bool = False) -> OutOfBlocksError:
        """The refusal of ``action``, which needs ``need`` free blocks of the device (or
        host) pool: the one place the exhaustion error is built."""
        if host:
            return OutOfBlocksError(action, need, self._host.num_free, self.num_host_blocks, "host")
        return OutOfBlocksError(action, need, self._pool.num_free, self.num_blocks)

    def _blocks_needed(self, seq: _SequenceState, num_new_tokens: int, copy_on_write: bool) -> int:
        """New blocks for the overflow past the last block, plus the copy's block."""
        if num_new_tokens == 0:
            return 0
        grow = -(-(seq.num_tokens + num_new_tokens) // self.block_size) - len(seq.blocks)
        return grow + int(copy_on_write)

    def _last_block_shared_partial(self, seq: _SequenceState) -> bool:
        return seq.num_tokens % self.block_size != 0 and self._pool.ref[seq.blocks[-1]] > 1

    def _start_copy(self, copy: BlockCopy, seq_id: Hashable) -> None:
        """Pin both ends of a new pending copy and mark its target as being written."""
        if copy.kind is CopyKind.SWAP_IN:
            self._host.pin(copy.src)
        else:
            self._pool.pin(copy.src)
        if copy.kind is CopyKind.SWAP_OUT:
            self._host.pin(copy.dst)
            self._host.filling.add(copy.dst)
        else:
            self._pool.pin(copy.dst)
            self._filling.add(copy.dst)
        self._pending[copy] = seq_id

    def _write(self, seq: _SequenceState, ids: Sequence[int | None]) -> list[int]:
        """Place ``ids`` after the sequence's tokens, taking blocks as they fill.

        The caller has checked that enough blocks are free and done any copy-on-write.
        """
        bs = self.block_size
        pool = self._pool
        slots: list[int] = []
        start = 0
        while start < len(ids):
            offset = seq.num_tokens % bs
            if offset == 0:
                seq.blocks.append(pool.take())
            block = seq.blocks[-1]
            count = min(bs - offset, len(ids) - start)
            pool.write(block, ids[start : start + count])
            first_slot = block * bs + offset
            slots.extend(range(first_slot, first_slot + count))
            seq.num_tokens += count
            start += count
            if offset + count == bs:
                self._extend_hashes(seq, block)
        return slots

    def _extend_hashes(self, seq: _SequenceState, block: int) -> None:
        """Extend the sequence's hash chain over a block just filled (with caching, while
        every earlier block has a key and this one has all its ids)."""
        ids = self._pool.content[block]
        index = seq.num_tokens // self.block_size - 1
        if not self.enable_prefix_caching or len(seq.hashes) != index or None in ids:
            return
        seq.hashes.append(chain_hash(seq.hashes[-1] if seq.hashes else ROOT_HASH, ids))

    def _register_ready(self, seq: _SequenceState) -> None:
        """Register the sequence's next full blocks that are hashed, committed and free of
        pending copies, in table order (stopping at the first that is not)."""
        limit = min(len(seq.hashes), seq.num_committed // self.block_size)
        while seq.num_registered < limit:
            index = seq.num_registered
            block = seq.blocks[index]
            if block in self._filling:
                return
            parent = seq.hashes[index - 1] if index else ROOT_HASH
            self._pool.register(block, parent, seq.hashes[index])
            seq.num_registered += 1

    def _plan_prompt(self, ids: Sequence[int]) -> tuple[list[int], int]:
        """The prompt's prefix-cache hits, and the free blocks its allocation takes.

        A hit on a block in the free queue takes it out of the queue, so only hits on
        blocks outside it (in use, or pinned by a copy) save a free block.
        """
        hits = self._pool.match_prefix(ids)
        need = -(-len(ids) // self.block_size) - sum(not self._pool.is_free(b) for b in hits)
        return hits, need



def _check_token_ids(token_ids: Sequence[int]) -> list[int]:
    """``token_ids`` as a list of Python ints in int64 range.

    Raises
    ------
    PagedTypeError
        If ``token_ids`` is not iterable.
    PagedValueError
        If an element is not an integer in int64 range.
    """
    try:
        ids = list(token_ids)
    except TypeError:
        raise PagedTypeError("token_ids", token_ids, "a sequence of ints") from None
    for token_id in ids:
        if not is_integer(token_id) or not _INT64_MIN <= token_id <= _INT64_MAX:
            raise PagedValueError("token_ids", token_id, "ints in int64 range")
    return [int(token_id) for token_id in ids]
