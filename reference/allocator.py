"""The reference block allocator: one pool of fixed-size blocks and a table per sequence.

This is the memory model of paged attention (Kwon et al., "Efficient Memory Management
for Large Language Model Serving with PagedAttention", SOSP 2023, section 4): the KV cache
is cut into ``num_blocks`` blocks of ``block_size`` token slots; each sequence owns an
ordered list of blocks (its block table); a block is taken from the free list only when
the sequence's last block is full; blocks are reference-counted so that forked sequences
(parallel sampling, beam search) share them, and a shared, partially filled block is
copied before it is written (copy-on-write, section 4.4). Host-only Python ints, no
torch, so stateful tests run in milliseconds.

Free list and eviction order follow vLLM v1's ``BlockPool`` (``vllm/v1/core/block_pool.py``):
one queue holds every block with no reference, uncached blocks at the front (reused
first) and prefix-cached blocks at the back in the order they were freed, so a cached
block is evicted least-recently-used first and only when no uncached block is left. The
queue is an ``OrderedDict`` (a doubly linked list): take, append, prepend, and removing a
cached block that a new request hits are all O(1).

Prefix caching (opt-in) follows vLLM's automatic prefix caching
(``docs/design/prefix_caching.md``): a full block is named by a hash chained over
(parent block's hash, the block's token ids), here SHA-256; a request whose prompt starts
with the same full blocks shares their physical blocks. Equal blocks filled independently
are all cached under one key (no deduplication, so block tables stay append-only, as in
vLLM's ``BlockHashToBlockMap``); a lookup takes the one cached first. The allocator
treats a slot as written when the call that returned it returns (the caller writes K/V
there before its next call), so a block becomes matchable when the append that fills it
completes, never earlier; tokens appended without ids never become matchable.

Preemption frees a sequence for recomputation (Kwon et al. section 4.5) or swaps its
blocks to a host pool and back. :meth:`BlockAllocator.usage` accounts for memory at any
moment, and :meth:`BlockAllocator.check_invariants` recomputes the whole state from the
tables for the tests to call after every step.

Placement is deliberately non-contiguous: the free list is shuffled with a seeded RNG, so
a kernel that assumes ``block_table[i][j] == i * max_blocks + j`` fails.
"""

from __future__ import annotations

import hashlib
import random
from array import array
from collections import Counter, OrderedDict, deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from numbers import Integral

#: Parent hash of a sequence's first block.
_ROOT_HASH = b""
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


class OutOfBlocksError(RuntimeError):
    """An allocation needs more free blocks than the pool (device or host) has.

    Attributes
    ----------
    needed : int
        Blocks the operation needs.
    available : int
        Blocks free (including evictable cached blocks) when it was refused.
    """

    def __init__(self, message: str, needed: int, available: int) -> None:
        super().__init__(message)
        self.needed = needed
        self.available = available

    @property
    def shortfall(self) -> int:
        """Blocks missing: ``needed - available``."""
        return self.needed - self.available


class AllocatorInvariantError(AssertionError):
    """:meth:`BlockAllocator.check_invariants` found broken state; the message names the
    invariant and the block or sequence that breaks it."""


@dataclass(frozen=True)
class AllocatorUsage:
    """Memory accounting of the device pool at one moment.

    Every block is exactly one of used, free, or cached, so
    ``blocks_used + blocks_free + blocks_cached == num_blocks``.

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
        Host (swap) pool blocks holding swapped-out sequences.
    """

    num_blocks: int
    blocks_used: int
    blocks_free: int
    blocks_cached: int
    tokens_stored: int
    slots_allocated: int
    fragmentation_slots: int
    host_blocks_used: int


@dataclass
class _Sequence:
    """One sequence's allocator state."""

    blocks: list[int] = field(default_factory=list)  # device block table; empty if swapped
    num_tokens: int = 0
    # Chained hashes of the leading full blocks whose token ids are all known (kept only
    # with prefix caching).
    hashes: list[bytes] = field(default_factory=list)
    host_blocks: list[int] | None = None  # host block table while swapped out


def chain_hash(parent_hash: bytes, token_ids: Sequence[int]) -> bytes:
    """The prefix-cache key of a full block: SHA-256 over its parent's key and its ids.

    Parameters
    ----------
    parent_hash : bytes
        Key of the previous block of the sequence; ``b""`` for the first block.
    token_ids : Sequence[int]
        The block's ``block_size`` token ids, each in int64 range.

    Returns
    -------
    bytes
        32-byte digest. Chaining makes a block's key depend on the whole prefix, so equal
        keys mean equal prefixes (vLLM's ``hash_block_tokens``, ``kv_cache_utils.py``).
    """
    return hashlib.sha256(parent_hash + array("q", token_ids).tobytes()).digest()


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
        Share full blocks between sequences with the same prefix (see the module notes).
    num_host_blocks : int or None
        Blocks in the host pool that :meth:`swap_out` copies to; ``None`` means
        ``num_blocks``. May be 0 (swapping then always fails).

    Raises
    ------
    ValueError
        If ``num_blocks`` or ``block_size`` is not an int >= 1, or ``num_host_blocks``
        is not None or an int >= 0.

    Notes
    -----
    Sequence ids are any hashable values. Every mutation either completes or raises
    before changing anything. Copies the caller must make on the K/V cache are reported:
    copy-on-write by :meth:`pop_copies`, swaps by the return values of :meth:`swap_out`
    and :meth:`swap_in`.
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
            if not _is_int(value) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if num_host_blocks is None:
            num_host_blocks = num_blocks
        if not _is_int(num_host_blocks) or num_host_blocks < 0:
            raise ValueError(
                f"num_host_blocks must be None or an int >= 0, got {num_host_blocks!r}"
            )
        self.num_blocks = int(num_blocks)
        self.block_size = int(block_size)
        self.enable_prefix_caching = bool(enable_prefix_caching)
        self.num_host_blocks = int(num_host_blocks)

        order = list(range(self.num_blocks))
        if seed is not None:
            random.Random(seed).shuffle(order)
        # Unreferenced blocks in reuse order: uncached at the front, cached at the back.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(order)
        self._ref = [0] * num_blocks
        # Token id written in each slot of each block (None: appended without an id);
        # the length is the block's fill.
        self._content: list[list[int | None]] = [[] for _ in range(num_blocks)]
        # Prefix cache: key -> its blocks (an ordered set), and per block its key and its
        # parent's key.
        self._cached: dict[bytes, dict[int, None]] = {}
        self._block_hash: list[bytes | None] = [None] * num_blocks
        self._parent_hash: list[bytes | None] = [None] * num_blocks

        self._host_free: deque[int] = deque(range(num_host_blocks))
        self._host_content: list[list[int | None]] = [[] for _ in range(num_host_blocks)]

        self._seqs: dict[Hashable, _Sequence] = {}
        self._copies: list[tuple[int, int]] = []
        # Running totals, recomputed from scratch by check_invariants.
        self._blocks_used = 0
        self._blocks_cached = 0
        self._tokens_stored = 0

    # Queries ------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take now: free plus evictable cached blocks."""
        return len(self._free)

    def block_table(self, seq_id: Hashable) -> list[int]:
        """The physical block ids of ``seq_id``, in logical order (a copy; empty while
        the sequence is swapped out).

        Raises
        ------
        KeyError
            If ``seq_id`` is not a known sequence.
        """
        return list(self._seq(seq_id).blocks)

    def num_tokens(self, seq_id: Hashable) -> int:
        """Tokens ``seq_id`` holds (on device, or on host while swapped out).

        Raises
        ------
        KeyError
            If ``seq_id`` is not a known sequence.
        """
        return self._seq(seq_id).num_tokens

    def __contains__(self, seq_id: Hashable) -> bool:
        """Whether ``seq_id`` is a known sequence (on device or swapped out), in O(1)."""
        return seq_id in self._seqs

    def sequences(self) -> list[Hashable]:
        """Ids of all known sequences (on device or swapped out), in insertion order."""
        return list(self._seqs)

    def is_swapped_out(self, seq_id: Hashable) -> bool:
        """Whether ``seq_id`` is in the host pool.

        Raises
        ------
        KeyError
            If ``seq_id`` is not a known sequence.
        """
        return self._seq(seq_id).host_blocks is not None

    def blocks_needed(self, seq_id: Hashable, num_new_tokens: int) -> int:
        """Free blocks an append of ``num_new_tokens`` to ``seq_id`` would take.

        Counts new blocks for the overflow past the last block, plus one when the last
        block is shared and partially filled (it is copied before the write).

        Raises
        ------
        KeyError
            If ``seq_id`` is not a known sequence.
        ValueError
            If ``num_new_tokens`` < 0 or the sequence is swapped out.
        """
        seq = self._on_device(seq_id)
        if not _is_int(num_new_tokens) or num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be an int >= 0, got {num_new_tokens!r}")
        if num_new_tokens == 0:
            return 0
        bs = self.block_size
        grow = -(-(seq.num_tokens + num_new_tokens) // bs) - len(seq.blocks)
        return grow + int(self._last_block_shared_partial(seq))

    def can_append(self, seq_id: Hashable, num_new_tokens: int) -> bool:
        """Whether :meth:`append_tokens` of ``num_new_tokens`` would succeed now."""
        return self.blocks_needed(seq_id, num_new_tokens) <= len(self._free)

    def blocks_needed_for_prompt(self, token_ids: Sequence[int]) -> int:
        """Free blocks :meth:`add_sequence` with this prompt would take now.

        That is the prompt's blocks less its prefix-cache hits on blocks in use (a hit
        on an unreferenced cached block still takes it out of the free queue).

        Raises
        ------
        ValueError
            If a token id is not an int64.
        """
        return self._plan_prompt(_check_token_ids(token_ids))[1]

    def usage(self) -> AllocatorUsage:
        """Memory accounting now (see :class:`AllocatorUsage`)."""
        slots = self._blocks_used * self.block_size
        return AllocatorUsage(
            num_blocks=self.num_blocks,
            blocks_used=self._blocks_used,
            blocks_free=len(self._free) - self._blocks_cached,
            blocks_cached=self._blocks_cached,
            tokens_stored=self._tokens_stored,
            slots_allocated=slots,
            fragmentation_slots=slots - self._tokens_stored,
            host_blocks_used=self.num_host_blocks - len(self._host_free),
        )

    def pop_copies(self) -> list[tuple[int, int]]:
        """Copy-on-write copies made since the last call, as ``(src_block, dst_block)``.

        The caller copies the K/V of ``src_block`` into ``dst_block`` (every layer) before
        writing the new tokens at the slots the append returned.
        """
        copies, self._copies = self._copies, []
        return copies

    # Mutations ----------------------------------------------------------------------------
    def add_sequence(self, seq_id: Hashable, token_ids: Sequence[int] = ()) -> int:
        """Start a sequence and allocate its prompt's blocks, all or nothing.

        With prefix caching, the longest run of leading full blocks already cached is
        shared instead of allocated, capped so that at least one prompt token is left to
        compute (a prompt that is a whole number of cached blocks recomputes its last
        block: vLLM's ``max_cache_hit_length = num_tokens - 1``, ``kv_cache_manager.py``).

        Parameters
        ----------
        seq_id : Hashable
            A new id.
        token_ids : Sequence[int]
            The prompt's token ids (int64 range), ``[prompt_len]``; may be empty.

        Returns
        -------
        int
            Prompt tokens served from the prefix cache (a multiple of ``block_size``).
            The caller computes K/V for the rest and writes them at
            ``block_table(seq_id)[pos // block_size] * block_size + pos % block_size``.

        Raises
        ------
        ValueError
            If ``seq_id`` is already known, or a token id is not an int64.
        TypeError
            If ``token_ids`` is not a sequence.
        OutOfBlocksError
            If the pool cannot hold the prompt; nothing is allocated.
        """
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id!r} already exists")
        ids = _check_token_ids(token_ids)
        hits, need = self._plan_prompt(ids)
        if need > len(self._free):
            raise OutOfBlocksError(
                f"adding sequence {seq_id!r} with a {len(ids)}-token prompt needs {need} free "
                f"blocks but only {len(self._free)} of {self.num_blocks} are free "
                f"(short by {need - len(self._free)})",
                need,
                len(self._free),
            )
        seq = _Sequence()
        for block in hits:
            self._acquire(block)
            seq.blocks.append(block)
            seq.hashes.append(self._block_hash[block])
        seq.num_tokens = len(hits) * self.block_size
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

        Raises
        ------
        KeyError
            If ``seq_id`` is not a known sequence.
        ValueError
            If the sequence is swapped out, a count is negative, or an id is not an int64.
        TypeError
            If ``tokens`` is neither an integer nor a sequence.
        OutOfBlocksError
            If the append needs more free blocks than there are; the message names the
            shortfall.
        """
        if _is_int(tokens):
            if tokens < 0:
                raise ValueError(f"tokens must be a count >= 0 or a sequence of ids, got {tokens}")
            ids: list[int | None] = [None] * int(tokens)
        else:
            ids = list(_check_token_ids(tokens))
        seq = self._on_device(seq_id)
        need = self.blocks_needed(seq_id, len(ids))
        if need > len(self._free):
            raise OutOfBlocksError(
                f"appending {len(ids)} tokens to sequence {seq_id!r} needs {need} new "
                f"blocks but only {len(self._free)} of {self.num_blocks} are free "
                f"(short by {need - len(self._free)})",
                need,
                len(self._free),
            )
        if ids and self._last_block_shared_partial(seq):
            src = seq.blocks[-1]
            dst = self._take_block()
            self._content[dst] = list(self._content[src])
            self._tokens_stored += len(self._content[dst])
            self._release(src)
            seq.blocks[-1] = dst
            self._copies.append((src, dst))
        return self._write(seq, ids)

    def fork(self, parent_id: Hashable, child_id: Hashable) -> None:
        """Start ``child_id`` as a copy of ``parent_id`` that shares all its blocks.

        No block is allocated: each of the parent's blocks gains a reference. The first
        append to a shared, partially filled last block copies it (copy-on-write).

        Raises
        ------
        KeyError
            If ``parent_id`` is not a known sequence.
        ValueError
            If ``child_id`` already exists or the parent is swapped out.
        """
        parent = self._on_device(parent_id)
        if child_id in self._seqs:
            raise ValueError(f"fork: child sequence {child_id!r} already exists")
        for block in parent.blocks:
            self._acquire(block)
        self._seqs[child_id] = _Sequence(
            blocks=list(parent.blocks), num_tokens=parent.num_tokens, hashes=list(parent.hashes)
        )

    def free(self, *seq_ids: Hashable) -> None:
        """End the given sequences and drop their references to blocks.

        A block whose last reference goes returns to the free queue: uncached blocks at
        the front, prefix-cached blocks at the back (they stay matchable until evicted).
        A table is released last block first, so a sequence's tail is evicted before its
        prefix (vLLM ``KVCacheManager.free``). Host blocks of swapped-out sequences return
        to the host pool. All-or-nothing: every id is checked before anything is freed.

        Raises
        ------
        ValueError
            If no id is given, or an id appears more than once in this call.
        KeyError
            If an id is not a known sequence (never added, or already freed).
        """
        if not seq_ids:
            raise ValueError("free needs at least one seq_id")
        repeated = [seq_id for seq_id, n in Counter(seq_ids).items() if n > 1]
        if repeated:
            raise ValueError(f"free got duplicate seq_ids {repeated}; each may be freed once")
        seqs = [self._seq(seq_id) for seq_id in seq_ids]
        for seq_id, seq in zip(seq_ids, seqs):
            for block in reversed(seq.blocks):
                self._release(block)
            self._host_free.extend(seq.host_blocks or ())
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

        Raises
        ------
        KeyError
            If ``seq_id`` is not a known sequence.
        """
        num_tokens = self._seq(seq_id).num_tokens
        self.free(seq_id)
        return num_tokens

    def swap_out(self, seq_id: Hashable) -> list[tuple[int, int]]:
        """Move ``seq_id``'s blocks to the host pool, all or nothing.

        Each device block is copied to its own host block and the sequence drops its
        device references (a block shared with another sequence stays on device for it).

        Returns
        -------
        list[tuple[int, int]]
            ``(device_block, host_block)`` copies for the caller to make, in table order
            (vLLM v0 ``BlockSpaceManager.swap_out``'s mapping).

        Raises
        ------
        KeyError
            If ``seq_id`` is not a known sequence.
        ValueError
            If it is already swapped out.
        OutOfBlocksError
            If the host pool has too few free blocks.
        """
        seq = self._on_device(seq_id)
        need = len(seq.blocks)
        if need > len(self._host_free):
            raise OutOfBlocksError(
                f"swapping out sequence {seq_id!r} needs {need} host blocks but only "
                f"{len(self._host_free)} of {self.num_host_blocks} are free "
                f"(short by {need - len(self._host_free)})",
                need,
                len(self._host_free),
            )
        mapping = []
        for block in seq.blocks:
            host = self._host_free.popleft()
            self._host_content[host] = list(self._content[block])
            mapping.append((block, host))
        for block in reversed(seq.blocks):
            self._release(block)
        seq.host_blocks = [host for _, host in mapping]
        seq.blocks = []
        return mapping

    def swap_in(self, seq_id: Hashable) -> list[tuple[int, int]]:
        """Bring a swapped-out ``seq_id`` back into new device blocks, all or nothing.

        With prefix caching, its full blocks become matchable again; sharing the sequence
        had with others before the swap is not restored.

        Returns
        -------
        list[tuple[int, int]]
            ``(host_block, device_block)`` copies for the caller to make, in table order.

        Raises
        ------
        KeyError
            If ``seq_id`` is not a known sequence.
        ValueError
            If it is not swapped out.
        OutOfBlocksError
            If the device pool has too few free blocks.
        """
        seq = self._seq(seq_id)
        if seq.host_blocks is None:
            raise ValueError(f"swap_in: sequence {seq_id!r} is not swapped out")
        need = len(seq.host_blocks)
        if need > len(self._free):
            raise OutOfBlocksError(
                f"swapping in sequence {seq_id!r} needs {need} free blocks but only "
                f"{len(self._free)} of {self.num_blocks} are free "
                f"(short by {need - len(self._free)})",
                need,
                len(self._free),
            )
        mapping = []
        for index, host in enumerate(seq.host_blocks):
            block = self._take_block()
            self._content[block] = self._host_content[host]
            self._host_content[host] = []
            self._tokens_stored += len(self._content[block])
            seq.blocks.append(block)
            if index < len(seq.hashes):
                parent = seq.hashes[index - 1] if index else _ROOT_HASH
                self._register(block, parent, seq.hashes[index])
            mapping.append((host, block))
        self._host_free.extend(seq.host_blocks)
        seq.host_blocks = None
        return mapping

    # Invariants ---------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Recompute the whole state from the tables and compare; raise on any mismatch.

        Checked: every block is exactly one of used (referenced), free, or cached
        (unreferenced with a prefix-cache key), and the free queue holds exactly the
        unreferenced blocks, valid ids only; a block's reference count equals the number
        of tables holding it (so it is >= 0 and no table holds a freed block), and no
        table holds a block twice; each table has ``ceil(num_tokens / block_size)``
        blocks, full but for the last; every cache entry points to a full block whose
        content hashes to its key, and block keys and entries agree; each sequence's
        chained hashes match its blocks' content; the running totals behind
        :meth:`usage` match a recount; host blocks are each free or held once.

        Raises
        ------
        AllocatorInvariantError
            Naming the broken invariant and the block or sequence.
        """
        bs = self.block_size
        holders: Counter[int] = Counter()
        for seq_id, seq in self._seqs.items():
            _require(
                len(set(seq.blocks)) == len(seq.blocks),
                f"sequence {seq_id!r} holds a block twice: {seq.blocks}",
            )
            holders.update(seq.blocks)
            expected_blocks = 0 if seq.host_blocks is not None else -(-seq.num_tokens // bs)
            _require(
                len(seq.blocks) == expected_blocks,
                f"table length: sequence {seq_id!r} has {seq.num_tokens} tokens in "
                f"{len(seq.blocks)} device blocks, expected {expected_blocks}",
            )
            table_content = self._content if seq.host_blocks is None else self._host_content
            table = seq.blocks if seq.host_blocks is None else seq.host_blocks
            for index, block in enumerate(table):
                fill = min(bs, seq.num_tokens - index * bs)
                _require(
                    len(table_content[block]) == fill,
                    f"block fill: block {block} at index {index} of sequence {seq_id!r} "
                    f"holds {len(table_content[block])} tokens, expected {fill}",
                )
            parent = _ROOT_HASH
            for index, key in enumerate(seq.hashes):
                ids = table_content[table[index]]
                _require(
                    len(ids) == bs and None not in ids and chain_hash(parent, ids) == key,
                    f"sequence hash: key {index} of sequence {seq_id!r} does not match "
                    f"the content of block {table[index]}",
                )
                parent = key
        for block in range(self.num_blocks):
            _require(self._ref[block] >= 0, f"ref count: block {block} has {self._ref[block]}")
            _require(
                self._ref[block] == holders[block],
                f"ref count: block {block} has ref {self._ref[block]} but "
                f"{holders[block]} tables hold it",
            )
            _require(
                (self._ref[block] == 0) == (block in self._free),
                f"partition: block {block} has ref {self._ref[block]} and is "
                f"{'' if block in self._free else 'not '}in the free queue",
            )
        _require(
            all(isinstance(b, int) and 0 <= b < self.num_blocks for b in self._free),
            "free queue: holds an invalid block id",
        )
        entries = [(key, block) for key, blocks in self._cached.items() for block in blocks]
        for key, block in entries:
            _require(
                self._block_hash[block] == key,
                f"cache entry: key {key.hex()[:12]} points to block {block} whose key differs",
            )
            ids = self._content[block]
            _require(
                len(ids) == bs
                and None not in ids
                and chain_hash(self._parent_hash[block], ids) == key,
                f"cache entry: block {block} is not full or its content does not hash to "
                f"its key {key.hex()[:12]}",
            )
        keyed = [b for b in range(self.num_blocks) if self._block_hash[b] is not None]
        _require(
            len(keyed) == len(entries) and all(self._cached.values()),
            f"cache entry: {len(keyed)} blocks carry a key but the cache has "
            f"{len(entries)} entries (or an empty key)",
        )
        used = [b for b in range(self.num_blocks) if self._ref[b] > 0]
        cached_free = sum(1 for b in self._free if self._block_hash[b] is not None)
        stored = sum(len(self._content[b]) for b in used)
        for name, running, recount in (
            ("blocks_used", self._blocks_used, len(used)),
            ("blocks_cached", self._blocks_cached, cached_free),
            ("tokens_stored", self._tokens_stored, stored),
        ):
            _require(running == recount, f"accounting: {name} is {running}, recount {recount}")
        host_held = Counter(h for seq in self._seqs.values() for h in seq.host_blocks or ())
        _require(
            all(n == 1 for n in host_held.values())
            and not host_held.keys() & set(self._host_free)
            and len(host_held) + len(self._host_free) == self.num_host_blocks
            and len(set(self._host_free)) == len(self._host_free),
            "host pool: a host block is held twice, both held and free, or lost",
        )

    # Internals ----------------------------------------------------------------------------
    def _seq(self, seq_id: Hashable) -> _Sequence:
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise KeyError(f"unknown sequence {seq_id!r} (never added, or already freed)") from None

    def _on_device(self, seq_id: Hashable) -> _Sequence:
        seq = self._seq(seq_id)
        if seq.host_blocks is not None:
            raise ValueError(f"sequence {seq_id!r} is swapped out; swap_in it first")
        return seq

    def _last_block_shared_partial(self, seq: _Sequence) -> bool:
        return seq.num_tokens % self.block_size != 0 and self._ref[seq.blocks[-1]] > 1

    def _take_block(self) -> int:
        """Pop the head of the free queue (evicting its cache entry) with one reference."""
        block, _ = self._free.popitem(last=False)
        key = self._block_hash[block]
        if key is not None:
            del self._cached[key][block]
            if not self._cached[key]:
                del self._cached[key]
            self._block_hash[block] = self._parent_hash[block] = None
            self._blocks_cached -= 1
        self._content[block] = []
        self._ref[block] = 1
        self._blocks_used += 1
        return block

    def _acquire(self, block: int) -> None:
        """Add a reference to a block that holds data (fork, prefix hit)."""
        if self._ref[block] == 0:
            del self._free[block]
            self._blocks_cached -= self._block_hash[block] is not None
            self._blocks_used += 1
            self._tokens_stored += len(self._content[block])
        self._ref[block] += 1

    def _release(self, block: int) -> None:
        self._ref[block] -= 1
        if self._ref[block] == 0:
            self._blocks_used -= 1
            self._tokens_stored -= len(self._content[block])
            self._free[block] = None
            if self._block_hash[block] is None:
                self._free.move_to_end(block, last=False)
            else:
                self._blocks_cached += 1

    def _write(self, seq: _Sequence, ids: Sequence[int | None]) -> list[int]:
        """Place ``ids`` after the sequence's tokens, taking blocks as they fill.

        The caller has checked that enough blocks are free and done any copy-on-write.
        """
        bs = self.block_size
        slots = []
        for token_id in ids:
            pos = seq.num_tokens
            if pos % bs == 0:
                seq.blocks.append(self._take_block())
            block = seq.blocks[-1]
            self._content[block].append(token_id)
            slots.append(block * bs + pos % bs)
            seq.num_tokens = pos + 1
            if seq.num_tokens % bs == 0:
                self._on_block_full(seq, block)
        self._tokens_stored += len(ids)
        return slots

    def _on_block_full(self, seq: _Sequence, block: int) -> None:
        """Extend the sequence's hash chain over a block just filled, and cache it."""
        ids = self._content[block]
        index = seq.num_tokens // self.block_size - 1
        if not self.enable_prefix_caching or len(seq.hashes) != index or None in ids:
            return
        parent = seq.hashes[-1] if seq.hashes else _ROOT_HASH
        key = chain_hash(parent, ids)
        seq.hashes.append(key)
        self._register(block, parent, key)

    def _register(self, block: int, parent: bytes, key: bytes) -> None:
        """Make a full, written, referenced block matchable under ``key``."""
        if self.enable_prefix_caching:
            self._cached.setdefault(key, {})[block] = None
            self._block_hash[block] = key
            self._parent_hash[block] = parent

    def _plan_prompt(self, ids: Sequence[int]) -> tuple[list[int], int]:
        """The prompt's prefix-cache hits, and the free blocks its allocation takes.

        A hit on an unreferenced cached block takes it out of the free queue, so only
        hits on blocks in use save a free block.
        """
        hits = self._match_prefix(ids)
        need = -(-len(ids) // self.block_size) - sum(self._ref[b] > 0 for b in hits)
        return hits, need

    def _match_prefix(self, ids: Sequence[int]) -> list[int]:
        """Cached blocks that hold the prompt's leading full blocks, leaving >= 1 token."""
        if not self.enable_prefix_caching:
            return []
        bs = self.block_size
        hits: list[int] = []
        parent = _ROOT_HASH
        for start in range(0, (len(ids) - 1) // bs * bs, bs):
            key = chain_hash(parent, ids[start : start + bs])
            blocks = self._cached.get(key)
            if not blocks:
                break
            hits.append(next(iter(blocks)))
            parent = key
        return hits


def _is_int(value: object) -> bool:
    """An integer (Python or NumPy), not a bool."""
    return isinstance(value, Integral) and not isinstance(value, bool)


def _check_token_ids(token_ids: Sequence[int]) -> list[int]:
    """``token_ids`` as a list of Python ints in int64 range.

    Raises
    ------
    TypeError
        If ``token_ids`` is not iterable.
    ValueError
        If an element is not an integer in int64 range.
    """
    try:
        ids = list(token_ids)
    except TypeError:
        raise TypeError(
            f"token_ids must be a sequence of ints, got {type(token_ids).__name__}"
        ) from None
    for token_id in ids:
        if not _is_int(token_id) or not _INT64_MIN <= token_id <= _INT64_MAX:
            raise ValueError(f"token_ids must be ints in int64 range, got {token_id!r}")
    return [int(token_id) for token_id in ids]


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise AllocatorInvariantError(message)
