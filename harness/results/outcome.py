"""From a check's verdict to its results line: :func:`result_record` adds the case's
derived figures (bytes moved, FLOPs, bandwidth, fractions of the device's peaks, the
roofline floor) and the environment to the verdict's status, figures and timing, and
validates the line (:class:`~.record.ResultRecord`)."""

from __future__ import annotations

from pagedbench.reference import PagedCase

from pagedbench.harness.cases.workloads import workload_fields
from pagedbench.harness.measure.timing import Timing
from pagedbench.harness.measure.roofline import bytes_moved, flops, roofline_floor_ms
from pagedbench.harness.results import floor
from pagedbench.harness.results.record import (SCHEMA_VERSION, DevicePeaks, Environment,
                                               ListingRow, ResultRecord, comparison_figures,
                                               now)
from pagedbench.harness.verdict.judging import Verdict
from pagedbench.harness.verdict.status import Status


def timing_of(verdict: Verdict | None) -> Timing | None:
    """The :class:`~pagedbench.harness.measure.timing.Timing` of a verdict's checked
    timing (None when it has none)."""
    timed = verdict.timing if verdict is not None else None
    return None if timed is None else Timing.from_message(timed.model_dump())


def result_record(
    *, run_id: str, env: Environment, suite: str, device: str, name: str, target: str,
    case: PagedCase, status: Status, reason: str = "", step: str | None = None,
    row: ListingRow | None = None, verdict: Verdict | None = None,
    timing: Timing | None = None, peaks: DevicePeaks | None = None, truth: str | None = None,
) -> ResultRecord:
    """The result line of ``name`` on ``case``; ``row`` is what the implementation said
    when it loaded (version, details, interpreted), ``verdict`` its check (whose timing
    is used unless ``timing`` is given), ``peaks`` what the device sustained (for
    fractions of peak and the roofline floor, and the physical floor: a pass whose time
    is impossible is a ``fail``, :func:`~pagedbench.harness.results.floor.judged`),
    ``truth`` where its truth was computed (``"host"`` or ``"device"``).

    Raises
    ------
    pydantic.ValidationError
        If something the adapter returned (``describe()``) is not JSON data.
    """
    timing = timing or timing_of(verdict)
    seconds = timing.median_ms / 1e3 if timing else 0.0
    moved, work = bytes_moved(case), flops(case)
    gbps = moved / seconds / 1e9 if seconds > 0 else None
    tflops = work / seconds / 1e12 if seconds > 0 else None
    floor_ms = roofline_floor_ms(moved, work, peaks) if peaks else None
    details = dict(row.details) if row else {}
    if verdict is not None:
        details |= verdict.details
    return floor.judged(ResultRecord.model_validate(dict(
        kind="result", schema_version=SCHEMA_VERSION, run_id=run_id, suite=suite,
        impl=name, impl_target=target, impl_version=row.version if row else "",
        impl_details=details, case_id=case.case_id, case=case.to_dict(),
        **workload_fields(case, suite), device=device,
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


__all__ = ["result_record", "timing_of"]
