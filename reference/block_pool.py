"""Block pools: the device pool (reference counts, pins, eviction order, prefix cache), the
host pool, and the copies between them.

:class:`BlockPool` is the lower half of :class:`~pagedbench.reference.allocator.BlockAllocator`,
as vLLM v1's ``BlockPool`` (``vllm/v1/core/block_pool.py``) is the lower half of its
``KVCacheManager``: it knows blocks, never sequences. Every device block is exactly one of

- **used**: referenced by at least one block table;
- **in flight**: unreferenced but pinned by a pending copy (a swap or a copy-on-write
  copy reads or writes it), so it can be neither reused nor evicted until the copy is done;
- **free**: in the free queue, uncached (holding nothing reusable) or cached (a full,
  written block registered in the prefix cache, reusable by a request with its prefix).

Eviction order (vLLM's ``BlockPool.free_blocks`` and ``docs/design/prefix_caching.md``):
the queue holds uncached blocks at the front, most recently released first, and cached
blocks at the back in the order they were released, so allocation takes every uncached
block before it evicts a cached one, and evicts the least recently released cached block
first. The allocator releases a table tail first, so a finished request's last block is
evicted before its prefix. The queue is an ``OrderedDict`` (a doubly linked list): take,
release, and removing a cached block that a prefix hit takes back are all O(1).

The prefix cache maps a key (:func:`chain_hash`) to every block registered under it, in
registration order: equal blocks filled independently are not deduplicated (block tables
stay append-only, vLLM's ``BlockHashToBlockMap``), and a lookup takes the block registered
first (vLLM's ``get_one_block``).
"""

from __future__ import annotations

import enum
import hashlib
import random
from array import array
from collections import Counter, OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass

#: Parent key of a sequence's first block.
ROOT_HASH = b""


class AllocatorInvariantError(AssertionError):
    """``check_invariants`` found broken state; the message names the invariant and the
    block or sequence that breaks it."""


class OutOfBlocksError(RuntimeError):
    """An allocation needs more free blocks than the pool (device or host) has.

    Parameters
    ----------
    action : str
        What was refused, e.g. ``"appending 3 tokens to sequence 'a'"``.
    needed, available, total : int
        Blocks the operation needs, blocks free when it was refused (evictable cached
        blocks included), blocks in the pool.
    pool : str
        ``"free"`` (the device pool) or ``"host"``; named in the message.

    Attributes
    ----------
    needed, available : int
        As given; ``shortfall`` is ``needed - available``.
    """

    def __init__(
        self, action: str, needed: int, available: int, total: int, pool: str = "free"
    ) -> None:
        super().__init__(
            f"{action} needs {needed} {pool} blocks but only {available} of {total} are "
            f"free (short by {needed - available})"
        )
        self.needed = needed
        self.available = available

    @property
    def shortfall(self) -> int:
        """Blocks missing: ``needed - available``."""
        return self.needed - self.available


class CopyKind(enum.Enum):
    """What a :class:`BlockCopy` copies, and between which pools."""

    COPY_ON_WRITE = "copy-on-write"  # device -> device
    SWAP_OUT = "swap-out"  # device -> host
    SWAP_IN = "swap-in"  # host -> device


@dataclass(frozen=True)
class BlockCopy:
    """One block of K/V the caller copies (every layer), then reports with ``copy_done``.

    Attributes
    ----------
    src, dst : int
        Block ids; host block ids for the host end of a swap (see ``kind``).
    kind : CopyKind
        Copy-on-write (device to device), swap out (device to host), swap in (host to
        device).
    """

    src: int
    dst: int
    kind: CopyKind


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


class BlockPool:
    """``num_blocks`` device blocks of ``block_size`` slots (see the module notes).

    Parameters
    ----------
    num_blocks, block_size : int
        Already validated by the allocator (>= 1).
    seed : int or None
        Seeds the shuffle of the initial free queue; ``None`` keeps ascending order.
        Placement is non-contiguous on purpose: a kernel that assumes
        ``block_table[i][j] == i * max_blocks + j`` fails.
    enable_prefix_caching : bool
        Whether :meth:`register` files blocks in the prefix cache (else it is a no-op).
    """

    def __init__(
        self, num_blocks: int, block_size: int, seed: int | None, enable_prefix_caching: bool
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        order = list(range(num_blocks))
        if seed is not None:
            random.Random(seed).shuffle(order)
        # Free blocks in reuse order: uncached at the front, cached at the back.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(order)
        self.ref = [0] * num_blocks
        self.pins = [0] * num_blocks  # pending copies reading or writing each block
        # Token id written in each slot of each block (None: appended without an id);
        # the length is the block's fill.
        self.content: list[list[int | None]] = [[] for _ in range(num_blocks)]
        # Prefix cache: key -> its blocks in registration order (an ordered set), and per
        # block its key and its parent's key.
        self._cached: dict[bytes, dict[int, None]] = {}
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self._parent_hash: list[bytes | None] = [None] * num_blocks
        # Running totals behind usage(), recomputed from scratch by check().
        self.blocks_used = 0
        self.blocks_cached = 0  # cached blocks in the free queue
        self.blocks_in_flight = 0
        self.tokens_stored = 0  # tokens in used blocks

    @property
    def num_free(self) -> int:
        """Blocks an allocation can take now: the free queue, cached blocks included."""
        return len(self._free)

    def is_free(self, block: int) -> bool:
        """Whether ``block`` is in the free queue (O(1))."""
        return block in self._free

    def take(self) -> int:
        """Pop the head of the free queue (evicting its cache entry) with one reference.

        The caller has checked :attr:`num_free`.
        """
        block, _ = self._free.popitem(last=False)
        if self.block_hash[block] is not None:
            self._unregister(block)
            self.blocks_cached -= 1
        self.content[block] = []
        self.ref[block] = 1
        self.blocks_used += 1
        return block

    def acquire(self, block: int) -> None:
        """Add a reference to a block that holds data (fork, prefix hit)."""
        if self.ref[block] == 0:
            if self.pins[block]:
                self.blocks_in_flight -= 1
            else:
                del self._free[block]
                self.blocks_cached -= self.block_hash[block] is not None
            self.blocks_used += 1
            self.tokens_stored += len(self.content[block])
        self.ref[block] += 1

    def release(self, block: int) -> None:
        """Drop a reference; the last one sends the block to the free queue, or leaves it
        in flight while a copy pins it."""
        self.ref[block] -= 1
        if self.ref[block] == 0:
            self.blocks_used -= 1
            self.tokens_stored -= len(self.content[block])
            if self.pins[block]:
                self.blocks_in_flight += 1
            else:
                self._enqueue(block)

    def pin(self, block: int) -> None:
        """Keep ``block`` out of the free queue until the matching :meth:`unpin`."""
        self.pins[block] += 1

    def unpin(self, block: int) -> None:
        """Drop one pin; an unreferenced block whose last pin goes is released now."""
        self.pins[block] -= 1
        if self.pins[block] == 0 and self.ref[block] == 0:
            self.blocks_in_flight -= 1
            self._enqueue(block)

    def write(self, block: int, token_ids: Sequence[int | None]) -> None:
        """Fill the next slots of a used block (the caller keeps within ``block_size``)."""
        self.content[block].extend(token_ids)
        self.tokens_stored += len(token_ids)

    def fill(self, block: int, token_ids: Sequence[int | None]) -> None:
        """Fill a block just taken with a copy's content (copy-on-write, swap-in)."""
        self.content[block] = list(token_ids)
        self.tokens_stored += len(token_ids)

    def register(self, block: int, parent: bytes, key: bytes) -> None:
        """File a full, written, referenced block under ``key`` (no-op without caching, or
        when the block is already filed, as a block shared by a fork or a hit is)."""
        if self.enable_prefix_caching and self.block_hash[block] is None:
            self._cached.setdefault(key, {})[block] = None
            self.block_hash[block] = key
            self._parent_hash[block] = parent

    def lookup(self, key: bytes) -> int | None:
        """The block registered first under ``key``, or None."""
        blocks = self._cached.get(key)
        return next(iter(blocks)) if blocks else None

    def match_prefix(self, ids: Sequence[int]) -> list[int]:
        """Cached blocks holding ``ids``' leading full blocks, leaving >= 1 token to compute.

        The cap makes a prompt that is a whole number of cached blocks recompute its last
        block (vLLM's ``max_cache_hit_length = num_tokens - 1``, ``kv_cache_manager.py``).
        """
        if not self.enable_prefix_caching:
            return []
        bs = self.block_size
        hits: list[int] = []
        parent = ROOT_HASH
        for start in range(0, (len(ids) - 1) // bs * bs, bs):
            key = chain_hash(parent, ids[start : start + bs])
            block = self.lookup(key)
            if block is None:
                break
            hits.append(block)
            parent = key
        return hits

    def _enqueue(self, block: int) -> None:
        self._free[block] = None
        if self.block_hash[block] is None:
            self._free.move_to_end(block, last=False)
        else:
            self.blocks_cached += 1

    def _unregister(self, block: int) -> None:
        key = self.block_hash[block]
        del self._cached[key][block]
        if not self._cached[key]:
            del self._cached[key]
        self.block_hash[block] = self._parent_hash[block] = None

    def check(self, holders: Counter[int], pins: Counter[int], filling: set[int]) -> None:
        """Recompute the pool's state from the allocator's view; raise on any mismatch.

        Parameters
        ----------
        holders : Counter[int]
            Block -> number of device block tables holding it.
        pins : Counter[int]
            Block -> number of pending copies that read or write it.
        filling : set[int]
            Blocks a pending copy writes into (never registered).

        Raises
        ------
        AllocatorInvariantError
            Naming the broken invariant and the block.
        """
        for block in range(self.num_blocks):
            invariant(self.ref[block] >= 0, f"ref count: block {block} has {self.ref[block]}")
            invariant(
                self.ref[block] == holders[block],
                f"ref count: block {block} has ref {self.ref[block]} but "
                f"{holders[block]} tables hold it",
            )
            invariant(
                self.pins[block] == pins[block],
                f"pin count: block {block} has {self.pins[block]} pins but "
                f"{pins[block]} pending copies use it",
            )
            queued = block in self._free
            invariant(
                queued == (self.ref[block] == 0 and self.pins[block] == 0),
                f"partition: block {block} has ref {self.ref[block]}, "
                f"{self.pins[block]} pins and is {'' if queued else 'not '}in the free queue",
            )
        invariant(
            all(isinstance(b, int) and 0 <= b < self.num_blocks for b in self._free),
            "free queue: holds an invalid block id",
        )
        bs = self.block_size
        entries = [(key, block) for key, blocks in self._cached.items() for block in blocks]
        for key, block in entries:
            invariant(
                self.block_hash[block] == key,
                f"cache entry: key {key.hex()[:12]} points to block {block} whose key differs",
            )
            ids = self.content[block]
            invariant(
                len(ids) == bs
                and None not in ids
                and chain_hash(self._parent_hash[block], ids) == key,
                f"cache entry: block {block} is not full or its content does not hash to "
                f"its key {key.hex()[:12]}",
            )
            invariant(
                block not in filling,
                f"cache entry: block {block} is registered while a copy still writes it",
            )
        keyed = [b for b in range(self.num_blocks) if self.block_hash[b] is not None]
        invariant(
            len(keyed) == len(entries) and all(self._cached.values()),
            f"cache entry: {len(keyed)} blocks carry a key but the cache has "
            f"{len(entries)} entries (or an empty key)",
        )
        used = [b for b in range(self.num_blocks) if self.ref[b] > 0]
        for name, running, recount in (
            ("blocks_used", self.blocks_used, len(used)),
            ("blocks_cached", self.blocks_cached,
             sum(1 for b in self._free if self.block_hash[b] is not None)),
            ("blocks_in_flight", self.blocks_in_flight,
             sum(1 for b in range(self.num_blocks) if self.ref[b] == 0 and self.pins[b])),
            ("tokens_stored", self.tokens_stored, sum(len(self.content[b]) for b in used)),
        ):
            invariant(running == recount, f"accounting: {name} is {running}, recount {recount}")


class HostPool:
    """``num_blocks`` host (swap) blocks: held by swapped-out sequences, pinned by pending
    copies, or free (reused first in, first out).

    Parameters
    ----------
    num_blocks : int
        Already validated by the allocator (>= 0).
    """

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self.content: list[list[int | None]] = [[] for _ in range(num_blocks)]
        self._held = [False] * num_blocks
        self._pins = [0] * num_blocks
        self.filling: set[int] = set()  # host blocks a pending swap-out writes

    @property
    def num_free(self) -> int:
        """Host blocks neither held nor pinned."""
        return len(self._free)

    def take(self) -> int:
        """Hold the oldest free host block (the caller has checked :attr:`num_free`)."""
        host = self._free.popleft()
        self._held[host] = True
        return host

    def release(self, host: int) -> None:
        """Drop the hold; the block is free now, or when its last pin goes."""
        self._held[host] = False
        if not self._pins[host]:
            self._free.append(host)

    def pin(self, host: int) -> None:
        self._pins[host] += 1

    def unpin(self, host: int) -> None:
        self._pins[host] -= 1
        if not self._pins[host] and not self._held[host]:
            self._free.append(host)

    def check(self, held: Counter[int], pins: Counter[int], filling: set[int]) -> None:
        """Recompute the host pool from the allocator's view; raise on any mismatch.

        Parameters
        ----------
        held : Counter[int]
            Host block -> number of swapped-out sequences holding it.
        pins : Counter[int]
            Host block -> number of pending copies that read or write it.
        filling : set[int]
            Host blocks a pending swap-out writes.

        Raises
        ------
        AllocatorInvariantError
            If a host block is held twice, both held (or pinned) and free, or lost.
        """
        free = set(self._free)
        invariant(
            len(free) == len(self._free)
            and all(n == 1 for n in held.values())
            and self.filling == filling
            and all(
                self._held[h] == (h in held)
                and self._pins[h] == pins[h]
                and (h in free) == (h not in held and not pins[h])
                for h in range(self.num_blocks)
            ),
            "host pool: a host block is held twice, both held or pinned and free, or lost",
        )


def invariant(condition: bool, message: str) -> None:
    """Raise :class:`AllocatorInvariantError` with ``message`` unless ``condition``."""
    if not condition:
        raise AllocatorInvariantError(message)
