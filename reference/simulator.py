"""KV-capacity simulator: how many requests fit, and how much reserved memory is wasted.

:func:`simulate` replays one request trace (:mod:`~pagedbench.reference.workload`) under one
memory policy (:mod:`~pagedbench.reference.kv_policies`) with continuous batching, and
measures, step by step, the KV memory that holds token state against the memory the policy
reserved: the measurable form of the vLLM paper's memory argument (Kwon et al., SOSP 2023,
arXiv 2309.06180, section 3 and Fig. 2). :func:`compare_policies` runs several policies on
the same trace and budget. The schedule is in :func:`simulate`'s docstring; the waste
accounting in :class:`PolicyResult`'s.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from .errors import PagedValueError
from .kv_policies import CapacityError, KVMemory, LiveRequest, Policy, make_memory
from .workload import DEFAULT_MAX_CONTEXT, Request, validate_trace


@dataclass(frozen=True)
class PolicyResult:
    """What one policy did with one trace and budget.

    Waste accounting, per step, summed over all steps, then divided: ``reserved`` is the
    slots reserved for running requests (contiguous) or the slots of blocks in use
    (paged: ``usage().slots_allocated``; cached blocks nothing references are free
    memory); ``tokens`` the slots holding a token's K/V (a shared block counts once);
    reservation waste the reserved slots the request fills later (contiguous only);
    internal fragmentation the reserved slots that never hold a token (``R -
    (prompt_len + output_len)`` per contiguous sequence; every empty allocated slot for
    paged policies, the paper's section 4.2 convention). ``waste = reserved - tokens =
    reservation waste + internal fragmentation``.

    Attributes
    ----------
    policy : str
        Policy name (:data:`~.kv_policies.POLICY_NAMES`).
    block_size : int or None
        Tokens per block (paged), ``None`` (contiguous).
    num_requests : int
        Requests in the trace.
    steps : int
        Steps from 0 until the last request finished (steps).
    utilization_pct : float
        Slots holding tokens, % of reserved slots, summed over steps (%).
    waste_pct : float
        ``100 - utilization_pct``: reserved slots not holding a token (%).
    reservation_waste_pct : float
        Reserved slots to be filled later, % of reserved (%).
    fragmentation_pct : float
        Reserved slots never filled (internal fragmentation), % of reserved (%).
    mean_reserved_tokens : float
        Reserved token slots averaged over all steps (tokens; times the preset's
        ``kv_bytes_per_token`` gives bytes).
    mean_stored_tokens : float
        Token slots holding a token, averaged over all steps (tokens).
    peak_concurrency : int
        Most requests running at once (requests).
    mean_concurrency : float
        Running requests averaged over all steps (requests).
    waited : int
        Requests not admitted in their arrival step (requests).
    preempted : int
        Requests preempted at least once (requests).
    preemptions : int
        Preemption events (a request may be preempted several times).
    recomputed_tokens : int
        Tokens whose K/V preemption dropped, to be recomputed (tokens; with prefix
        caching, readmission may serve some of them from the cache).
    cow_copies : int
        Blocks copied by copy-on-write (``Paged+share`` only; blocks).
    prefix_hit_tokens : int
        Tokens admissions (readmissions included) took from a prefix cache instead of
        computing them (``Paged+share``, ``Radix``; tokens).
    prefill_tokens : int
        Tokens admissions computed: every admitted request's prompt (and, readmitted,
        what it had generated) less its prefix hit (tokens).
    concurrency_ratio : float or None
        ``mean_concurrency`` over the ``Max`` policy's on the same trace and budget;
        ``None`` when ``Max`` was not run.
    throughput_ratio : float or None
        ``Max`` steps over this policy's steps: requests served per step relative to
        ``Max``, assuming every step takes the same time (memory-bound decode).
    """

    policy: str
    block_size: int | None
    num_requests: int
    steps: int
    utilization_pct: float
    waste_pct: float
    reservation_waste_pct: float
    fragmentation_pct: float
    mean_reserved_tokens: float
    mean_stored_tokens: float
    peak_concurrency: int
    mean_concurrency: float
    waited: int
    preempted: int
    preemptions: int
    recomputed_tokens: int
    cow_copies: int
    prefix_hit_tokens: int
    prefill_tokens: int
    concurrency_ratio: float | None = None
    throughput_ratio: float | None = None


def simulate(
    trace: Sequence[Request],
    policy: Policy,
    kv_budget_tokens: int,
    max_context: int = DEFAULT_MAX_CONTEXT,
    seed: int = 0,
    on_decode: Callable[[Sequence[LiveRequest]], None] | None = None,
) -> PolicyResult:
    """Replay ``trace`` under ``policy`` with continuous batching.

    One iteration per step (vLLM v1's ``Scheduler.schedule``,
    ``vllm/v1/core/sched/scheduler.py``). At step ``s``:

    1. Requests with ``arrival <= s`` join the back of the waiting queue, in trace order
       (a request with a ``parent`` no earlier than the step after its parent finished:
       :class:`_Arrivals`).
    2. Decode (:func:`_decode_step`): every running request, oldest admission first, stores
       the K/V of one new token for each of its ``n`` samples. When a paged append cannot
       get a block, the newest running request is preempted by recomputation (its blocks
       freed, its tokens so far to be recomputed) and put at the front of the waiting
       queue, until the append fits or the request preempts itself (vLLM v1's
       ``running[-1]`` victim, ``prepend_request``). Contiguous policies never preempt.
    3. Admission, skipped in a step that preempted: first come, first served; the head
       of the waiting queue is admitted when the policy can hold its whole prompt for all
       ``n`` samples, and admission stops at the first request that does not fit. A
       prompt enters the cache whole in its admission step (the prefill); a request
       readmitted after preemption enters with the tokens it had generated too.
    4. Memory and concurrency are sampled.
    5. A request whose samples hold ``prompt_len + output_len`` tokens finishes and frees
       its memory before step ``s + 1``.

    A request admitted at step ``a`` and never preempted runs ``output_len + 1`` steps
    and holds ``prompt_len + (s - a)`` tokens per sample at step ``s``. The K/V of every
    prompt and output token is stored (a real engine never writes the last output
    token's; ignoring that one token lets ``Oracle`` reserve exactly what is stored).

    Parameters
    ----------
    trace : Sequence[Request]
        The requests, in trace order (ties in ``arrival`` keep this order).
    policy : Policy
        The memory policy.
    kv_budget_tokens : int
        KV memory in token slots, >= 1 (bytes / ``kv_bytes_per_token``); a paged policy
        gets ``kv_budget_tokens // block_size`` blocks.
    max_context : int
        Longest sequence, prompt + output tokens (``Max`` reserves this per sample).
    seed : int
        Seeds the allocator's block placement (does not change any count).
    on_decode : callable or None
        Called after the decode of every step that decoded something (step 2), with the
        running requests that stored a token: each of their ``n`` samples then holds
        ``prompt_len + generated`` tokens (the kernel batch of that step;
        ``pagedbench tune`` times it).

    Returns
    -------
    PolicyResult
        With ``concurrency_ratio`` and ``throughput_ratio`` left ``None`` (see
        :func:`compare_policies`).

    Raises
    ------
    TraceError
        If the trace is empty or a request exceeds ``max_context``.
    CapacityError
        If some request can never run: it does not fit the budget with nothing else
        running.
    PagedValueError
        If ``kv_budget_tokens`` < 1.
    """
    if kv_budget_tokens < 1:
        raise PagedValueError("kv_budget_tokens", kv_budget_tokens, ">= 1")
    validate_trace(trace, max_context)
    memory = make_memory(policy, kv_budget_tokens, trace, max_context, seed)

    pending = _Arrivals(trace)
    waiting: deque[LiveRequest] = deque()
    running: list[LiveRequest] = []
    preempted: set[int] = set()
    waited = preemptions = recomputed = admitted_tokens = 0
    sum_reserved = sum_tokens = sum_frag = sum_running = 0
    peak = 0
    step = 0
    while pending or waiting or running:
        if not waiting and not running and pending.next_step() > step:
            step = pending.next_step()  # idle steps: nothing held, nothing running
        waiting.extend(pending.release(step))

        victims = _decode_step(running, memory)
        for victim, tokens in victims:
            recomputed += tokens
            preemptions += 1
            preempted.add(victim.index)
            waiting.appendleft(victim)
        if on_decode is not None and running:
            on_decode(running)

        if not victims:
            while waiting and memory.admit(waiting[0]):
                live = waiting.popleft()
                if live.index not in preempted and step > pending.ready[live.index]:
                    waited += 1
                admitted_tokens += live.request.prompt_len + live.generated
                running.append(live)
            if waiting and not running:
                raise _cannot_run_alone(waiting[0], memory)

        reserved, tokens, frag = memory.sample()
        sum_reserved += reserved
        sum_tokens += tokens
        sum_frag += frag
        sum_running += len(running)
        peak = max(peak, len(running))
        step += 1

        finished = [live for live in running if live.generated == live.request.output_len]
        for live in finished:
            memory.release(live)
            pending.finished(live.index, step)
        if finished:
            running = [live for live in running if live.generated < live.request.output_len]

    waste = sum_reserved - sum_tokens
    pct = (lambda x: 100.0 * x / sum_reserved) if sum_reserved else (lambda x: 0.0)
    return PolicyResult(
        policy=policy.name,
        block_size=policy.block_size,
        num_requests=len(trace),
        steps=step,
        utilization_pct=pct(sum_tokens),
        waste_pct=pct(waste),
        reservation_waste_pct=pct(waste - sum_frag),
        fragmentation_pct=pct(sum_frag),
        mean_reserved_tokens=sum_reserved / step,
        mean_stored_tokens=sum_tokens / step,
        peak_concurrency=peak,
        mean_concurrency=sum_running / step,
        waited=waited,
        preempted=len(preempted),
        preemptions=preemptions,
        recomputed_tokens=recomputed,
        cow_copies=memory.cow_copies,
        prefix_hit_tokens=memory.prefix_hit_tokens,
        prefill_tokens=admitted_tokens - memory.prefix_hit_tokens,
    )


class _Arrivals:
    """The requests not yet released to the waiting queue (step 1 of :func:`simulate`).

    A request without a ``parent`` is released at its ``arrival``; one with a parent
    waits for it, then is released at ``max(arrival, the step after the parent's last)``.
    Ties keep trace order. ``ready[i]``: the step request ``i`` was released at.
    """

    def __init__(self, trace: Sequence[Request]) -> None:
        self.trace = trace
        self._heap = [(r.arrival, i) for i, r in enumerate(trace) if r.parent is None]
        heapq.heapify(self._heap)
        self._children: dict[int, list[int]] = {}
        for i, r in enumerate(trace):
            if r.parent is not None:
                self._children.setdefault(r.parent, []).append(i)
        self.ready: dict[int, int] = {}
        self._blocked = len(trace) - len(self._heap)

    def __bool__(self) -> bool:
        return bool(self._heap) or self._blocked > 0

    def next_step(self) -> int:
        """The step the next request is released at (a large number while every
        pending request waits for a running parent)."""
        return self._heap[0][0] if self._heap else 2**62

    def release(self, step: int) -> list[LiveRequest]:
        """Pop the requests released by ``step``, in (step, trace) order."""
        released = []
        while self._heap and self._heap[0][0] <= step:
            _, index = heapq.heappop(self._heap)
            self.ready[index] = step
            released.append(LiveRequest(index, self.trace[index]))
        return released

    def finished(self, index: int, step: int) -> None:
        """Request ``index`` finished before ``step``: its children become pending."""
        for child in self._children.pop(index, ()):
            heapq.heappush(self._heap, (max(self.trace[child].arrival, step), child))
            self._blocked -= 1


def _decode_step(running: list[LiveRequest], memory: KVMemory) -> list[tuple[LiveRequest, int]]:
    """Grow every running request by one token per sample, oldest first (step 2).

    When a sample cannot grow, the newest running request is preempted (removed from
    ``running`` and released for recomputation) and the sample tries again, until it
    grows or its own request was the one preempted.

    Returns
    -------
    list[tuple[LiveRequest, int]]
        The preempted requests in preemption order, each with the tokens it must
        recompute; empty when nothing was preempted.

    Raises
    ------
    CapacityError
        If a request cannot grow with nothing else running.
    """
    victims: list[tuple[LiveRequest, int]] = []
    index = 0
    while index < len(running):
        live = running[index]
        if _grow_samples(live, running, memory, victims):
            live.generated += 1
            index += 1
    return victims


def _grow_samples(
    live: LiveRequest,
    running: list[LiveRequest],
    memory: KVMemory,
    victims: list[tuple[LiveRequest, int]],
) -> bool:
    """One token for each sample of ``live``, preempting the newest running requests into
    ``victims`` as needed; False when ``live`` itself was preempted."""
    for sample in range(live.request.n):
        while not memory.grow(live, sample):
            victim = running.pop()
            if victim is live and not running:
                raise _cannot_run_alone(live, memory)
            victims.append((victim, memory.release(victim, preempt=True)))
            if victim is live:
                return False
    return True


def _cannot_run_alone(live: LiveRequest, memory: KVMemory) -> CapacityError:
    req = live.request
    return CapacityError(
        f"request {live.index} (prompt_len={req.prompt_len}, output_len={req.output_len}, "
        f"n={req.n}) cannot run alone under policy {memory.label} with "
        f"kv_budget_tokens={memory.kv_budget_tokens}"
    )


def compare_policies(
    trace: Sequence[Request],
    policies: Sequence[Policy],
    kv_budget_tokens: int,
    max_context: int = DEFAULT_MAX_CONTEXT,
    seed: int = 0,
) -> list[PolicyResult]:
    """:func:`simulate` every policy on the same trace and budget, with ratios to ``Max``.

    ``concurrency_ratio`` and ``throughput_ratio`` are set relative to the ``Max`` result
    when ``Max`` is among ``policies`` (else they stay ``None``).

    Returns
    -------
    list[PolicyResult]
        One per policy, in the order given.

    Raises
    ------
    TraceError, CapacityError, PagedValueError
        As :func:`simulate`.
    """
    results = [simulate(trace, p, kv_budget_tokens, max_context, seed) for p in policies]
    base = next((r for r in results if r.policy == "Max"), None)
    if base is None:
        return results
    return [
        replace(
            r,
            concurrency_ratio=r.mean_concurrency / base.mean_concurrency,
            throughput_ratio=base.steps / r.steps,
        )
        for r in results
    ]


def budget_tokens_from_bytes(kv_budget_bytes: int, kv_bytes_per_token: int) -> int:
    """Token slots that ``kv_budget_bytes`` of KV memory holds: ``floor(budget / per_token)``.

    Parameters
    ----------
    kv_budget_bytes : int
        KV memory (bytes), >= 1.
    kv_bytes_per_token : int
        K and V bytes per token over all layers (bytes), >= 1:
        ``2 * num_layers * num_kv_heads * head_dim * dtype_bytes``.

    Raises
    ------
    PagedValueError
        If either is < 1, or the budget holds no token.
    """
    if kv_budget_bytes < 1:
        raise PagedValueError("kv_budget_bytes", kv_budget_bytes, ">= 1")
    if kv_bytes_per_token < 1:
        raise PagedValueError("kv_bytes_per_token", kv_bytes_per_token, ">= 1")
    tokens = kv_budget_bytes // kv_bytes_per_token
    if tokens < 1:
        raise PagedValueError(
            "kv_budget_bytes", kv_budget_bytes, "at least kv_bytes_per_token",
            f"a kv budget of {kv_budget_bytes} bytes holds no token at "
            f"{kv_bytes_per_token} bytes per token"
        )
    return tokens
