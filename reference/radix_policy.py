"""The ``Radix`` KV policy: SGLang's RadixAttention cache driven by the capacity simulator.

The pool holds ``kv_budget_tokens // page_size`` pages; each page is either in the tree
(:class:`~pagedbench.reference.radix_tree.RadixTree`, whose keys are whole pages) or
private to one sample of a running request, or free. The calls follow SGLang's
scheduler (``srt/managers/schedule_batch.py``, ``srt/mem_cache/common.py``):

- admission: match the prompt (at most ``len - 1`` tokens, page-aligned), lock the
  matched path, allocate the rest (evicting unlocked leaves, least recently used first,
  when the pool is short), then insert the prompt's whole pages into the tree after the
  prefill (its ``checkpoint``) and lock that path instead: later requests share it while
  this one runs. The prompt's partial last page, and every sample's own tokens, stay
  private; ``n`` samples share the prompt as SGLang's parallel samples do, through the
  tree;
- decode: a sample takes a new private page when its last one is full;
- finish: each sample's whole sequence goes into the tree (its pages not cached yet move
  there, duplicates and partial pages are freed) and the path is unlocked
  (``release_kv_cache(..., checkpoint=True)``);
- preemption: private pages freed and the path unlocked without inserting the generated
  tokens (SGLang's retraction, ``checkpoint=False``); readmission matches what the tree
  still holds.

Reserved memory is the pages of locked tree nodes (once, however many requests share
them) and private pages; evictable tree pages count as free, as cached blocks do for
``Paged+share``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from .radix_tree import RadixNode, RadixTree
from .trace_tokens import TraceTokens
from .workload import Request


@dataclass
class _Running:
    """A running request: its locked node, the tree-owned length of its sequences, and
    each sample's length."""

    node: RadixNode
    tree_len: int
    lengths: list[int] = field(default_factory=list)


class RadixMemory:
    """:class:`~pagedbench.reference.kv_policies.KVMemory` of the ``Radix`` policy
    (module docstring). ``live`` arguments are the simulator's ``LiveRequest``s.

    Parameters
    ----------
    label : str
        The policy's label.
    page_size : int
        Tokens per page, >= 1.
    kv_budget_tokens : int
        KV memory in token slots, at least one page.
    trace : Sequence[Request]
        The trace (for its token ids, :class:`~pagedbench.reference.trace_tokens.TraceTokens`).
    """

    def __init__(self, label: str, page_size: int, kv_budget_tokens: int,
                 trace: Sequence[Request]) -> None:
        self.label = label
        self.kv_budget_tokens = kv_budget_tokens
        self.page_size = page_size
        self.num_pages = kv_budget_tokens // page_size
        self.tree = RadixTree(page_size)
        self.tokens = TraceTokens(trace)
        self.cow_copies = 0
        self.prefix_hit_tokens = 0
        self._running: dict[int, _Running] = {}
        self._private = 0  # private pages of all running samples

    # Pages -----------------------------------------------------------------------------
    def _private_pages(self, length: int, tree_len: int) -> int:
        return -(-(length - tree_len) // self.page_size)

    @property
    def free_pages(self) -> int:
        """Pages neither in the tree nor private to a sample."""
        return self.num_pages - self.tree.total_tokens // self.page_size - self._private

    def _reserve(self, pages: int) -> bool:
        """Whether ``pages`` are free, after evicting unlocked leaves if needed."""
        short = pages - self.free_pages
        if short > 0:
            self.tree.evict(short * self.page_size)
        return pages <= self.free_pages

    # KVMemory --------------------------------------------------------------------------
    def _samples(self, live) -> list[list[int]]:
        """Each sample's tokens at admission: the prompt and what it had generated."""
        req = live.request
        return [self.tokens.sequence(live.index, k, live.generated) for k in range(req.n)]

    def admit(self, live) -> bool:
        req = live.request
        samples = self._samples(live)
        base = samples[0] if req.n == 1 else samples[0][:req.prompt_len]
        hit, _ = self.tree.match(base, len(base) - 1)
        tree_len = self.tree.aligned(len(base))
        cached, node = self.tree.match(base, tree_len)  # the hit and what the insert reuses
        self.tree.lock(node)
        private = sum(self._private_pages(len(s), tree_len) for s in samples)
        if not self._reserve((tree_len - cached) // self.page_size + private):
            self.tree.unlock(node)
            return False
        self.tree.insert(base)
        _, last = self.tree.match(base, tree_len)
        self.tree.lock(last)
        self.tree.unlock(node)
        self._running[live.index] = _Running(last, tree_len, [len(s) for s in samples])
        self._private += private
        self.prefix_hit_tokens += hit
        return True

    def grow(self, live, sample: int) -> bool:
        running = self._running[live.index]
        if (running.lengths[sample] - running.tree_len) % self.page_size == 0:
            if not self._reserve(1):
                return False
            self._private += 1
        running.lengths[sample] += 1
        return True

    def release(self, live, preempt: bool = False) -> int:
        running = self._running.pop(live.index)
        self._private -= sum(self._private_pages(n, running.tree_len) for n in running.lengths)
        if not preempt:
            for k in range(live.request.n):
                self.tree.insert(self.tokens.sequence(live.index, k, live.generated))
        self.tree.unlock(running.node)
        return sum(running.lengths) if preempt else 0

    def sample(self) -> tuple[int, int, int]:
        private = [(self._private_pages(n, r.tree_len), n - r.tree_len)
                   for r in self._running.values() for n in r.lengths]
        protected = self.tree.protected_tokens
        reserved = protected + self.page_size * sum(pages for pages, _ in private)
        tokens = protected + sum(count for _, count in private)
        return reserved, tokens, reserved - tokens


__all__ = ["RadixMemory"]
