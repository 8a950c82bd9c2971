"""A token-granular prefix tree over a paged KV pool: RadixAttention's cache as a policy.

SGLang keeps every cached token sequence in a radix tree (Zheng et al., "SGLang:
Efficient Execution of Structured Language Model Programs", NeurIPS 2024, section 3;
``sglang/srt/mem_cache/radix_cache.py``): a node holds a run of token ids and their KV
slots, children are keyed by their first page of ids, a lookup walks the longest cached
prefix (splitting a node where a match ends inside it), a running request locks its
path (reference counts up to the root), and eviction frees unlocked leaves least
recently used first, a parent becoming a leaf in its turn. With ``page_size > 1`` keys
are cut to whole pages (``RadixKey.page_aligned``), so a match and an insert cover
``floor(n / page_size) * page_size`` tokens.

:class:`RadixTree` is that structure with token counts instead of slot tensors (pages of
``page_size`` tokens are what a pool holds); time is a logical clock, one tick per call,
so ties never depend on the host. Host-only Python, no torch.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

from .errors import PagedValueError, is_integer


@dataclass(eq=False)
class RadixNode:
    """One node: ``key`` (token ids, a whole number of pages but at the root), its
    children by their first page, the parent, the requests locking it, its last access."""

    key: tuple[int, ...] = ()
    children: dict[tuple[int, ...], RadixNode] = field(default_factory=dict)
    parent: RadixNode | None = None
    lock_ref: int = 0
    last_access: int = 0

    def __lt__(self, other: RadixNode) -> bool:
        return self.last_access < other.last_access


class RadixTree:
    """The cached token sequences of a pool (module docstring).

    Parameters
    ----------
    page_size : int
        Tokens per page, >= 1 (SGLang's ``--page-size``; 1 is its default).

    Raises
    ------
    PagedValueError
        If ``page_size`` is not an int >= 1.
    """

    def __init__(self, page_size: int = 1) -> None:
        if not is_integer(page_size) or page_size < 1:
            raise PagedValueError("page_size", page_size, "an int >= 1")
        self.page_size = int(page_size)
        self.root = RadixNode(lock_ref=1)
        self.evictable_tokens = 0  # in nodes no request locks
        self.protected_tokens = 0  # in nodes some request locks
        self._clock = itertools.count(1)

    @property
    def total_tokens(self) -> int:
        """Tokens the tree holds (each node's key once)."""
        return self.evictable_tokens + self.protected_tokens

    def aligned(self, n: int) -> int:
        """``n`` rounded down to whole pages."""
        return n - n % self.page_size

    def _child_key(self, tokens: Sequence[int], start: int) -> tuple[int, ...]:
        return tuple(tokens[start:start + self.page_size])

    def match(self, tokens: Sequence[int], limit: int | None = None) -> tuple[int, RadixNode]:
        """The longest cached prefix of ``tokens[:limit]``, page-aligned: its length and
        its last node (the root for none). A match ending inside a node splits it there,
        and every node on the path is touched (its last access is now).

        ``limit`` caps the match (SGLang matches at most ``len(prompt) - 1`` tokens, so
        that one is always computed for its logits, ``Req._compute_max_prefix_len``).
        """
        end = self.aligned(len(tokens) if limit is None else min(limit, len(tokens)))
        now = next(self._clock)
        node, matched = self.root, 0
        node.last_access = now
        while matched < end:
            child = node.children.get(self._child_key(tokens, matched))
            if child is None:
                break
            child.last_access = now
            common = self._common(child.key, tokens, matched, end)
            if common < len(child.key):
                node, matched = self._split(child, common), matched + common
                break
            node, matched = child, matched + common
        return matched, node

    def _common(self, key: tuple[int, ...], tokens: Sequence[int], start: int, end: int) -> int:
        """Whole pages of ``key`` equal to ``tokens[start:end]``'s start."""
        n = 0
        limit = min(len(key), end - start)
        while n < limit and key[n] == tokens[start + n]:
            n += 1
        return self.aligned(n)

    def _split(self, child: RadixNode, at: int) -> RadixNode:
        """Cut ``child``'s key at ``at`` (whole pages): a new node holds the first part
        and takes ``child``'s place; it inherits its locks and access time."""
        parent = child.parent
        head = RadixNode(key=child.key[:at], parent=parent, lock_ref=child.lock_ref,
                         last_access=child.last_access)
        parent.children[child.key[:self.page_size]] = head
        child.key = child.key[at:]
        child.parent = head
        head.children[child.key[:self.page_size]] = child
        return head

    def insert(self, tokens: Sequence[int]) -> int:
        """Cache ``tokens``' whole pages; returns how many of them were cached already
        (their slots the caller frees as duplicates, as ``RadixCache.insert``'s
        ``prefix_len`` is used). The new node is unlocked (evictable)."""
        end = self.aligned(len(tokens))
        matched, node = self.match(tokens, end)
        if matched < end:
            new = RadixNode(key=tuple(tokens[matched:end]), parent=node,
                            last_access=next(self._clock))
            node.children[new.key[:self.page_size]] = new
            self.evictable_tokens += len(new.key)
        return matched

    def lock(self, node: RadixNode) -> None:
        """A request holds the path from ``node`` to the root (``inc_lock_ref``)."""
        while node is not self.root:
            if node.lock_ref == 0:
                self.evictable_tokens -= len(node.key)
                self.protected_tokens += len(node.key)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: RadixNode) -> None:
        """Release a hold taken by :meth:`lock` on ``node`` (``dec_lock_ref``)."""
        while node is not self.root:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.evictable_tokens += len(node.key)
                self.protected_tokens -= len(node.key)
            node = node.parent

    def evict(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` tokens if the unlocked leaves hold them: least
        recently used leaf first, a parent left childless and unlocked joining the
        candidates (``RadixCache.evict``); returns the tokens freed."""
        heap = [node for node in self._nodes() if not node.children and node.lock_ref == 0]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            leaf = heapq.heappop(heap)
            parent = leaf.parent
            del parent.children[leaf.key[:self.page_size]]
            freed += len(leaf.key)
            self.evictable_tokens -= len(leaf.key)
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, parent)
        return freed

    def _nodes(self) -> list[RadixNode]:
        nodes, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            nodes.append(node)
            stack.extend(node.children.values())
        return nodes

    def check(self) -> None:
        """Recompute the counts from the nodes; raise ``AssertionError`` on a mismatch
        (a node's lock count against its children's, key lengths, the totals)."""
        evictable = protected = 0
        for node in self._nodes():
            assert node.key and len(node.key) % self.page_size == 0, f"key {node.key[:4]}"
            assert node.parent.children[node.key[:self.page_size]] is node, "child key"
            assert node.lock_ref >= sum(c.lock_ref for c in node.children.values()), "locks"
            if node.lock_ref:
                protected += len(node.key)
            else:
                evictable += len(node.key)
        assert (evictable, protected) == (self.evictable_tokens, self.protected_tokens), (
            f"counts {(self.evictable_tokens, self.protected_tokens)}, recount "
            f"{(evictable, protected)}")


__all__ = ["RadixNode", "RadixTree"]
