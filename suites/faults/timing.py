"""Timing cheats: kernels whose every output is right when it is read, but whose timed call
does not do the work it is timed for. Each returns what an evaluator's reward-hacking
catalogue lists (KernelBench's adversarial evals, the field guides of
https://www.wafer.ai/blog/reward-hacks-field-guide): an output cached per input object or
while sampled cache values stay the same, work done in ``prepare``, work left to a thread
after the call returns.

None is wrong on a fresh call, so the outputs of a check alone never fail them; the timed
calls do: pagedbench writes new Q (and, before calls the implementation cannot predict,
new K/V) into the same buffers before every timed call and judges the outputs of calls
drawn among them as soon as they return (``harness/verdict/conformance.py``'s ``timed``;
the property ``test_timed_calls_are_the_judged_calls``). Each class is
:class:`~.kernel.PagedKernel` with its call wrapped.
"""

from __future__ import annotations

import threading

import torch

from pagedbench.adapters.base import Prepared
from pagedbench.reference import PagedInputs

from .kernel import PagedKernel

#: Seconds :class:`DeferredToThread`'s thread waits before its work: a thread started at
#: once may hold the interpreter until it is done (a switch interval is 5 ms), so that the
#: output happens to be ready when the call returns, and the fault would show by chance.
DEFER_S = 0.02
#: Live slots whose K and V :class:`SampledCacheMemo` compares between calls.
SAMPLED_SLOTS = 64


class MemoPerInput(PagedKernel):
    """Computes once per query tensor (kept alive, so its id is never reused) and returns
    the stored output for that tensor after: the "cached output" hack of KernelBench's
    adversarial evals (ScalingIntelligence/KernelBench test_eval_adversarial.py), timed
    at a memo lookup."""

    name = "fault-memo-per-input"
    imitates = "ScalingIntelligence/KernelBench test_eval_adversarial.py"
    trigger = "new values in the same query buffer between calls"

    def __init__(self) -> None:
        self._memo: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def prepare(self, inputs: PagedInputs) -> Prepared:
        inner = super().prepare(inputs)

        def call() -> torch.Tensor:
            key = id(inputs.q)
            if key in self._memo:
                self.fired()
                return self._memo[key][1]
            self._memo[key] = (inputs.q, inner.call())  # the tensor, kept alive, and its output
            return self._memo[key][1]
        return Prepared(call, lse=inner.lse)


class SampledCacheMemo(PagedKernel):
    """Keeps its last output with a copy of the K and V of :data:`SAMPLED_SLOTS` live
    slots (spread over ``slot_mapping``) and returns that output while they are
    unchanged: the "cached output" of wafer.ai reward-hacks-field-guide, checked against
    the cache alone, as if new inputs always came with a new cache. Right on every call
    that new K and V precede, wrong on one with new Q alone; timed at the comparison."""

    name = "fault-memo-sampled-cache"
    imitates = "wafer.ai reward-hacks-field-guide"
    trigger = "new values in the same query buffer, the cache unchanged"

    def prepare(self, inputs: PagedInputs) -> Prepared:
        inner = super().prepare(inputs)
        at = torch.linspace(0, inputs.slot_mapping.numel() - 1, SAMPLED_SLOTS).long()
        slots = inputs.slot_mapping[at]
        block_size = inputs.case.block_size
        kept: list[torch.Tensor] = []

        def call() -> torch.Tensor:
            sampled = inputs.kv_cache[slots // block_size, :, slots % block_size].clone()
            if kept and torch.equal(sampled, kept[0]):
                self.fired()
                return kept[1]
            kept[:] = [sampled, inner.call()]
            return kept[1]
        return Prepared(call, lse=inner.lse)


class LazyOutput(PagedKernel):
    """Its first call computes; each later call returns at once its output buffer as a
    tensor subclass and leaves the work to the first torch operation anyone does on it:
    right whenever the output is read, timed at a return. The lazy tensor subclasses of
    ScalingIntelligence/KernelBench kernel_static_checker.py (``_make_subclass``)."""

    name = "fault-lazy-output"
    imitates = "ScalingIntelligence/KernelBench kernel_static_checker.py"
    trigger = "an output that is not a plain tensor, its work left until it is read"

    class Pending(torch.Tensor):
        """An output whose ``work`` runs at the first torch operation on it."""

        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            for arg in args:
                work = getattr(arg, "work", None) if isinstance(arg, cls) else None
                if work is not None:
                    arg.work = None
                    work()
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))

    def prepare(self, inputs: PagedInputs) -> Prepared:
        inner = super().prepare(inputs)
        out: list[torch.Tensor] = []

        def call() -> torch.Tensor:
            if not out:
                out.append(inner.call())
                return out[0]
            self.fired()
            pending = out[0].as_subclass(self.Pending)
            pending.work = lambda: out[0].copy_(inner.call())
            return pending
        return Prepared(call, lse=inner.lse)


class WorkInPrepare(PagedKernel):
    """Computes the whole output in ``prepare`` (untimed); ``run`` returns it: work outside
    the timed call, the "precomputed output" pattern of reward-hacking field guides
    (wafer.ai reward-hacks-field-guide), timed at a return."""

    name = "fault-work-in-prepare"
    imitates = "wafer.ai reward-hacks-field-guide"
    trigger = "new values in the same input buffers after prepare"

    def prepare(self, inputs: PagedInputs) -> Prepared:
        inner = super().prepare(inputs)
        out = inner.call()
        calls = [0]

        def call() -> torch.Tensor:
            calls[0] += 1
            if calls[0] > 1:  # a call that can follow new inputs
                self.fired()
            return out
        return Prepared(call, lse=inner.lse)


class DeferredToThread(PagedKernel):
    """Its first call computes synchronously; each later call returns the output buffer at
    once and leaves the work to a thread that writes it :data:`DEFER_S` later (as a
    worker batching its queue would): correct whenever the buffer is read late enough,
    timed at a thread start. Imitates the thread-injection hack of deep-reinforce's
    defence table (deep-reinforce.com defense_kernel_hack)."""

    name = "fault-deferred-to-thread"
    imitates = "deep-reinforce.com defense_kernel_hack"
    trigger = "an output read as soon as the call returns, after new inputs"

    def prepare(self, inputs: PagedInputs) -> Prepared:
        inner = super().prepare(inputs)
        out: list[torch.Tensor] = []

        def work() -> None:
            out[0].copy_(inner.call())

        def call() -> torch.Tensor:
            if not out:
                out.append(inner.call())
                return out[0]
            self.fired()
            timer = threading.Timer(DEFER_S, work)
            timer.daemon = True
            timer.start()
            return out[0]
        return Prepared(call, lse=inner.lse)


__all__ = ["DeferredToThread", "LazyOutput", "MemoPerInput", "SampledCacheMemo",
           "WorkInPrepare"]
