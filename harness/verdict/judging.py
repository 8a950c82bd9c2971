"""The judge's side of a conformance check (``conformance.py`` has the implementation's
side): :class:`CaseJudge` answers each message of the implementation's side with one
handler per message type. It computes the truth before the implementation draws its
inputs (so nothing the adapter does reaches it), compares the output (and the LSE of an
implementation that returns one) under the tolerance policy, plans the new inputs written
into the buffers before every timed call and which calls it judges, judges those calls'
outputs, refuses a timing whose calls cannot fit in the wall time it took, whose
process used more cores than the run grants, or kept computing after its last call
returned, and concludes a :class:`Verdict`,
the one result type from the check to the results line.
"""

from __future__ import annotations

import math
import os
import random
import time
import traceback
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from pagedbench.reference import PagedCase, materialize

from pagedbench.harness.verdict import tolerance
from pagedbench.harness.verdict.comparison import Checked, Comparison
from pagedbench.harness.verdict.messages import (Concluded, Go, Message, Output, Ready, TimeIt,
                                                 Timed, Watched, decode, lse_shape,
                                                 output_shape, split_payload)
from pagedbench.harness.verdict.status import Status
from pagedbench.harness.verdict.truth import (TimedCall, compute_device_truth, compute_truth,
                                              judging_state)
from pagedbench.harness.verdict.truth_sites import TRUTH_SITES

#: Timed calls judged in one timing: a uniform sample of this many among all its calls
#: (:class:`Reservoir`), so an implementation that skips the work of a share ``f`` of
#: its calls is caught with probability ``1 - (1 - f) ** JUDGED`` (0.94 for half); each
#: judged call costs the judge one truth (docs/trust.md).
JUDGED = 4
#: Most calls before which new K and V are written in one timing (:func:`kv_calls`).
MOST_KV_CALLS = 4
#: Seconds the judge watches the implementation's process after its timing: it must use
#: at most :data:`IDLE_CPU_SHARE` of one core then (no thread still computing).
IDLE_WINDOW_S = 0.1
IDLE_CPU_SHARE = 0.5
#: A CPU timing's process (and its descendants) may use at most this many times the
#: threads the run grants, over the wall time of the timing, plus :data:`CPU_READ_SLACK_S`
#: (``/proc`` counts CPU in clock ticks of 10 ms, read twice); what the built-ins used,
#: measured: docs/trust.md.
CORES_SLACK = 1.1
CPU_READ_SLACK_S = 0.05
#: Timing methods whose samples are not calls on new inputs (a CUDA graph's replays: the
#: inputs it captured): new inputs come before the pre-roll's first call and each cold
#: sample only.
REPLAYED_METHODS = frozenset({"cuda_graph"})

#: ``truth(case, *, logits_precision, with_lse, timed_call) -> Expected``.
Truth = Callable[..., tolerance.Expected]
#: ``device_truth(inputs, *, logits_precision, with_lse) -> Expected``.
DeviceTruth = Callable[..., tolerance.Expected]
#: CPU seconds each process of the implementation has used so far, keyed by an identity
#: of the process that is never reused (the runner's: ``(pid, start time)``).
CpuReading = Mapping[Hashable, float]


class Refused(Exception):
    """A message the judge cannot accept now (the implementation's fault)."""


def describe_exception(exc: BaseException) -> str:
    """``Type: message (file:line)`` of where ``exc`` was raised."""
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" ({Path(frames[-1].filename).name}:{frames[-1].lineno})" if frames else ""
    return f"{type(exc).__name__}: {exc}{where}"


@dataclass(frozen=True)
class Verdict:
    """The outcome of one adapter on one case, from the check to the results line.

    Attributes
    ----------
    status : Status
    reason : str
        Why, for anything but ``pass``.
    step : str or None
        The step a non-pass outcome arose in.
    comparison : Comparison or None
        The output's figures, once compared.
    lse : Checked or None
        The log-sum-exp's, for an implementation that returns it.
    tail_poison, logits_precision : str or None
        What the implementation declared (``"nan"``/``"stale"``, ``"float32"``/``"case"``).
    truth_site : str or None
        Where the truth was computed (``"host"`` or ``"device"``), once it was.
    details : dict
        What ``describe()`` returned (JSON data).
    nan_tail_output_finite : bool or None
        For a ``stale`` pass: whether the output stays finite with NaN tails after all.
    timing : Timed or None
        The timing of a pass whose timed calls were checked.
    exception : BaseException or None
        What the adapter raised (in this process only, for pytest's traceback).
    """

    status: Status
    reason: str = ""
    step: str | None = None
    comparison: Comparison | None = None
    lse: Checked | None = None
    tail_poison: str | None = None
    logits_precision: str | None = None
    truth_site: str | None = None
    details: dict[str, Any] = field(default_factory=dict)
    nan_tail_output_finite: bool | None = None
    timing: Timed | None = None
    exception: BaseException | None = None


def judged_here(work: Callable[[], Any], what: str) -> Any:
    """How the judge runs its own computations by default: ``work()`` under
    :func:`~.truth.judging_state` (the runner adds its harness time budget)."""
    with judging_state():
        return work()


def harness_fault(step: str, exc: BaseException) -> Verdict:
    """pagedbench's own ``harness-error`` in ``step``: past its budget (``TimeoutError``)
    or raised."""
    if isinstance(exc, TimeoutError):
        return Verdict(Status.HARNESS_ERROR, f"pagedbench's {step}: {exc}; not the "
                       "implementation's fault", step)
    return Verdict(Status.HARNESS_ERROR, f"pagedbench's {step} failed, not the "
                   f"implementation: {describe_exception(exc)}", step, exception=exc)


def cu_seqlens_q(case: PagedCase) -> torch.Tensor:
    """``Tensor[batch + 1]``, int64: the row ranges of ``case``'s sequences."""
    bounds = [0]
    for q_len in case.q_lens_or_decode:
        bounds.append(bounds[-1] + q_len)
    return torch.tensor(bounds)


class CaseJudge:
    """The judge's side of one case (see the module docstring): :meth:`handle` answers
    each message of the implementation's side and, once the case is concluded, sets
    :attr:`verdict`.

    Parameters
    ----------
    case, device : PagedCase, str
    site : str
        Where the truth is computed: ``"host"`` (``truth``) or ``"device"``
        (``device_truth`` of inputs drawn on ``device``; their timed calls are not
        refreshed, a second pool on the device being what such a point cannot afford).
    truth, device_truth : callable
        ``truth(case, logits_precision, with_lse=..., timed_call=...)`` and
        ``device_truth(inputs, logits_precision, with_lse=...)``.
    timing : bool
        Ask for the timing of a pass.
    samples : int
        The timed samples a timing takes at least.
    rng : random.Random
        Draws the timing's seed and its judged calls (the implementation cannot know).
    work : callable
        ``work(fn, what)`` runs the judge's computations (:func:`judged_here`; the
        runner's adds a time budget and raises ``TimeoutError`` past it).
    cpu_seconds : callable
        A :data:`CpuReading` of the implementation's process and its descendants (user +
        system).
    threads : int, optional
        The CPU threads the run grants the implementation: a CPU timing whose process used
        more cores than that over its wall time is refused. None: not checked (the
        implementation shares the judge's process).
    """

    def __init__(self, case: PagedCase, device: str, *, site: str = "host",
                 truth: Truth = compute_truth, device_truth: DeviceTruth = compute_device_truth,
                 timing: bool = False, samples: int = 1, rng: random.Random | None = None,
                 work: Callable[[Callable[[], Any], str], Any] = judged_here,
                 cpu_seconds: Callable[[], CpuReading] | None = None,
                 threads: int | None = None) -> None:
        if site not in TRUTH_SITES:
            raise ValueError(f"truth_site must be one of {TRUTH_SITES}, got {site!r}")
        self.case, self.device, self.site = case, device, site
        self.truth, self.device_truth = truth, device_truth
        self.timing, self.samples = timing, samples
        self.rng = rng or random.Random()
        self.work = work
        self.cpu_seconds = cpu_seconds or _own_cpu_seconds
        self.threads = threads
        self.verdict: Verdict | None = None
        self._ready: Ready | None = None
        self._expected: tolerance.Expected | None = None
        self._passed: Verdict | None = None
        self._plan: TimeIt | None = None
        self._timing_began, self._timing_cpu_began = 0.0, {}
        self._handlers: dict[type, Callable[[Any], Any]] = {
            Concluded: self._concluded, Ready: self._on_ready, Output: self._on_output,
            Timed: self._on_timed}

    def handle(self, message: Message) -> Go | TimeIt | Watched | None:
        """The reply to ``message`` (None when it needs none).

        Raises
        ------
        Refused
            If the case in flight cannot take this message now.
        """
        if self.verdict is not None:
            raise Refused(f"a {message.kind!r} after the case was concluded")
        handler = self._handlers.get(type(message))
        if handler is None:
            raise Refused(f"a {message.kind!r} message is not part of a check")
        return handler(message)

    def _conclude(self, verdict: Verdict) -> None:
        self.verdict = verdict

    def _expected_of(self, timed_call: TimedCall | None = None) -> tolerance.Expected:
        ready = self._ready
        if self.site == "host":
            return self.work(lambda: self.truth(
                self.case, logits_precision=ready.logits_precision,
                with_lse=ready.returns_lse, timed_call=timed_call), "truth")

        def on_device() -> tolerance.Expected:
            inputs = materialize(self.case, self.device, on_device=True)
            return self.device_truth(inputs, logits_precision=ready.logits_precision,
                                     with_lse=ready.returns_lse)
        return self.work(on_device, "truth")

    def _concluded(self, message: Concluded) -> None:
        if self._passed is not None:
            raise Refused("an outcome after the output")
        status = Status(message.status)
        if status is not Status.UNSUPPORTED:
            status = Status.ERROR  # nothing else is the implementation's to claim
        site = None if status is Status.UNSUPPORTED or message.step == "why_unsupported" \
            else self.site
        self._conclude(Verdict(status, message.reason, message.step, truth_site=site,
                               exception=message.exception))

    def _on_ready(self, message: Ready) -> Go:
        if self._ready is not None:
            raise Refused("ready twice")
        self._ready = message
        try:  # before the inputs exist, so that nothing the adapter does can change it
            self._expected = self._expected_of()
        except Exception as exc:
            self._conclude(replace(harness_fault("truth", exc), truth_site=self.site))
            return Go(go=False)
        return Go(go=True)

    def _decoded(self, descriptors: list, payload: bytes) -> list[object]:
        """The output (and LSE) sent, rebuilt; :class:`Refused` when the values are not
        what the descriptors say."""
        case = self.case
        shapes = [(output_shape(case), case.dtype), (lse_shape(case), "float32")]
        try:
            chunks = split_payload(payload, descriptors)
            return [decode(d, c, shape, dtype)
                    for d, c, (shape, dtype) in zip(descriptors, chunks, shapes)]
        except ValueError as exc:
            raise Refused(str(exc)) from exc

    def _compare(self, out: object, lse: object | None, expected: tolerance.Expected,
                 ) -> tuple[Comparison, Checked | None]:
        case, ready = self.case, self._ready

        def both() -> tuple[Comparison, Checked | None]:
            bounds = cu_seqlens_q(case)
            found = tolerance.compare(out, expected, case.dtype, bounds)
            return found, (None if lse is None else tolerance.compare_lse(
                lse, expected, case.dtype, ready.logits_precision, bounds))
        return self.work(both, "compare")

    def _on_output(self, message: Output) -> TimeIt | None:
        if self._expected is None or self._passed is not None:
            raise Refused("an output before the truth or twice")
        if len(message.outputs) != (2 if self._ready.returns_lse else 1):
            raise Refused(f"{len(message.outputs)} outputs; the implementation declared "
                          f"{'an output and its LSE' if self._ready.returns_lse else 'one'}")
        out, *lse_sent = self._decoded(message.outputs, message.payload)
        try:
            comparison, lse = self._compare(out, lse_sent[0] if lse_sent else None,
                                            self._expected)
        except Exception as exc:
            self._conclude(replace(harness_fault("compare", exc), truth_site=self.site))
            return TimeIt(time=False)
        passed = comparison.passed and (lse is None or lse.passed)
        reason = comparison.reason or (lse.reason if lse is not None else "")
        verdict = Verdict(
            Status.PASS if passed else Status.FAIL, reason, None if passed else "compare",
            comparison, lse, self._ready.tail_poison, self._ready.logits_precision, self.site,
            dict(message.details), message.nan_tail_output_finite if passed else None)
        if not passed or not self.timing:
            self._conclude(verdict)
            return TimeIt(time=False)
        self._passed = verdict
        self._plan = self._timing_plan()
        self._timing_began, self._timing_cpu_began = time.monotonic(), self.cpu_seconds()
        return self._plan

    def _timing_plan(self) -> TimeIt:
        """New inputs before every timed call (host truths only): Q always, K and V too
        (a cache read in place) before the calls :func:`kv_calls` draws; :data:`JUDGED`
        calls judged (:class:`Reservoir`)."""
        if self.site != "host":
            return TimeIt(time=True)
        kv = kv_calls(self.rng, self.samples) if self._ready.kv_cache_in_place else []
        return TimeIt(time=True, seed=self.rng.randrange(2**31), judged=JUDGED, kv_calls=kv)

    def _on_timed(self, message: Timed) -> Watched:
        if self._passed is None:
            raise Refused("a timing before a pass")
        self._judge_timing(message)
        return Watched()

    def _judge_timing(self, message: Timed) -> None:
        envelope_s = time.monotonic() - self._timing_began
        cpu_s, gone = _cpu_used(self._timing_cpu_began, self.cpu_seconds())
        busy_s = self._busy_after()
        if message.error is not None:
            self._conclude(replace(self._passed, status=Status.ERROR, step="timing",
                                   reason=f"run raised while timing: {message.error}"))
            return
        why = (message.refused
               or self._timing_problem(message, envelope_s, cpu_s, gone, busy_s)
               or self._checked_calls(message))
        if why:
            self._conclude(replace(self._passed, status=Status.FAIL, step="timing",
                                   reason=why))
            return
        self._conclude(replace(self._passed, timing=message.model_copy(update={"payload": b""})))

    def _busy_after(self) -> float:
        """CPU seconds the implementation's process uses in :data:`IDLE_WINDOW_S` after its
        timing ended (it is waiting for the reply, :class:`Watched`, so any is a thread still
        working)."""
        before = self.cpu_seconds()
        time.sleep(IDLE_WINDOW_S)
        return _cpu_used(before, self.cpu_seconds())[0]

    def _timing_problem(self, message: Timed, envelope_s: float, cpu_s: float,
                        gone: list[Hashable], busy_s: float) -> str:
        """Why this timing cannot be the implementation's (empty when it can): ``cpu_s`` is
        the CPU its processes used in the ``envelope_s`` seconds of wall time the timing
        took, ``gone`` those of them that ended meanwhile, ``busy_s`` what they used
        after."""
        if len(message.calls) != len(message.samples_ms) or not message.samples_ms:
            return (f"the timing has {len(message.samples_ms)} samples and calls for "
                    f"{len(message.calls)}")
        if busy_s > IDLE_CPU_SHARE * IDLE_WINDOW_S:
            return (f"its process used {busy_s * 1e3:.0f} ms of CPU in the "
                    f"{IDLE_WINDOW_S * 1e3:.0f} ms after its last timed call returned: work "
                    "still running after run() returned is not in its time")
        counted = self.threads is not None and self.device == "cpu"
        if counted and gone:
            return (f"{len(gone)} process(es) of the implementation ended during its "
                    "timing: the CPU they used then cannot be counted against the threads "
                    "the run grants")
        if counted and cpu_s > CORES_SLACK * self.threads * envelope_s + CPU_READ_SLACK_S:
            return (f"its process used {cpu_s:.3g} s of CPU in the {envelope_s:.3g} s the "
                    f"timing took ({cpu_s / envelope_s:.1f} cores): more than the "
                    f"{self.threads} thread(s) the run grants every implementation")
        timed_s = sum(ms * n for ms, n in zip(message.samples_ms, message.calls)) / 1e3
        if timed_s > envelope_s:
            return (f"its timed calls add up to {timed_s:.3g} s, more than the "
                    f"{envelope_s:.3g} s the timing took: the reported times cannot be the "
                    "calls'")
        return ""

    def _checked_calls(self, message: Timed) -> str:
        """Why a judged call's output fails (empty when each passes): every timed call of
        a CPU timing must have come on new inputs, the judged calls must be the sample
        the timing's seed draws among the calls it made, and each must have its output
        (and LSE) back."""
        plan = self._plan
        if plan.seed is None:
            return ""
        made = message.refreshed_calls
        if message.method not in REPLAYED_METHODS and made < sum(message.calls):
            return (f"only {made} calls of the timing came on new inputs, fewer than its "
                    f"{sum(message.calls)} timed calls")
        drawn = Reservoir(plan.judged, plan.seed)
        for call in range(made):
            drawn.offer(call)
        per_call = 2 if self._ready.returns_lse else 1
        if (message.judged_calls != drawn.calls
                or len(message.outputs) != per_call * len(drawn.calls)):
            return (f"the outputs of calls {message.judged_calls} came back "
                    f"({len(message.outputs)} tensors); calls {drawn.calls} were judged")
        try:
            chunks = split_payload(message.payload, message.outputs)
            shapes = [(output_shape(self.case), self.case.dtype),
                      (lse_shape(self.case), "float32")][:per_call] * len(drawn.calls)
            tensors = [decode(d, c, shape, dtype)
                       for d, c, (shape, dtype) in zip(message.outputs, chunks, shapes)]
        except ValueError as exc:
            raise Refused(str(exc)) from exc
        for i, call in enumerate(drawn.calls):
            out, *lse = tensors[per_call * i: per_call * (i + 1)]
            try:
                expected = self._expected_of((plan.seed, call, tuple(plan.kv_calls)))
            except Exception as exc:
                return (f"pagedbench's truth of the refreshed inputs failed: "
                        f"{describe_exception(exc)}")
            found, lse_found = self._compare(out, lse[0] if lse else None, expected)
            if not found.passed or (lse_found is not None and not lse_found.passed):
                kv = " and K/V" if call in plan.kv_calls else ""
                reason = found.reason if not found.passed else f"its LSE: {lse_found.reason}"
                return (f"timed call {call}, run on new inputs written into its buffers "
                        f"(Q{kv}; seed {plan.seed}), returned an output that fails: {reason}")
        return ""


class Reservoir:
    """A uniform sample of ``size`` among the calls offered in order 0, 1, 2, ...
    (Vitter's algorithm R, its choices drawn from ``seed``): call ``k`` past the first
    ``size`` replaces a random member with probability ``size / (k + 1)``. The worker
    keeps the outputs of the members as the calls come; the judge replays the draw."""

    def __init__(self, size: int, seed: int) -> None:
        self.size, self.calls = size, []
        self._rng = random.Random(f"judged:{seed}")

    def offer(self, call: int) -> int | None:
        """The member's place ``call`` takes (None: not a member)."""
        if len(self.calls) < self.size:
            self.calls.append(call)
            return len(self.calls) - 1
        place = self._rng.randrange(call + 1)
        if place >= self.size:
            return None
        self.calls[place] = call
        return place


def kv_calls(rng: random.Random, first_calls: int, most: int = MOST_KV_CALLS) -> list[int]:
    """The calls before which new K and V are written (ascending, at most ``most`` >= 2):
    call 0, one drawn uniformly from ``1..first_calls`` (calls a timing that takes its
    least samples makes), and the rest of a draw in which each call ``k`` is taken with
    probability ``1 / (k + 1)``, one gap at a time (after call ``c``, the next is past
    ``n`` with probability ``(c + 1) / (n + 1)``), below ``2**32``."""
    calls = {0, rng.randint(1, max(1, first_calls))}
    last = 0
    while len(calls) < most:
        last = max(last + 1, math.ceil((last + 1) / (1.0 - rng.random()) - 1))
        if last >= 2**32:
            break
        calls.add(last)
    return sorted(calls)


def _own_cpu_seconds() -> CpuReading:
    """The :data:`CpuReading` of this process alone (user + system)."""
    times = os.times()
    return {os.getpid(): times.user + times.system}


def _cpu_used(before: CpuReading, after: CpuReading) -> tuple[float, list[Hashable]]:
    """CPU seconds used between two readings by the processes of the second (those it
    adds, all they used), and the processes of the first gone from the second (what they
    used in between is unknown: never a credit)."""
    return (sum(seconds - before.get(key, 0.0) for key, seconds in after.items()),
            [key for key in before if key not in after])


__all__ = ["CORES_SLACK", "CPU_READ_SLACK_S", "IDLE_CPU_SHARE", "IDLE_WINDOW_S", "JUDGED",
           "MOST_KV_CALLS", "REPLAYED_METHODS", "CaseJudge", "CpuReading", "DeviceTruth",
           "Refused", "Reservoir", "Truth", "Verdict", "cu_seqlens_q", "describe_exception",
           "harness_fault", "judged_here", "kv_calls"]
