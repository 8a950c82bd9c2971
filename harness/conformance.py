"""The conformance check: (adapter, case, device) -> the inputs the adapter is judged on
-> a verdict. The one place, used by the runner's workers and by the pytest suites alike.

Inputs: :func:`inputs_for` applies the tail-poison policy (:func:`tail_poison`): NaN in
every unused slot, except that an adapter declaring ``Capabilities.nan_safe_tail=False``
gets finite stale V values in the unused slots of each partly filled last block (K there
stays NaN), and its passes are marked :data:`STALE_TAIL_MARK`.

Verdict: :func:`judge` walks ``why_unsupported`` -> truth -> inputs -> ``prepare`` ->
``run`` -> ``describe`` -> compare (``harness/tolerance.py``), and for a stale-tail pass
the NaN-tail probe (:func:`nan_tail_output_finite`). With ``truth_site="device"`` (a case
the host cannot hold, :func:`~.truth.truth_site`) the inputs are drawn on the device
first and the truth is computed there from them; the comparison is the same. Whatever
the adapter raises becomes ``error`` with the step; whatever the harness raises becomes
``harness-error``; each step is announced to ``on_step`` with the party it is charged to
(``"impl"`` or ``"harness"``), which is how the runner gives each party its own time budget.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pagedbench.adapters import Adapter, Capabilities
from pagedbench.reference import PagedCase, PagedInputs, materialize, resolve_device

from . import tolerance
from .status import Status
from .truth import TRUTH_SITES, compute_device_truth, compute_truth

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
    """Check ``adapter`` on ``case`` on ``device`` (see the module docstring).

    Parameters
    ----------
    truth : callable
        ``truth(case, logits_precision=...) -> tolerance.Expected``; the runner passes its
        cached :func:`~.truth.truth_for`.
    on_step : callable
        ``on_step(party, step)`` before each step.
    probe_nan_tail : bool
        Run the NaN-tail probe after a ``stale`` pass.
    truth_site : str
        ``"host"``: ``truth(case)``, inputs drawn on the host and moved to ``device``;
        ``"device"``: inputs drawn on ``device`` (``materialize(on_device=True)``), then
        ``device_truth(inputs, logits_precision=...)`` (the runner passes its cached
        :func:`~.truth.device_truth_for`).

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
    on_device = truth_site == "device"

    def impl_fault(step: str, exc: BaseException, prefix: str = "") -> Verdict:
        return Verdict(Status.ERROR, prefix + describe_exception(exc), step, exception=exc)

    def harness_fault(step: str, exc: BaseException) -> Verdict:
        return Verdict(Status.HARNESS_ERROR, f"pagedbench's {step} failed, not the "
                       f"implementation: {describe_exception(exc)}", step, exception=exc)

    on_step(IMPL, "why_unsupported")
    try:
        reasons = adapter.why_unsupported(case, device)
        capabilities = adapter.capabilities(device)
        poison, precision = tail_poison(capabilities), capabilities.logits_precision
    except (Exception, SystemExit) as exc:
        return impl_fault("why_unsupported", exc, "why_unsupported raised: ")
    if not isinstance(reasons, (list, tuple)) or not all(isinstance(r, str) for r in reasons):
        return Verdict(Status.ERROR, f"why_unsupported returned {reasons!r}, not a list of "
                       "str", "why_unsupported")
    if reasons:
        return Verdict(Status.UNSUPPORTED, "; ".join(reasons), "why_unsupported")
    if not on_device:
        on_step(HARNESS, "truth")
        try:
            expected = truth(case, logits_precision=precision)
        except Exception as exc:
            return harness_fault("truth", exc)
    on_step(HARNESS, "inputs")
    try:
        inputs = materialize(case, device, tail_poison=poison, on_device=on_device)
    except Exception as exc:
        return harness_fault("inputs", exc)
    if on_device:  # before prepare, so that nothing the adapter does can change it
        on_step(HARNESS, "truth")
        try:
            expected = device_truth(inputs, logits_precision=precision)
        except Exception as exc:
            return harness_fault("truth", exc)
    on_step(IMPL, "prepare")
    try:
        prepared = adapter.prepare(inputs)
    except (Exception, SystemExit) as exc:  # the implementation's fault, never fatal
        return impl_fault("prepare", exc)
    on_step(IMPL, "run")
    try:
        out = adapter.run(prepared)
        synchronize(device)
    except (Exception, SystemExit) as exc:
        return impl_fault("run", exc)
    on_step(IMPL, "describe")
    try:
        details = adapter.describe(prepared)
    except (Exception, SystemExit) as exc:
        return impl_fault("describe", exc, "describe raised: ")
    if not isinstance(details, dict):
        return Verdict(Status.ERROR, f"describe returned a {type(details).__name__}, not a "
                       "dict", "describe", tail_poison=poison)
    on_step(HARNESS, "compare")
    try:
        comparison = tolerance.compare(out, expected, case.dtype, inputs.cu_seqlens_q.cpu())
    except Exception as exc:
        return harness_fault("compare", exc)
    verdict = Verdict(Status.PASS if comparison.passed else Status.FAIL, comparison.reason,
                      None if comparison.passed else "compare", comparison, poison,
                      precision, truth_site, details, prepared=prepared)
    if comparison.passed and poison == "stale" and probe_nan_tail:
        on_step(IMPL, "nan-tail probe")
        verdict.nan_tail_output_finite = nan_tail_output_finite(adapter, case, device,
                                                                on_device=on_device)
    return verdict


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


__all__ = ["CASE_LOGITS_MARK", "HARNESS", "IMPL", "STALE_TAIL_MARK", "Verdict", "assert_conforms",
           "describe_exception", "inputs_for", "judge", "nan_tail_output_finite",
           "synchronize", "tail_poison"]
