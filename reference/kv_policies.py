"""KV memory policies of the capacity simulator, behind one protocol (:class:`KVMemory`).

The policies of the vLLM paper's memory argument (Kwon et al., "Efficient Memory Management
for Large Language Model Serving with PagedAttention", SOSP 2023, arXiv 2309.06180,
section 3 and Fig. 2):

``Max``
    Contiguous reservation of ``max_context`` slots per sequence at admission (the
    pre-paging baseline; the paper's "Orca (Max)").
``Pow2``
    Contiguous reservation of the sequence's final length rounded up to a power of two,
    capped at ``max_context`` (the paper's "Orca (Pow2)": output length known within 2x).
``Oracle``
    Contiguous reservation of exactly ``prompt_len + output_len`` (the paper's
    "Orca (Oracle)": output lengths known in advance).
``Paged``
    On-demand blocks of ``block_size`` slots from
    :class:`~pagedbench.reference.allocator.BlockAllocator`; each of the ``n`` samples of a
    request is its own sequence with its own copy of the prompt.
``Paged+share``
    The same allocator with prefix caching (requests with the same ``prefix_id``, or a
    conversation's turns, share the full blocks of their common prefix: vLLM's
    block-hash prefix caching) and the ``n`` samples of a request forked from one
    prompt, with copy-on-write of a shared partial block.
``Radix``
    SGLang's RadixAttention (:mod:`~pagedbench.reference.radix_policy`): a token-granular
    prefix tree over a pool of pages of ``block_size`` tokens (SGLang's ``page_size``; 1 is
    its default), LRU leaf eviction, reference-counted paths.

Contiguous policies are a pool of slots without external fragmentation: any ``R`` free
slots hold an ``R``-slot reservation. That is their best case (the paper's Fig. 2 also
charges them external fragmentation), so their waste here is a lower bound.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from .allocator import BlockAllocator, OutOfBlocksError
from .errors import PagedInputError, PagedValueError, is_integer
from .radix_policy import RadixMemory
from .trace_tokens import TraceTokens
from .workload import Request

#: Block sizes swept by the paged policies (tokens per block; the paper's Fig. 18b and 1).
PAGED_BLOCK_SIZES = (1, 8, 16, 32, 64, 128, 256)
#: Page sizes of the ``Radix`` policy by default: SGLang's default, token granularity.
RADIX_PAGE_SIZES = (1,)
#: Contiguous policies, in table order.
CONTIGUOUS_POLICIES = ("Max", "Pow2", "Oracle")
#: Every policy name.
POLICY_NAMES = (*CONTIGUOUS_POLICIES, "Paged", "Paged+share", "Radix")


class CapacityError(PagedInputError, ValueError):
    """A request can never run under a policy: the KV budget is smaller than it needs
    (``message`` names the request, the policy and both sizes)."""

    def __init__(self, message: str) -> None:
        super().__init__("kv_budget", None, "enough for every request alone", message)


@dataclass(frozen=True)
class Policy:
    """A KV memory policy: how the simulator reserves a request's KV memory (the module
    notes describe each of :data:`POLICY_NAMES`).

    Parameters
    ----------
    name : str
        One of :data:`POLICY_NAMES` (see the module notes).
    block_size : int or None
        Tokens per block for the paged policies, per page for ``Radix`` (>= 1); ``None``
        for contiguous ones.

    Raises
    ------
    PagedValueError
        If ``name`` is unknown, or ``block_size`` is missing for a paged policy or given
        for a contiguous one.
    """

    name: str
    block_size: int | None = None

    def __post_init__(self) -> None:
        if self.name not in POLICY_NAMES:
            raise PagedValueError("policy name", self.name, f"one of {list(POLICY_NAMES)}")
        if self.paged:
            if not is_integer(self.block_size) or self.block_size < 1:
                raise PagedValueError("block_size", self.block_size,
                                      f"an integer >= 1 for policy {self.name}")
        elif self.block_size is not None:
            raise PagedValueError("block_size", self.block_size,
                                  f"None for contiguous policy {self.name}")

    @property
    def paged(self) -> bool:
        """Whether memory comes in blocks (pages) of ``block_size`` tokens."""
        return self.name not in CONTIGUOUS_POLICIES

    @property
    def sharing(self) -> bool:
        return self.name == "Paged+share"

    @property
    def label(self) -> str:
        """``"Max"``, or ``"Paged bs16"`` for a paged policy."""
        return f"{self.name} bs{self.block_size}" if self.paged else self.name


def default_policies(
    block_sizes: Sequence[int] = PAGED_BLOCK_SIZES, sharing: bool = False,
    radix_page_sizes: Sequence[int] = RADIX_PAGE_SIZES,
) -> list[Policy]:
    """``Max``, ``Pow2``, ``Oracle``, then ``Paged`` at each block size, then (if
    ``sharing``) ``Paged+share`` at each block size and ``Radix`` at each of
    ``radix_page_sizes``."""
    policies = [Policy(name) for name in CONTIGUOUS_POLICIES]
    policies += [Policy("Paged", bs) for bs in block_sizes]
    if sharing:
        policies += [Policy("Paged+share", bs) for bs in block_sizes]
        policies += [Policy("Radix", ps) for ps in radix_page_sizes]
    return policies


@dataclass(eq=False)
class LiveRequest:
    """A request the scheduler has taken from the trace.

    Attributes
    ----------
    index : int
        Its position in the trace.
    request : Request
        The request.
    generated : int
        Tokens each sample has generated so far (tokens).
    """

    index: int
    request: Request
    generated: int = 0


class KVMemory(Protocol):
    """What the scheduler asks of a memory policy.

    Attributes
    ----------
    label : str
        The policy's label (``Policy.label``).
    kv_budget_tokens : int
        KV memory in token slots.
    cow_copies : int
        Blocks copied by copy-on-write so far.
    prefix_hit_tokens : int
        Tokens admissions took from a prefix cache so far (not computed).
    """

    label: str
    kv_budget_tokens: int
    cow_copies: int
    prefix_hit_tokens: int

    def admit(self, live: LiveRequest) -> bool:
        """Reserve or allocate the prompt (plus tokens generated before a preemption) of
        every sample, all or nothing; False when it does not fit now."""

    def grow(self, live: LiveRequest, sample: int) -> bool:
        """Store one more token of one sample; False (nothing changed) when it does not fit."""

    def release(self, live: LiveRequest, preempt: bool = False) -> int:
        """Free the request's memory; returns the tokens to recompute when ``preempt``
        (preemption by recomputation), else 0."""

    def sample(self) -> tuple[int, int, int]:
        """``(reserved, tokens, fragmentation)`` token slots now."""


def make_memory(
    policy: Policy, kv_budget_tokens: int, trace: Sequence[Request], max_context: int, seed: int
) -> KVMemory:
    """The :class:`KVMemory` of ``policy`` on a budget of ``kv_budget_tokens`` slots.

    Raises
    ------
    CapacityError
        If the budget holds no block of a paged policy's ``block_size``.
    """
    if policy.paged and kv_budget_tokens < policy.block_size:
        raise CapacityError(f"kv budget of {kv_budget_tokens} tokens holds no block of "
                            f"block_size={policy.block_size}")
    if policy.name == "Radix":
        return RadixMemory(policy.label, policy.block_size, kv_budget_tokens, trace)
    if policy.paged:
        return _PagedMemory(policy, kv_budget_tokens, trace, seed)
    return _ContiguousMemory(policy, kv_budget_tokens, max_context)


class _ContiguousMemory:
    """Slot-counting model of a contiguous reservation policy (no external fragmentation)."""

    def __init__(self, policy: Policy, kv_budget_tokens: int, max_context: int) -> None:
        self.policy = policy
        self.label = policy.label
        self.kv_budget_tokens = kv_budget_tokens
        self.max_context = max_context
        self.free_slots = kv_budget_tokens
        self.reserved = 0
        self.tokens = 0
        self.fragmentation = 0
        self.cow_copies = 0
        self.prefix_hit_tokens = 0
        self._reserved: dict[int, int] = {}  # request index -> slots reserved for it

    def reservation(self, req: Request) -> int:
        """Slots reserved per sample (see the module notes)."""
        if self.policy.name == "Max":
            return self.max_context
        if self.policy.name == "Pow2":
            return min(self.max_context, 1 << (req.total_len - 1).bit_length())
        return req.total_len

    def admit(self, live: LiveRequest) -> bool:
        req = live.request
        per_sample = self.reservation(req)
        need = req.n * per_sample
        if need > self.free_slots:
            return False
        self._reserved[live.index] = need
        self.free_slots -= need
        self.reserved += need
        self.tokens += req.n * (req.prompt_len + live.generated)
        self.fragmentation += req.n * (per_sample - req.total_len)
        return True

    def grow(self, live: LiveRequest, sample: int) -> bool:
        """Always inside the reservation."""
        self.tokens += 1
        return True

    def release(self, live: LiveRequest, preempt: bool = False) -> int:
        """``preempt`` is never set: the reservation covers every token."""
        req = live.request
        reserved = self._reserved.pop(live.index)
        self.free_slots += reserved
        self.reserved -= reserved
        self.tokens -= req.n * (req.prompt_len + live.generated)
        self.fragmentation -= reserved - req.n * req.total_len
        return req.n * (req.prompt_len + live.generated) if preempt else 0

    def sample(self) -> tuple[int, int, int]:
        return self.reserved, self.tokens, self.fragmentation


class _PagedMemory:
    """A paged policy driving :class:`BlockAllocator` (blocks, tables, fork, prefix cache).

    Each allocation is one engine step: reserve the slots, make any copy-on-write copy,
    write the K/V and commit, so nothing is in flight between steps. Token ids matter only
    with prefix caching (:class:`~pagedbench.reference.trace_tokens.TraceTokens`).
    """

    def __init__(
        self, policy: Policy, kv_budget_tokens: int, trace: Sequence[Request], seed: int
    ) -> None:
        assert policy.block_size is not None
        num_blocks = kv_budget_tokens // policy.block_size
        self.label = policy.label
        self.kv_budget_tokens = kv_budget_tokens
        self.sharing = policy.sharing
        self.allocator = BlockAllocator(
            num_blocks, policy.block_size, seed=seed, enable_prefix_caching=self.sharing
        )
        self.cow_copies = 0
        self.prefix_hit_tokens = 0
        self._seq_ids: dict[int, list[tuple[int, int]]] = {}  # request index -> its samples
        self._tokens = TraceTokens(trace)

    def _prompt_tokens(self, live: LiveRequest) -> list[int]:
        return self._tokens.prompt(live.index)

    def _generated_token(self, live: LiveRequest, sample: int) -> int:
        return self._tokens.generated(live.index, sample)

    def _step(self, seq: tuple[int, int], tokens: int | list[int]) -> int:
        """Append ``tokens`` to ``seq`` as one engine step; returns the copies made."""
        alloc = self.allocator
        alloc.append_tokens(seq, tokens)
        copies = alloc.pop_copies()
        if copies:
            alloc.copy_done(copies)
        alloc.commit(seq, alloc.num_tokens(seq))
        return len(copies)

    def admit(self, live: LiveRequest) -> bool:
        req = live.request
        alloc = self.allocator
        seq_ids = self._seq_ids[live.index] = []
        copies = hit = 0
        try:
            if self.sharing:
                first = (live.index, 0)
                prompt = self._prompt_tokens(live)
                if req.n == 1:
                    prompt += [self._generated_token(live, 0)] * live.generated
                seq_ids.append(first)
                hit = alloc.add_sequence(first, prompt)
                alloc.commit(first, len(prompt))
                for k in range(1, req.n):
                    seq_ids.append((live.index, k))
                    alloc.fork(first, (live.index, k))
                if req.n > 1 and live.generated:
                    for k, seq in enumerate(seq_ids):
                        copies += self._step(seq, [self._generated_token(live, k)] * live.generated)
            else:
                for k in range(req.n):
                    seq = (live.index, k)
                    seq_ids.append(seq)
                    alloc.add_sequence(seq)
                    self._step(seq, req.prompt_len + live.generated)
        except OutOfBlocksError:
            for seq in seq_ids:
                if seq in alloc:
                    alloc.free(seq)
            del self._seq_ids[live.index]
            return False
        self.cow_copies += copies
        self.prefix_hit_tokens += hit
        return True

    def grow(self, live: LiveRequest, sample: int) -> bool:
        seq = self._seq_ids[live.index][sample]
        try:
            if self.sharing:
                self.cow_copies += self._step(seq, [self._generated_token(live, sample)])
            else:
                self._step(seq, 1)
        except OutOfBlocksError:
            return False
        return True

    def release(self, live: LiveRequest, preempt: bool = False) -> int:
        """``free`` when finished; ``preempt`` (recomputation) when ``preempt``."""
        alloc = self.allocator
        seq_ids = self._seq_ids.pop(live.index)
        if preempt:
            return sum(alloc.preempt(seq) for seq in seq_ids)
        alloc.free(*seq_ids)
        return 0

    def sample(self) -> tuple[int, int, int]:
        usage = self.allocator.usage()
        return usage.slots_allocated, usage.tokens_stored, usage.fragmentation_slots
