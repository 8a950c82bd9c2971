"""The conformance check: (adapter, case, device) -> the inputs the adapter is judged on
-> a verdict. The one place, used by the runner's workers and by the pytest suites alike.

Inputs: :func:`inputs_for` applies the tail-poison policy (:func:`tail_poison`): NaN in
every unused slot, except that an adapter declaring ``Capabilities.nan_safe_tail=False``
gets finite stale V values in the unused slots of each partly filled last block (K there
stays NaN), and its passes are marked :data:`STALE_TAIL_MARK`.

Verdict: :func:`judge` walks ``why_unsupported`` (:func:`claims`) -> truth
(:func:`expected_for`) -> inputs -> ``prepare`` -> ``run`` -> ``describe`` -> the NaN-tail
probe for a stale tail (:func:`attempt`) -> compare (:func:`verdict_of`,
``harness/verdict/tolerance.py``). The runner splits these between the implementation's worker
(:func:`claims`, :func:`attempt`) and the judging parent (:func:`expected_for`,
:func:`verdict_of`); :func:`judge` runs them all in one process, for the pytest suites.
With ``truth_site="device"`` (a case the host cannot hold, :func:`~.truth.truth_site`)
the inputs are drawn on the device and the truth is computed there from them; the
comparison is the same. Whatever the adapter raises becomes ``error`` with the step;
whatever the harness raises becomes ``harness-error``; each step is announced to
``on_step`` with the party it is charged to (``"impl"`` or ``"harness"``).
"""

from __future__ import annotations

import itertools
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pagedbench.adapters import Adapter, Capabilities
from pagedbench.reference import PagedCase, PagedInputs, materialize, resolve_device

from pagedbench.harness.verdict import tolerance
from pagedbench.harness.verdict.status import Status
from pagedbench.harness.verdict.truth import TRUTH_SITES, compute_device_truth, compute_truth

#: Marks a pass judged with stale (finite) tails instead of NaN (docs/implementations.md).
STALE_TAIL_MARK = "†"
#: Marks a pass judged against the yardstick with logits in the case dtype, which the
#: implementation declares (``Capabilities.logits_precision = "case"``; docs/tolerance.md).
CASE_LOGITS_MARK = "‡"
#: Parties a step is charged to.
IMPL, HARNESS = "impl", "harness"

StepCallback = Callable[[str, str], None]
#: ``device_truth(inputs, logits_precision=...) -> Expected`` (:func:`judge`).
DeviceTruth = Callable[..., tolerance.Expected]


def tail_poison(capabilities: Capabilities) -> str:
    """What fills the unused V slots of each last block for an adapter declaring
    ``capabilities``: ``"nan"``, or ``"stale"`` when it declares ``nan_safe_tail=False``."""
    return "nan" if capabilities.nan_safe_tail else "stale"


def inputs_for(adapter: Adapter, case: PagedCase, device: str) -> PagedInputs:
    """The canonical inputs ``adapter`` is judged on for ``case`` on ``device``."""
    return materialize(case, device, tail_poison=tail_poison(adapter.capabilities(device)))


def describe_exception(exc: BaseException) -> str:
    """``Type: message (file:line)`` of where ``exc`` was raised."""
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" ({Path(frames[-1].filename).name}:{frames[-1].lineno})" if frames else ""
    return f"{type(exc).__name__}: {exc}{where}"


def synchronize(device: str) -> None:
    """Wait for the device's queued work (so a CUDA fault is raised in the step that
    caused it)."""
    if resolve_device(device).type == "cuda":
        torch.cuda.synchronize()


@dataclass
class Verdict:
    """The outcome of one adapter on one case.

    Attributes
    ----------
    status : Status
    reason : str
        Why, for anything but ``pass`` (verbatim ``unsupported`` reasons, the comparison's
        figures for ``fail``, the exception for ``error``/``harness-error``).
    step : str or None
        The step a non-pass outcome arose in (``why_unsupported``, ``truth``, ``inputs``,
        ``prepare``, ``run``, ``describe``, ``compare``).
    comparison : tolerance.Comparison or None
        The figures, once the output was compared.
    tail_poison : str or None
        ``"nan"`` or ``"stale"`` once inputs were built.
    logits_precision : str or None
        The yardstick's logits precision (``"float32"`` or the declared ``"case"``) once
        the truth was computed.
    truth_site : str or None
        Where the truth was computed (``"host"`` or ``"device"``), once it was.
    details : dict
        What ``adapter.describe(prepared)`` returned.
    nan_tail_output_finite : bool or None
        For a ``stale`` pass: whether the output stays finite with NaN tails after all.
    prepared : object
        What ``prepare`` returned (for timing); never recorded.
    exception : BaseException or None
        What was raised, for ``error`` and ``harness-error``.
    """

    status: Status
    reason: str = ""
    step: str | None = None
    comparison: tolerance.Comparison | None = None
    tail_poison: str | None = None
    logits_precision: str | None = None
    truth_site: str | None = None
    details: dict[str, Any] = field(default_factory=dict)
    nan_tail_output_finite: bool | None = None
    prepared: Any = None
    exception: BaseException | None = None


def _ignore_step(party: str, step: str) -> None:
    """The default ``on_step``: nothing to announce to."""


@dataclass
class Attempt:
    """What the implementation's side of a check produced (:func:`attempt`): an output,
    or the outcome that ended it first.

    Attributes
    ----------
    verdict : Verdict or None
        ``unsupported`` or ``error`` (with its step) when it ended before an output.
    out : object
        What ``run`` returned (a ``Tensor[total_q, num_q_heads, head_dim]`` if correct).
    tail_poison, logits_precision : str or None
        As in :class:`Verdict`, once ``why_unsupported`` answered.
    details : dict
        What ``describe`` returned.
    nan_tail_output_finite : bool or None
        The NaN-tail probe, for a ``stale`` tail poison.
    prepared : object
        What ``prepare`` returned (for timing).
    """

    verdict: Verdict | None = None
    out: Any = None
    tail_poison: str | None = None
    logits_precision: str | None = None
    details: dict[str, Any] = field(default_factory=dict)
    nan_tail_output_finite: bool | None = None
    prepared: Any = None


def _impl_fault(step: str, exc: BaseException, prefix: str = "") -> Verdict:
    return Verdict(Status.ERROR, prefix + describe_exception(exc), step, exception=exc)


def harness_fault(step: str, exc: BaseException) -> Verdict:
    """pagedbench's own ``harness-error`` in ``step``: past its budget (``TimeoutError``)
    or raised."""
    if isinstance(exc, TimeoutError):
        return Verdict(Status.HARNESS_ERROR, f"pagedbench's {step}: {exc}; not the "
                       "implementation's fault", step)
    return Verdict(Status.HARNESS_ERROR, f"pagedbench's {step} failed, not the "
                   f"implementation: {describe_exception(exc)}", step, exception=exc)


def claims(adapter: Adapter, case: PagedCase, device: str,
           on_step: StepCallback = _ignore_step) -> Attempt:
    """The implementation's ``why_unsupported`` and declared capabilities for ``case``: an
    :class:`Attempt` with the tail poison and logits precision, or with the verdict
    (``unsupported``, or ``error`` when it raised or answered something else)."""
    on_step(IMPL, "why_unsupported")
    try:
        reasons = adapter.why_unsupported(case, device)
        capabilities = adapter.capabilities(device)
        poison, precision = tail_poison(capabilities), capabilities.logits_precision
    except (Exception, SystemExit) as exc:
        return Attempt(_impl_fault("why_unsupported", exc, "why_unsupported raised: "))
    if not isinstance(reasons, (list, tuple)) or not all(isinstance(r, str) for r in reasons):
        return Attempt(Verdict(Status.ERROR, f"why_unsupported returned {reasons!r}, not a "
                               "list of str", "why_unsupported"))
    if reasons:
        return Attempt(Verdict(Status.UNSUPPORTED, "; ".join(reasons), "why_unsupported"))
    return Attempt(tail_poison=poison, logits_precision=precision)


def attempt(adapter: Adapter, case: PagedCase, device: str, claimed: Attempt, *,
            on_step: StepCallback = _ignore_step, on_device: bool = False,
            probe_nan_tail: bool = True) -> Attempt:
    """The implementation's side of a check, after :func:`claims` (``claimed``): inputs
    (``materialize`` with its tail poison; ``on_device``: drawn on ``device``),
    ``prepare``, ``run``, ``describe`` and, for a ``stale`` tail poison, the NaN-tail
    probe. Whatever the adapter raises becomes an ``error`` verdict with its step; this
    is what the runner's worker (the implementation's process) does, and nothing of it
    is trusted but the output."""
    done = Attempt(tail_poison=claimed.tail_poison, logits_precision=claimed.logits_precision)
    on_step(IMPL, "inputs")
    try:
        inputs = materialize(case, device, tail_poison=claimed.tail_poison, on_device=on_device)
    except Exception as exc:
        done.verdict = harness_fault("inputs", exc)
        return done
    on_step(IMPL, "prepare")
    try:
        done.prepared = adapter.prepare(inputs)
    except (Exception, SystemExit) as exc:  # the implementation's fault, never fatal
        done.verdict = _impl_fault("prepare", exc)
        return done
    on_step(IMPL, "run")
    try:
        done.out = adapter.run(done.prepared)
        synchronize(device)
    except (Exception, SystemExit) as exc:
        done.verdict = _impl_fault("run", exc)
        return done
    on_step(IMPL, "describe")
    try:
        details = adapter.describe(done.prepared)
    except (Exception, SystemExit) as exc:
        done.verdict = _impl_fault("describe", exc, "describe raised: ")
        return done
    if not isinstance(details, dict):
        done.verdict = Verdict(Status.ERROR, f"describe returned a {type(details).__name__}, "
                               "not a dict", "describe", tail_poison=claimed.tail_poison)
        return done
    done.details = details
    if claimed.tail_poison == "stale" and probe_nan_tail:
        on_step(IMPL, "nan-tail probe")
        done.nan_tail_output_finite = nan_tail_output_finite(adapter, case, device,
                                                             on_device=on_device)
    return done


def expected_for(case: PagedCase, device: str, logits_precision: str, *,
                 truth: Callable[..., tolerance.Expected] = compute_truth,
                 truth_site: str = "host",
                 device_truth: DeviceTruth = compute_device_truth) -> tolerance.Expected:
    """The truth and yardstick ``case`` is judged against, computed from inputs drawn here
    from its seed: ``truth(case, logits_precision=...)`` on the host, or, with
    ``truth_site="device"``, ``device_truth(inputs, logits_precision=...)`` of inputs drawn
    on ``device`` (``materialize(on_device=True)``).

    Raises
    ------
    ValueError
        If ``truth_site`` is not one of :data:`~.truth.TRUTH_SITES`; whatever the truth
        raises.
    """
    if truth_site not in TRUTH_SITES:
        raise ValueError(f"truth_site must be one of {TRUTH_SITES}, got {truth_site!r}")
    if truth_site == "host":
        return truth(case, logits_precision=logits_precision)
    inputs = materialize(case, device, on_device=True)
    return device_truth(inputs, logits_precision=logits_precision)


def cu_seqlens_q(case: PagedCase) -> torch.Tensor:
    """``Tensor[batch + 1]``, int64: the row ranges of ``case``'s sequences."""
    return torch.tensor([0, *itertools.accumulate(case.q_lens_or_decode)])


def verdict_of(case: PagedCase, claimed: Attempt, out: object,
               expected: tolerance.Expected, truth_site: str = "host") -> Verdict:
    """The verdict on ``out`` (the implementation's output on ``case``) against
    ``expected`` (:func:`~.tolerance.compare`), with what ``claimed`` (its
    :class:`Attempt`) says about the run; a comparison that raises is ``harness-error``."""
    try:
        comparison = tolerance.compare(out, expected, case.dtype, cu_seqlens_q(case))
    except Exception as exc:
        return harness_fault("compare", exc)
    return Verdict(Status.PASS if comparison.passed else Status.FAIL, comparison.reason,
                   None if comparison.passed else "compare", comparison, claimed.tail_poison,
                   claimed.logits_precision, truth_site, claimed.details,
                   claimed.nan_tail_output_finite if comparison.passed else None,
                   prepared=claimed.prepared)


def judge(
    adapter: Adapter,
    case: PagedCase,
    device: str,
    *,
    truth: Callable[..., tolerance.Expected] = compute_truth,
    on_step: StepCallback = _ignore_step,
    probe_nan_tail: bool = True,
    truth_site: str = "host",
    device_truth: DeviceTruth = compute_device_truth,
) -> Verdict:
    """Check ``adapter`` on ``case`` on ``device`` in this process (see the module
    docstring): :func:`claims`, :func:`expected_for`, :func:`attempt`,
    :func:`verdict_of`. For the pytest suites; the runner splits these steps between the
    implementation's worker and the judging parent, so that nothing the implementation
    does reaches the truth or the comparison.

    Parameters
    ----------
    truth : callable
        ``truth(case, logits_precision=...) -> tolerance.Expected``.
    on_step : callable
        ``on_step(party, step)`` before each step.
    probe_nan_tail : bool
        Run the NaN-tail probe after a ``stale`` pass.
    truth_site : str
        ``"host"``: ``truth(case)``, inputs drawn on the host and moved to ``device``;
        ``"device"``: inputs drawn on ``device`` (``materialize(on_device=True)``), and
        ``device_truth(inputs, logits_precision=...)``.

    Returns
    -------
    Verdict
        Never raises for what the adapter does (``SystemExit`` included); the harness's
        own faults become ``harness-error``.

    Raises
    ------
    ValueError
        If ``truth_site`` is not one of :data:`~.truth.TRUTH_SITES`.
    """
    if truth_site not in TRUTH_SITES:
        raise ValueError(f"truth_site must be one of {TRUTH_SITES}, got {truth_site!r}")
    claimed = claims(adapter, case, device, on_step)
    if claimed.verdict is not None:
        return claimed.verdict
    on_step(HARNESS, "truth")
    try:  # before prepare, so that nothing the adapter does can change it
        expected = expected_for(case, device, claimed.logits_precision, truth=truth,
                                truth_site=truth_site, device_truth=device_truth)
    except Exception as exc:
        return harness_fault("truth", exc)
    done = attempt(adapter, case, device, claimed, on_step=on_step,
                   on_device=truth_site == "device", probe_nan_tail=probe_nan_tail)
    if done.verdict is not None:
        return done.verdict
    on_step(HARNESS, "compare")
    return verdict_of(case, done, done.out, expected, truth_site)


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


def assert_conforms(adapter: Adapter, case: PagedCase, device: str, *,
                    truth: Callable[..., tolerance.Expected] = compute_truth
                    ) -> tolerance.Comparison:
    """:func:`judge` for pytest: the comparison of a pass (``truth`` as for ``judge``).

    Raises
    ------
    AssertionError
        For any other verdict, with the adapter, case id, status, step and reason
        (chained to what the adapter raised, so pytest shows its traceback).
    """
    verdict = judge(adapter, case, device, truth=truth, probe_nan_tail=False)
    if verdict.status is not Status.PASS:
        raise AssertionError(
            f"{adapter.name}:{case.case_id}: {verdict.status} in {verdict.step}: "
            f"{verdict.reason}") from verdict.exception
    return verdict.comparison


__all__ = ["CASE_LOGITS_MARK", "HARNESS", "IMPL", "STALE_TAIL_MARK", "Attempt", "Verdict",
           "assert_conforms", "attempt", "claims", "cu_seqlens_q", "describe_exception",
           "expected_for", "harness_fault", "inputs_for", "judge", "nan_tail_output_finite", "synchronize",
           "tail_poison", "verdict_of"]
