"""The runner: every implementation of a plan on every case, each in its own worker.

For each implementation a worker (:mod:`.worker`, supervised by
:class:`~.protocol.Supervisor`) imports the adapter (the only process that does), asks
``available``, then per case ``why_unsupported``, ``prepare``, ``run``, ``describe`` and, for a
pass, the timing, and sends back only its output (and timings). The judge (:class:`~.judge.Judge`) runs here, in the parent: the
truth (cached by :mod:`pagedbench.harness.verdict.truth`), the yardstick and the comparison, from
inputs it draws itself from the case's seed, so that nothing the implementation does reaches them.
Each result is a validated :class:`~pagedbench.harness.results.record.ResultRecord`, appended to
the results file at once. Everything the worker does is the implementation's and shares
``case_timeout_s`` per case (import and ``available`` once); the judge's work has
``harness_timeout_s``, and a worker's start-up its own. A step past its budget is recorded against
its party (``timeout``, or ``harness-error``); a worker that dies costs the case in flight a
``crash``, one that sends what its job does not allow an ``error``; a fault while loading costs
every remaining case of that implementation; otherwise a fresh worker continues with the next case.
One implementation's failure never loses another's results.

A run records its plan when it starts and ``finished`` when it ends, so that
:func:`run` with ``resume=True`` completes an interrupted run without redoing the
(implementation, case) pairs already in its file. SIGTERM, SIGINT and SIGHUP stop the
run cleanly (the worker's process group is killed, ``interrupted`` is recorded) and raise
:class:`Interrupted`.
The worker's side, its job bodies, is :mod:`.worker`.
"""

from __future__ import annotations

import contextlib
import math
import signal
import threading
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Iterator
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from pagedbench.adapters import Entry
from pagedbench.reference import PagedCase, PagedValueError

from pagedbench.harness.cases.workloads import workload_fields
from pagedbench.harness.measure.timing import (CPU_THREADS, Timing, bytes_moved, flops,
                                               roofline_floor_ms)
from pagedbench.harness.results.record import (SCHEMA_VERSION, DevicePeaks, Environment,
                                               ListingRow, Plan, PlannedImpl, ResultRecord,
                                               RunRecord, Shard, comparison_figures, now,
                                               validation_problem)
from pagedbench.harness.results.store import ResultsFile, environment, results_of
from pagedbench.harness.run.environment import worker_environment
from pagedbench.harness.run.judge import Judge, Outcome, Refused
from pagedbench.harness.run.protocol import Answer, Fault, Supervisor
from pagedbench.harness.verdict import conformance
from pagedbench.harness.verdict.status import Status, exit_code
from pagedbench.harness.verdict.truth import truth_site

#: Seconds ``pagedbench list`` gives each implementation to import and answer.
LIST_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class RunConfig:
    """How to run and time.

    Attributes
    ----------
    device : str
        ``"cpu"``, ``"cuda"`` or ``"cuda:N"``.
    timing : bool
        Time implementations whose output passed.
    warmup, repetitions : int
        CPU timing: untimed calls, then at least this many samples (time permitting).
    time_budget_s, time_limit_s : float
        CPU timing: measure for at least ``time_budget_s``, longer when ``repetitions``
        samples of a slow call need it, never longer than ``time_limit_s`` (s).
    threads : int
        ``torch.set_num_threads`` in every worker (fixed, recorded in ``env.threads``;
        default :data:`~pagedbench.harness.measure.timing.CPU_THREADS`).
    case_timeout_s : float
        The implementation's budget per case, everything its worker does: its import and
        ``available`` (once), then ``why_unsupported``, inputs, ``prepare``, ``run``,
        ``describe`` and the timing (s). Past it: ``timeout``.
    harness_timeout_s : float
        pagedbench's budget per case for the judge's work in the parent: truths and
        comparisons (s). Past it: ``harness-error``. (A worker's start-up has
        ``protocol.STARTUP_TIMEOUT_S``.)
    cache_dir : Path
        Where float64 truths are cached between workers and runs.
    host_truth_bytes : int or None
        Largest :func:`~pagedbench.harness.verdict.truth.truth_bytes` of a case whose truth is
        computed on the host; larger ones get a device truth
        (:func:`~pagedbench.harness.verdict.truth.truth_site`). ``None``:
        :func:`~pagedbench.harness.verdict.truth.host_budget_bytes` of the machine the worker runs
        on.
    suite : str
        Recorded in each result (``"default"``, ``"gpu-lane"``, ``"bench"``, ...); in a
        ``"bench"`` run each result also names its workload
        (:func:`~pagedbench.harness.cases.workloads.workload_fields`).

    Raises
    ------
    PagedValueError
        On a device other than cpu/cuda/cuda:N, or a count or budget out of range.
    """

    device: str = "cpu"
    timing: bool = True
    warmup: int = 1
    repetitions: int = 10
    time_budget_s: float = 0.5
    time_limit_s: float = 5.0
    threads: int = CPU_THREADS
    case_timeout_s: float = 300.0
    harness_timeout_s: float = 600.0
    cache_dir: Path = Path("build")
    suite: str = "default"
    host_truth_bytes: int | None = None

    def __post_init__(self) -> None:
        text = self.device if isinstance(self.device, str) else ""
        kind, colon, index = text.partition(":")
        if kind not in ("cpu", "cuda") or (colon and not (kind == "cuda" and index.isdigit())):
            raise PagedValueError("device", self.device, "'cpu', 'cuda' or 'cuda:N'")
        for name, low in (("warmup", 0), ("repetitions", 1), ("threads", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise PagedValueError(name, value, f"an int >= {low}")
        for name in ("time_budget_s", "time_limit_s", "case_timeout_s", "harness_timeout_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise PagedValueError(name, value, "a finite number of seconds > 0")
        budget = self.host_truth_bytes
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int)
                                   or budget < 0):
            raise PagedValueError("host_truth_bytes", budget, "None or an int >= 0 (bytes)")
        if self.time_limit_s < self.time_budget_s:
            raise PagedValueError("time_limit_s", self.time_limit_s,
                                  f">= time_budget_s ({self.time_budget_s})")
        object.__setattr__(self, "cache_dir", Path(self.cache_dir))

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready; the cache folder is left out (it belongs to the machine)."""
        out = asdict(self)
        del out["cache_dir"]
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any], cache_dir: Path) -> RunConfig:
        """Inverse of :meth:`to_dict`, with ``cache_dir``; unknown keys are ignored."""
        known = {f.name for f in fields(cls)} - {"cache_dir"}
        return cls(**{k: v for k, v in data.items() if k in known}, cache_dir=cache_dir)


class Interrupted(BaseException):
    """The run was stopped by a signal (``signum``); its results so far are on disk and
    ``resume`` finishes it."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"interrupted by {signal.Signals(signum).name}")
        self.signum = signum


@contextlib.contextmanager
def _interruptible() -> Iterator[None]:
    """SIGTERM, SIGINT and SIGHUP raise :class:`Interrupted` (in the main thread only:
    elsewhere the handlers cannot be set)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: object) -> None:
        raise Interrupted(signum)

    signums = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
    previous = {s: signal.signal(s, handler) for s in signums}
    try:
        yield
    finally:
        for s, old in previous.items():
            signal.signal(s, old)


def make_plan(impls: dict[str, str], cases: list[PagedCase]) -> Plan:
    """The plan of a run: implementations ``{name: target}`` (in order) x ``cases``.

    Raises
    ------
    PagedValueError
        If two cases have the same case id (results are keyed by it).
    """
    try:
        return Plan.model_validate(
            {"impls": [PlannedImpl(name=n, target=t) for n, t in impls.items()],
             "cases": [c.to_dict() for c in cases]}, context={"cases": cases})
    except ValidationError as exc:
        raise PagedValueError("cases", [c.case_id for c in cases], "distinct case ids",
                              f"cases: {validation_problem(exc)}") from None


# Records ------------------------------------------------------------------------------
def result_record(
    *, run_id: str, env: Environment, config: RunConfig, name: str, target: str,
    case: PagedCase, status: Status, reason: str = "", step: str | None = None,
    row: ListingRow | None = None, verdict: conformance.Verdict | None = None,
    timing: Timing | None = None, peaks: DevicePeaks | None = None, truth: str | None = None,
) -> ResultRecord:
    """The result line of ``name`` on ``case``; ``row`` is what the implementation said
    when it loaded (version, details, interpreted), ``verdict`` its check, ``peaks``
    what the device sustained (for fractions of peak and the roofline floor), ``truth``
    where its truth was computed (``"host"`` or ``"device"``).

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
    return ResultRecord.model_validate(dict(
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
    ), context={"case": case})


def _fault_outcome(fault: Fault, config: RunConfig) -> tuple[Status, str]:
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


# The parent's side ----------------------------------------------------------------------
#: The steps of each job kind, in the order a worker may enter them within one item.
EVALUATE_STEPS = ("import", "available", "case", "why_unsupported", "inputs", "prepare",
                  "run", "describe", "nan-tail probe", "output", "timing")
LIST_STEPS = ("import", "available")
PEAKS_STEPS = ("device peaks",)


def device_peaks(config: RunConfig) -> tuple[DevicePeaks | None, str]:
    """Measure the copy bandwidth and bf16 throughput of ``config.device`` in a worker
    (:func:`~pagedbench.harness.measure.timing.measure_peaks`, with ``config.threads``): the peaks,
    or None and why the measurement failed (a run goes on without them)."""
    worker_env = worker_environment(config.device, config.cache_dir)
    job = {"kind": "peaks", "device": config.device, "threads": config.threads}
    found: list[DevicePeaks] = []

    def on_message(message: dict[str, Any]) -> Answer:
        found.append(DevicePeaks.model_validate_json(message["data"]))
        return Answer(item_done=True)

    supervisor = Supervisor(job, worker_env, {conformance.HARNESS: config.harness_timeout_s},
                            PEAKS_STEPS)
    try:
        fault = supervisor.run(on_message)
    except (ValidationError, KeyError) as exc:
        return None, f"the worker sent invalid peaks ({exc})"
    if found:
        return found[0], ""
    return None, f"{fault.step}: {fault.detail}" if fault else "the worker sent no peaks"


def run_target(name: str, target: str, cases: list[PagedCase], config: RunConfig,
               run_id: str, env: Environment, emit: Callable[[ResultRecord], None],
               peaks: DevicePeaks | None = None) -> None:
    """Evaluate ``cases`` with the adapter ``target`` in worker processes, judged here
    (:class:`~.judge.Judge`), calling ``emit`` with each record as it arrives; faults
    become records too. ``peaks`` (the device's, measured once per run) go into every
    record. A case whose truth fits nowhere (:func:`~pagedbench.harness.verdict.truth.truth_site`)
    is a ``harness-error`` without a worker."""
    row: ListingRow | None = None

    def record(case: PagedCase, status: Status, reason: str, step: str | None,
               outcome: Outcome | None = None) -> ResultRecord:
        fields = dict(run_id=run_id, env=env, config=config, name=name, target=target,
                      case=case, row=row, peaks=peaks)
        if outcome is None:
            return result_record(**fields, status=status, reason=reason, step=step)
        verdict = outcome.verdict
        try:
            return result_record(**fields, status=verdict.status, reason=verdict.reason,
                                 step=verdict.step, verdict=verdict, timing=outcome.timing,
                                 truth=outcome.truth)
        except ValidationError as exc:
            return result_record(
                **fields, status=Status.ERROR, step="describe", truth=outcome.truth,
                reason=f"describe returned data that is not JSON: {validation_problem(exc)}",
                verdict=replace(verdict, details={}))

    sited: list[tuple[PagedCase, str]] = []
    for case in cases:
        try:
            sited.append((case, truth_site(case, config.device, config.host_truth_bytes)))
        except PagedValueError as exc:  # the CLI leaves such points out before
            emit(record(case, Status.HARNESS_ERROR, str(exc), "truth"))
    cases, sites = [c for c, _ in sited], [s for _, s in sited]
    if not cases:
        return
    judge = Judge(name, cases, sites, device=config.device, threads=config.threads,
                  timing=config.timing, cache_dir=config.cache_dir,
                  harness_timeout_s=config.harness_timeout_s)
    worker_env = worker_environment(config.device, config.cache_dir)
    job = {"kind": "evaluate", "name": name, "target": target,
           "cases": [c.to_dict() for c in cases], "sites": sites, "config": config.to_dict()}
    start = 0

    def on_message(message: dict[str, Any]) -> Answer:
        nonlocal row, start
        kind = message["kind"]
        if kind == "loaded":
            try:
                row = ListingRow.model_validate_json(message["row"])
            except (ValidationError, KeyError, TypeError) as exc:
                raise Refused(str(exc)) from exc
            if not row.available:
                for case in cases[start:]:
                    emit(record(case, Status.UNAVAILABLE, row.reason, "available"))
                start = len(cases)
            return Answer()
        if kind == "fatal":
            step, reason = str(message.get("step")), str(message.get("reason"))
            for case in cases[start:]:  # a loading fault is always the implementation's
                emit(record(case, Status.ERROR, reason, step))
            start = len(cases)
            return Answer()
        answer, outcome = judge.receive(start, message)
        if outcome is not None:
            emit(record(cases[start], outcome.verdict.status, "", None, outcome))
            start += 1
        return answer

    while start < len(cases):
        supervisor = Supervisor(job | {"start": start}, worker_env,
                                {conformance.IMPL: config.case_timeout_s}, EVALUATE_STEPS,
                                judge.max_payload_bytes())
        try:
            fault = supervisor.run(on_message)
        except Refused as exc:
            fault = Fault("invalid", start, conformance.IMPL, "result",
                          f"sent a message the parent refuses ({exc})")
        judge.reset()  # a fresh worker begins the next case
        if fault is None:
            if start < len(cases):  # done without all results: pagedbench's own bug
                for case in cases[start:]:
                    emit(record(case, Status.HARNESS_ERROR, "the worker finished without "
                                "this result", "result"))
            return
        status, reason = _fault_outcome(fault, config)
        if fault.item is None:  # while loading: every remaining case
            for case in cases[start:]:
                emit(record(case, status, reason, fault.step))
            return
        if start < len(cases):
            emit(record(cases[start], status, reason, fault.step))
        start += 1


def missing(plan: Plan, records: Iterable[ResultRecord]) -> list[tuple[str, str]]:
    """The (implementation, case id) pairs of ``plan`` without a result among ``records``:
    what a resume still has to do, or what a run stopped at a budget did not."""
    done = {(r.impl, r.case_id) for r in records}
    return [(i.name, c.case_id) for i in plan.impls for c in plan.paged_cases()
            if (i.name, c.case_id) not in done]


def run(plan: Plan, config: RunConfig, results: ResultsFile, run_id: str,
        on_record: Callable[[ResultRecord], None] | None = None, *,
        resume: bool = False, peaks: DevicePeaks | None = None,
        left_out: list[str] | None = None, shard: Shard | None = None,
        pairs: Collection[tuple[str, str]] | None = None) -> list[ResultRecord]:
    """Evaluate every implementation of ``plan`` on every case, appending each record to
    ``results`` as it arrives (and passing it to ``on_record``, for progress).

    With ``resume=True``, the pairs ``results`` already holds for ``run_id`` are kept and
    only the others are run. Records ``started`` (with the plan) or ``resumed`` first
    (with ``peaks``, the device's, measured by :func:`device_peaks`) and ``finished``
    (with the exit code) last; ``left_out`` (points the caller left out, with why) goes
    into the ``started`` record. With ``pairs`` (implementation name, case id), only
    those pairs of the plan run: a shard (:mod:`.shard`), whose ``shard`` the ``started``
    record names. Returns every result of the run.

    Raises
    ------
    Interrupted
        On SIGTERM, SIGINT or SIGHUP (recorded as ``interrupted``; resumable).
    """
    env = Environment.model_validate(environment(config.device) | {"threads": config.threads})
    records = ([r for r in results_of(results.lines()) if r.run_id == run_id]
               if resume else [])
    done = {(r.impl, r.case_id) for r in records}
    if pairs is not None:  # another shard's pairs count as done
        done |= {(i.name, c.case_id) for i in plan.impls for c in plan.paged_cases()} - set(pairs)
    results.append(RunRecord(
        kind="run", schema_version=SCHEMA_VERSION, run_id=run_id, timestamp=now(),
        event="resumed" if resume else "started", plan=None if resume else plan,
        config=config.to_dict(), exit_code=None, counts=None, device_peaks=peaks,
        left_out=None if resume else left_out, shard=None if resume else shard))

    def emit(record: ResultRecord) -> None:
        results.append(record)
        records.append(record)
        if on_record is not None:
            on_record(record)

    cases = plan.paged_cases()
    with _interruptible():
        try:
            for impl in plan.impls:
                todo = [c for c in cases if (impl.name, c.case_id) not in done]
                if todo:
                    run_target(impl.name, impl.target, todo, config, run_id, env, emit, peaks)
        except Interrupted as exc:
            results.append(RunRecord(
                kind="run", schema_version=SCHEMA_VERSION, run_id=run_id, timestamp=now(),
                event="interrupted", plan=None, config=None, exit_code=128 + exc.signum,
                counts=None))
            raise
    counts = Counter(r.status for r in records)
    results.append(RunRecord(
        kind="run", schema_version=SCHEMA_VERSION, run_id=run_id, timestamp=now(),
        event="finished", plan=None, config=None,
        exit_code=int(exit_code(r.status for r in records)), counts=dict(counts)))
    return records


def list_adapters(found: list[Entry], device: str, cache_dir: Path,
                  timeout_s: float = LIST_TIMEOUT_S) -> list[ListingRow]:
    """What each implementation says about itself on ``device`` (``pagedbench list``),
    asked in a worker: a plug-in that crashes or hangs at import gets a ``crash`` or
    ``timeout`` row and the others are still listed."""
    env = worker_environment(device, cache_dir)
    job = {"kind": "list", "device": device, "entries": [(e.name, e.target) for e in found]}
    rows: list[ListingRow] = []

    def on_message(message: dict[str, Any]) -> Answer:
        entry = found[len(rows)]
        try:
            rows.append(ListingRow.model_validate_json(message["data"]))
        except (ValidationError, KeyError, TypeError) as exc:
            rows.append(error_row(entry.name, entry.target, "error",
                                   f"the worker sent an invalid listing ({exc})"))
        return Answer(item_done=True)

    while len(rows) < len(found):
        supervisor = Supervisor(job | {"start": len(rows)}, env, {conformance.IMPL: timeout_s},
                                LIST_STEPS)
        fault = supervisor.run(on_message)
        if fault is None:
            break
        index = len(rows) if fault.item is None else fault.item
        if index < len(found):
            entry = found[index]
            what = fault.detail if fault.kind == "timeout" else f"worker {fault.detail}"
            status = {"timeout": "timeout", "crash": "crash"}.get(fault.kind, "error")
            rows.append(error_row(entry.name, entry.target, status, f"{fault.step}: {what}"))
    return rows


__all__ = ["EVALUATE_STEPS", "Interrupted", "LIST_STEPS", "PEAKS_STEPS", "RunConfig",
           "device_peaks", "error_row", "list_adapters", "make_plan", "missing",
           "result_record", "run", "run_target"]
