"""The records a run writes for each (implementation, case): :func:`result_record`
(status, verdict figures, timing, roofline, environment), the status a worker's fault
costs the case in flight (:func:`fault_outcome`), and the listing row of an
implementation that could not answer (:func:`error_row`)."""

from __future__ import annotations

from pagedbench.reference import PagedCase

from pagedbench.harness.cases.workloads import workload_fields
from pagedbench.harness.measure.timing import Timing, bytes_moved, flops, roofline_floor_ms
from pagedbench.harness.results import floor
from pagedbench.harness.results.record import (SCHEMA_VERSION, DevicePeaks, Environment,
                                               ListingRow, ResultRecord, comparison_figures,
                                               now)
from pagedbench.harness.run.config import RunConfig
from pagedbench.harness.run.protocol import Fault
from pagedbench.harness.verdict import conformance
from pagedbench.harness.verdict.status import Status


def result_record(
    *, run_id: str, env: Environment, config: RunConfig, name: str, target: str,
    case: PagedCase, status: Status, reason: str = "", step: str | None = None,
    row: ListingRow | None = None, verdict: conformance.Verdict | None = None,
    timing: Timing | None = None, peaks: DevicePeaks | None = None, truth: str | None = None,
) -> ResultRecord:
    """The result line of ``name`` on ``case``; ``row`` is what the implementation said
    when it loaded (version, details, interpreted), ``verdict`` its check, ``peaks``
    what the device sustained (for fractions of peak and the roofline floor, and the
    physical floor: a pass whose time is impossible is a ``fail``, :func:`~pagedbench.
    harness.results.floor.judged`), ``truth`` where its truth was computed (``"host"``
    or ``"device"``).

    Raises
    ------
    pydantic.ValidationError
        If something the adapter returned (``describe()``) is not JSON data.
    """
    seconds = timing.median_ms / 1e3 if timing else 0.0
    moved, work = bytes_moved(case), flops(case)
    gbps = moved / seconds / 1e9 if seconds > 0 else None
    tflops = work / seconds / 1e12 if seconds > 0 else None
    floor_ms = roofline_floor_ms(moved, work, peaks) if peaks else None
    details = dict(row.details) if row else {}
    if verdict is not None:
        details |= verdict.details
    return floor.judged(ResultRecord.model_validate(dict(
        kind="result", schema_version=SCHEMA_VERSION, run_id=run_id, suite=config.suite,
        impl=name, impl_target=target, impl_version=row.version if row else "",
        impl_details=details, case_id=case.case_id, case=case.to_dict(),
        **workload_fields(case, config.suite), device=config.device,
        status=status, reason=reason, step=step,
        **comparison_figures(verdict.comparison if verdict else None),
        time_ms=timing.to_dict() if timing else None,
        time_ms_median=timing.median_ms if timing else None,
        timing_method=timing.method if timing else None,
        interpreted=row.interpreted if row else None,
        tail_poison=verdict.tail_poison if verdict else None,
        logits_precision=verdict.logits_precision if verdict else None,
        truth=truth,
        nan_tail_output_finite=verdict.nan_tail_output_finite if verdict else None,
        bytes_moved=moved, flops=work, bandwidth_gbps=gbps, tflops=tflops,
        arithmetic_intensity=work / moved, peaks=peaks,
        frac_of_peak_bandwidth=gbps / peaks.copy_gbps if peaks and gbps else None,
        frac_of_peak_tflops=tflops / peaks.bf16_tflops if peaks and tflops else None,
        roofline_floor_ms=floor_ms,
        frac_of_roofline=floor_ms / timing.median_ms if floor_ms and timing else None,
        env=env, timestamp=now(),
    ), context={"case": case}))


def fault_outcome(fault: Fault, config: RunConfig) -> tuple[Status, str]:
    """Status and reason of the item a :class:`~.protocol.Fault` hit, charged to its party."""
    if fault.party == conformance.IMPL:
        if fault.kind == "timeout":
            return Status.TIMEOUT, (f"{fault.step} took longer than {config.case_timeout_s:g} s "
                                    "(--case-timeout)")
        if fault.kind == "crash":
            return Status.CRASH, f"worker {fault.detail} during {fault.step}"
        return Status.ERROR, f"worker {fault.detail} during {fault.step}"
    budget = f"{config.harness_timeout_s:g} s (--harness-timeout)"
    detail = f"took longer than {budget}" if fault.kind == "timeout" else f"worker {fault.detail}"
    return (Status.HARNESS_ERROR,
            f"pagedbench's {fault.step}: {detail}; not the implementation's fault")


def error_row(name: str, target: str, status: str, reason: str) -> ListingRow:
    """The listing row of an implementation that could not answer: ``status`` (``error``,
    ``crash``, ``timeout``) and why."""
    return ListingRow(name=name, target=target, status=status, description="", available=False,
                      reason=reason, version="", details={}, interpreted=None, capabilities=None)


__all__ = ["error_row", "fault_outcome", "result_record"]
