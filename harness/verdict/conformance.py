"""The conformance check of one adapter on one case: two sides that talk in typed messages.

The **implementation's side** (:func:`implementation_side`) is a generator: it asks the
adapter ``why_unsupported``, sends :class:`~.messages.Ready`, draws the inputs
(:func:`inputs_for`'s tail poison), calls ``prepare``, ``run`` (and ``lse`` for an
implementation that returns its log-sum-exp), ``describe``, the NaN-tail probe for a stale
tail, sends the :class:`~.messages.Output`, and, when the judge asks, times ``run`` with
new inputs written into the same buffers before every timed call (:func:`timed`). It
announces each step (:class:`~.messages.Entered`) before entering it; whatever the adapter
raises ends the case as ``error`` of that step.

The **judge's side** (:class:`CaseJudge`) has one handler per message: it computes the
truth before the implementation draws its inputs (so nothing the adapter does reaches
it), compares the output (``tolerance.py``), plans the timed calls' new inputs and which
calls it judges, and judges their outputs, the wall time the timing took, and whether the
implementation's process kept computing after its last call returned
(:data:`~.judging.IDLE_WINDOW_S`); only then does it answer the timing
(:class:`~.messages.Watched`), so the worker's next case cannot run inside that window.

:func:`check` drives both in this process (the pytest suites); the runner drives the same
two sides across a pipe (``harness/run/jobs.py`` in the worker, ``harness/run/runner.py``
in the parent), so both run this code. The outcome is a :class:`Verdict`, which the runner
turns into the results line.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Generator
from typing import Any, Protocol

import torch

from pagedbench.adapters import Adapter, Capabilities
from pagedbench.reference import (PagedCase, PagedInputError, PagedInputs, materialize,
                                  resolve_device)
from pagedbench.reference.refresh import TimedInputs

from pagedbench.harness.verdict import tolerance
from pagedbench.harness.verdict.judging import (CaseJudge, DeviceTruth, Reservoir, Truth,
                                                Verdict, describe_exception)
from pagedbench.harness.verdict.messages import (Concluded, Entered, Message, Output, Ready,
                                                 TimeIt, Timed, encode, lse_shape, output_shape,
                                                 to_json_data)
from pagedbench.harness.verdict.status import Status
from pagedbench.harness.verdict.truth import compute_device_truth, compute_truth


class Timer(Protocol):
    """Times ``call()`` (one complete call, returning its output); calls ``before(k)``
    untimed before its call ``k`` (0 the first, warm-up included) and ``after(k, out)``
    untimed once it returned ``out``, for every call it makes on its own (a library's
    sampling loop makes the rest), and ``copy()`` for another call on inputs of its own
    when it rotates copies; returns ``harness/measure/samples.py``'s ``Timing``."""

    def __call__(self, call: Callable[[], object], before: Callable[[int], None],
                 after: Callable[[int, object], None], case: PagedCase,
                 copy: Callable[[], Callable[[], object]]) -> Any: ...


def tail_poison(capabilities: Capabilities) -> str:
    """What fills the unused V slots of each last block for an adapter declaring
    ``capabilities``: ``"nan"``, or ``"stale"`` when it declares ``nan_safe_tail=False``."""
    return "nan" if capabilities.nan_safe_tail else "stale"


def inputs_for(adapter: Adapter, case: PagedCase, device: str) -> PagedInputs:
    """The canonical inputs ``adapter`` is judged on for ``case`` on ``device``."""
    return materialize(case, device, tail_poison=tail_poison(adapter.capabilities(device)))


def synchronize(device: str | torch.device) -> None:
    """Wait for the device's queued work (so a CUDA fault is raised in the step that
    caused it)."""
    if resolve_device(device).type == "cuda":
        torch.cuda.synchronize()


def _raised(step: str, exc: BaseException, prefix: str = "") -> Concluded:
    return Concluded(status=str(Status.ERROR), step=step,
                     reason=prefix + describe_exception(exc), exception=exc)


# The implementation's side ----------------------------------------------------------------
Side = Generator[Message, Any, None]


def implementation_side(adapter: Adapter, case: PagedCase, device: str, *,
                        on_device: bool = False, probe_nan_tail: bool = True,
                        timer: Timer | None = None) -> Side:
    """The implementation's side of a check (see the module docstring): yields each
    message and receives the judge's reply to :class:`~.messages.Ready` (a
    :class:`~.messages.Go`), to :class:`~.messages.Output` (a
    :class:`~.messages.TimeIt`) and to :class:`~.messages.Timed` (a
    :class:`~.messages.Watched`); ``None`` after the others. ``on_device``: the inputs
    drawn on ``device`` (a device truth). Never raises for what the adapter does."""
    yield Entered(step="why_unsupported")
    try:
        reasons = adapter.why_unsupported(case, device)
        capabilities = adapter.capabilities(device)
        poison, precision = tail_poison(capabilities), capabilities.logits_precision
        returns_lse, in_place = capabilities.returns_lse, capabilities.kv_cache_in_place
    except (Exception, SystemExit) as exc:
        yield _raised("why_unsupported", exc, "why_unsupported raised: ")
        return
    if not isinstance(reasons, (list, tuple)) or not all(isinstance(r, str) for r in reasons):
        yield Concluded(status=str(Status.ERROR), step="why_unsupported",
                        reason=f"why_unsupported returned {reasons!r:.200}, not a list of str")
        return
    if reasons:
        yield Concluded(status=str(Status.UNSUPPORTED), step="why_unsupported",
                        reason="; ".join(reasons))
        return
    go = yield Ready(tail_poison=poison, logits_precision=precision, returns_lse=returns_lse,
                     kv_cache_in_place=in_place)
    if not go.go:
        return
    yield Entered(step="inputs")
    try:
        inputs = materialize(case, device, tail_poison=poison, on_device=on_device)
    except Exception as exc:  # pagedbench's own code; the judge records it as error
        yield _raised("inputs", exc, "pagedbench could not draw the inputs: ")
        return
    drawn = (inputs.q, inputs.kv_cache)
    yield Entered(step="prepare")
    try:
        prepared = adapter.prepare(inputs)
    except (Exception, SystemExit) as exc:  # the implementation's fault, never fatal
        yield _raised("prepare", exc)
        return
    yield Entered(step="run")
    try:
        out = adapter.run(prepared)
        lse = adapter.lse(prepared) if returns_lse else None
        synchronize(device)
    except (Exception, SystemExit) as exc:
        yield _raised("run", exc)
        return
    yield Entered(step="describe")
    try:
        details = to_json_data(adapter.describe(prepared), "impl_details")
        if not isinstance(details, dict):
            raise TypeError(f"describe returned a {type(details).__name__}, not a dict")
    except (Exception, SystemExit) as exc:
        yield _raised("describe", exc, "describe returned data that is not JSON: "
                      if isinstance(exc, PagedInputError) else "describe raised: ")
        return
    finite = None
    if poison == "stale" and probe_nan_tail:
        yield Entered(step="nan-tail probe")
        finite = nan_tail_output_finite(adapter, case, device, on_device=on_device)
    yield Entered(step="output")
    try:
        sent = [encode(out, output_shape(case), case.dtype)]
        if returns_lse:
            sent.append(encode(lse, lse_shape(case), "float32"))
    except (Exception, SystemExit) as exc:
        yield _raised("run", exc, "its output cannot be read: ")
        return
    reply = yield Output(outputs=[d for d, _ in sent], details=details,
                         nan_tail_output_finite=finite, payload=b"".join(p for _, p in sent))
    if not reply.time:
        return
    yield Entered(step="timing")
    yield timed(adapter, prepared, inputs, reply, timer, returns_lse=returns_lse,
                poison=poison, drawn=drawn)


#: The trace and profile functions this process had before any implementation ran (a
#: coverage tool's, say): a timed call that leaves others set can run its work inside
#: pagedbench's untimed steps (a profile function fires as the new inputs are written).
HOOKS_BEFORE = (sys.gettrace(), sys.getprofile())


class DeferredWork(Exception):
    """A timed call whose output can still be computed after it returned (the worker's
    check, not the implementation's exception)."""


def timed(adapter: Adapter, prepared: Any, inputs: PagedInputs, plan: TimeIt,
          timer: Timer, *, returns_lse: bool = False, poison: str = "nan",
          drawn: tuple[torch.Tensor, torch.Tensor] | None = None) -> Timed:
    """Time ``adapter.run(prepared)`` (and ``adapter.lse(prepared)`` with ``returns_lse``:
    an LSE is part of the call's work) with ``timer``. With ``plan.seed``, before each call
    ``k`` the timer makes, write that call's new inputs into ``inputs``' own tensors
    (:class:`~pagedbench.reference.refresh.TimedInputs`: Q, and K and V before
    ``plan.kv_calls``); after it, refuse an output that is not a plain ``torch.Tensor`` or a
    torch function or dispatch mode left active (either could defer the work until the
    output is read), a trace or profile function other than :data:`HOOKS_BEFORE`, or
    ``inputs``' Q and cache other than the tensors ``drawn`` (either could run the work
    while the new inputs are written), or torch's intra-op thread count other than the one
    the timer set before call 0 (more cores than the run grants), and keep a copy of the
    outputs of the calls :class:`~.judging.Reservoir` draws: what the judge checks. A timer
    that rotates input copies (CUDA graph replay) gets more calls from ``copy()``, each
    prepared on inputs of its own (of ``poison``). What a timed call raises is
    :attr:`~.messages.Timed.error`; the refusal, :attr:`~.messages.Timed.refused`."""
    refreshed, threads = [0], [0]
    device = inputs.device
    fresh = (None if plan.seed is None
             else TimedInputs(inputs.case, plan.seed, plan.kv_calls, device))
    judged = Reservoir(plan.judged, plan.seed or 0)
    kept: list[list[torch.Tensor]] = []

    def call() -> list[object]:
        out = adapter.run(prepared)
        return [out, adapter.lse(prepared)] if returns_lse else [out]

    def before(k: int) -> None:  # queued on the call's stream: no host synchronization
        if k == 0:
            threads[0] = torch.get_num_threads()
        if fresh is not None:
            fresh.write(inputs, k)
            refreshed[0] = k + 1

    def after(k: int, outs: list[object]) -> None:
        deferring = [type(t).__name__ for t in outs if type(t) is not torch.Tensor]
        if deferring:
            raise DeferredWork(f"timed call {k} returned a {deferring[0]}, not a "
                               "torch.Tensor: a tensor subclass can leave its work until "
                               "the output is read")
        if torch._C._is_torch_function_mode_enabled() or torch._C._len_torch_dispatch_stack():
            raise DeferredWork(f"timed call {k} left a torch function or dispatch mode "
                               "active: it can leave the work until the output is read")
        if (sys.gettrace(), sys.getprofile()) != HOOKS_BEFORE:
            raise DeferredWork(f"timed call {k} ran with a trace or profile function set "
                               "(sys.settrace, sys.setprofile): it can run the work while "
                               "pagedbench writes the next inputs, outside the timed call")
        if torch.get_num_threads() != threads[0]:
            raise DeferredWork(f"timed call {k} changed torch's intra-op threads from "
                               f"{threads[0]} to {torch.get_num_threads()} "
                               "(torch.set_num_threads): the run grants every "
                               "implementation the same threads")
        if drawn is not None and (inputs.q is not drawn[0] or inputs.kv_cache is not drawn[1]):
            raise DeferredWork(f"timed call {k} found the inputs' q or kv_cache replaced: "
                               "a tensor of the implementation's own can run the work while "
                               "pagedbench writes the next inputs into it")
        if fresh is None:
            return
        place = judged.offer(k)
        if place is None:
            return
        copies = [t.detach().clone() for t in outs]
        if place == len(kept):
            kept.append(copies)
        else:
            kept[place] = copies

    case = inputs.case

    def copy() -> Callable[[], object]:
        other = adapter.prepare(materialize(case, device, tail_poison=poison))
        return lambda: adapter.run(other)

    try:
        timing = timer(call, before, after, case, copy)
        synchronize(device)
        shapes = [(output_shape(case), case.dtype), (lse_shape(case), "float32")]
        sent = [encode(t, shape, dtype)
                for outs in kept for t, (shape, dtype) in zip(outs, shapes)]
    except DeferredWork as exc:
        return Timed(refused=str(exc))
    except (Exception, SystemExit) as exc:
        return Timed(error=describe_exception(exc))
    return Timed(**timing.to_message(),
                 calls=list(timing.calls) or [1] * len(timing.samples_ms),
                 refreshed_calls=refreshed[0], judged_calls=judged.calls if fresh else [],
                 outputs=[d for d, _ in sent], payload=b"".join(p for _, p in sent))


def nan_tail_output_finite(adapter: Adapter, case: PagedCase, device: str, *,
                           on_device: bool = False) -> bool | None:
    """Whether ``adapter``'s output on ``case`` stays finite with NaN in the unused slots
    of the last blocks (the strict inputs); ``None`` when it raised. For an adapter
    declaring ``nan_safe_tail=False`` this is the probe that shows a fix upstream (the
    declaration can then go); for one declaring True it must be True. ``on_device``: the
    inputs drawn on ``device`` (as for a device truth)."""
    try:
        out = adapter.run(adapter.prepare(materialize(case, device, tail_poison="nan",
                                                      on_device=on_device)))
        synchronize(device)
    except Exception:
        return None
    return bool(torch.isfinite(out).all())


# In this process ------------------------------------------------------------------------------
def check(adapter: Adapter, case: PagedCase, device: str, *, truth: Truth = compute_truth,
          on_step: Callable[[str], None] | None = None, probe_nan_tail: bool = True,
          truth_site: str = "host", device_truth: DeviceTruth = compute_device_truth,
          timer: Timer | None = None, samples: int = 1,
          threads: int | None = None) -> Verdict:
    """Check ``adapter`` on ``case`` on ``device`` in this process: both sides, as the
    runner drives them across its pipe (pytest's check).

    Parameters
    ----------
    truth, device_truth : callable
        As :class:`CaseJudge` takes them.
    on_step : callable
        ``on_step(step)`` before each step of the implementation's side.
    probe_nan_tail : bool
        Run the NaN-tail probe after a ``stale`` pass.
    truth_site : str
        ``"host"`` or ``"device"`` (inputs drawn on ``device``).
    timer : Timer or None
        Time a pass with it (its timed calls checked); None: no timing.
    threads : int, optional
        The CPU threads ``timer`` grants: a timing that used more cores is refused
        (:class:`CaseJudge`).

    Returns
    -------
    Verdict
        Never raises for what the adapter does (``SystemExit`` included).

    Raises
    ------
    ValueError
        If ``truth_site`` is not one of :data:`~.truth_sites.TRUTH_SITES`.
    """
    judge = CaseJudge(case, device, site=truth_site, truth=truth, device_truth=device_truth,
                      timing=timer is not None, samples=samples, threads=threads)
    side = implementation_side(adapter, case, device, on_device=truth_site == "device",
                               probe_nan_tail=probe_nan_tail, timer=timer)
    reply = None
    while judge.verdict is None:
        try:
            message = side.send(reply)
        except StopIteration:
            raise AssertionError(f"the implementation's side of {case.case_id} ended "
                                 "without a conclusion") from None
        if isinstance(message, Entered):
            if on_step is not None:
                on_step(message.step)
            reply = None
            continue
        reply = judge.handle(message)
    side.close()
    return judge.verdict


class Nonconforming(AssertionError):
    """A verdict other than ``pass``, raised for pytest: the message names the adapter,
    case id, status, step and reason; :attr:`verdict` is the whole :class:`Verdict`
    (what ``describe()`` returned included, when the adapter got that far)."""

    def __init__(self, message: str, verdict: Verdict) -> None:
        super().__init__(message)
        self.verdict = verdict


def assert_conforms(adapter: Adapter, case: PagedCase, device: str, *,
                    truth: Truth = compute_truth) -> Verdict:
    """:func:`check` for pytest: the verdict of a pass.

    Raises
    ------
    Nonconforming
        For any other verdict (chained to what the adapter raised, so pytest shows its
        traceback).
    """
    verdict = check(adapter, case, device, truth=truth, probe_nan_tail=False)
    if verdict.status is not Status.PASS:
        raise Nonconforming(
            f"{adapter.name}:{case.case_id}: {verdict.status} in {verdict.step}: "
            f"{verdict.reason}", verdict) from verdict.exception
    return verdict


__all__ = ["Nonconforming", "Timer", "assert_conforms",
           "check",
           "implementation_side", "inputs_for", "nan_tail_output_finite", "synchronize",
           "tail_poison", "timed"]
