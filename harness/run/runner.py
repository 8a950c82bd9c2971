"""The runner: every implementation of a plan on every case, each in its own worker.

For each implementation a worker (the ``evaluate`` job of :mod:`.jobs`, started and
supervised by :class:`~.protocol.Supervisor`) imports the adapter (the only process that
does), asks ``available`` once and runs the implementation's side of each case
(:func:`~pagedbench.harness.verdict.conformance.implementation_side`: ``why_unsupported``,
``prepare``, ``run``, ``describe`` and, for a pass, the timing), sending back only its
output and timings. The judge's side
(:class:`~pagedbench.harness.verdict.judging.CaseJudge`, one per case) runs here, in the
parent: the truth (cached by :mod:`pagedbench.harness.verdict.truth`), the yardstick and the
comparison, from inputs it draws itself from the case's seed, so that nothing the
implementation does reaches them. Each result is a validated
:class:`~pagedbench.harness.results.record.ResultRecord`
(:func:`~pagedbench.harness.results.outcome.result_record`), appended to the results file at
once. Everything the worker does is the implementation's and shares ``case_timeout_s`` per
case (import and ``available`` once); the judge's work has ``harness_timeout_s``, and a
worker's start-up its own. A step past its budget is recorded against its party
(``timeout``, or ``harness-error``); a worker that dies costs the case in flight a
``crash``, one that sends what its job does not allow an ``error``; a fault while loading
costs every remaining case of that implementation; otherwise a fresh worker continues with
the next case. One implementation's failure never loses another's results.

A run records its plan when it starts and ``finished`` when it ends, so that
:func:`run` with ``resume=True`` completes an interrupted run without redoing the
(implementation, case) pairs already in its file. SIGTERM, SIGINT and SIGHUP stop the
run cleanly (the worker's process group is killed, ``interrupted`` is recorded) and raise
:class:`Interrupted`.
"""

from __future__ import annotations

import contextlib
import random
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Iterator
from dataclasses import replace
from functools import partial
from typing import Any

from pydantic import ValidationError

from pagedbench.reference import PagedCase, PagedValueError

from pagedbench.harness.results.record import (SCHEMA_VERSION, DevicePeaks, Environment,
                                               ListingRow, Plan, PlannedImpl, ResultRecord,
                                               RunRecord, Shard, now)
from pagedbench.harness.results.store import ResultsFile, environment, results_of
from pagedbench.harness.results.outcome import result_record
from pagedbench.harness.run import replay
from pagedbench.harness.run.config import RunConfig
from pagedbench.harness.run.environment import worker_environment
from pagedbench.harness.run.processes import tree_cpu_seconds
from pagedbench.harness.run.protocol import Answer, Fault, Supervisor
from pagedbench.harness.run.spread import DeviceSlot, Stop, device_slots, spread
from pagedbench.harness.verdict import judging
from pagedbench.harness.verdict.messages import (HARNESS, IMPL, JOB_STEPS, Data, Fatal, Loaded,
                                                 Message, as_json, validation_problem)
from pagedbench.harness.verdict.status import Status, exit_code
from pagedbench.harness.verdict.truth import device_truth_for, truth_for, truth_site


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


# The parent's side ----------------------------------------------------------------------
#: Verdicts whose reason ends with the command that replays the case.
REPLAYED = (Status.FAIL, Status.ERROR)


#: The judge threads (:func:`bounded`) whose work has not returned. ``Thread.is_alive``
#: cannot tell: a signal that interrupts ``join`` marks the running thread stopped
#: (CPython's bpo-45274 handling in ``Thread._wait_for_tstate_lock``, Python 3.11).
_JUDGING: set[threading.Thread] = set()


def judges_running() -> bool:
    """Whether a judge thread is still at its work: one left past its budget, or past a
    signal that stopped the run (they are daemons, in the middle of pagedbench's own torch
    work)."""
    return bool(_JUDGING)


def bounded(work: Callable[[], Any], seconds: float, what: str) -> Any:
    """``work()`` in a thread, given ``seconds``; raises TimeoutError past them (the
    thread is left to finish: pagedbench's own computation, never an implementation's)."""
    found: dict[str, Any] = {}

    def target() -> None:
        try:
            found["value"] = work()
        except BaseException as exc:  # re-raised in the caller
            found["error"] = exc
        finally:
            _JUDGING.discard(threading.current_thread())

    thread = threading.Thread(target=target, name=f"judge-{what}", daemon=True)
    _JUDGING.add(thread)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        raise TimeoutError(f"took longer than {seconds:g} s (--harness-timeout)")
    if "error" in found:
        raise found["error"]
    return found["value"]


class _Budget:
    """The judge's work on one case (:func:`~pagedbench.harness.verdict.judging.judged_here`),
    within what is left of ``seconds`` (``--harness-timeout``)."""

    def __init__(self, seconds: float) -> None:
        self.seconds, self.spent_s = seconds, 0.0

    def __call__(self, work: Callable[[], Any], what: str) -> Any:
        start = time.monotonic()
        try:
            return bounded(lambda: judging.judged_here(work, what),
                           self.seconds - self.spent_s, what)
        finally:
            self.spent_s += time.monotonic() - start


def fault_outcome(fault: Fault, config: RunConfig) -> tuple[Status, str]:
    """Status and reason of the item a :class:`~.protocol.Fault` hit, charged to its party."""
    if fault.party == IMPL:
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


def device_peaks(config: RunConfig) -> tuple[DevicePeaks | None, str]:
    """Measure the copy bandwidth and bf16 throughput of ``config.device`` in a worker
    (:func:`~pagedbench.harness.measure.timing.measure_peaks`, with ``config.threads``): the peaks,
    or None and why the measurement failed (a run goes on without them)."""
    worker_env = worker_environment(config.device, config.cache_dir)
    job = {"kind": "peaks", "device": config.device, "threads": config.threads}
    found: list[DevicePeaks] = []

    def on_message(message: Message) -> Answer:
        if not isinstance(message, Data):
            raise judging.Refused(f"a {message.kind!r} message in a peaks job")
        found.append(DevicePeaks.model_validate(message.data))
        return Answer(item_done=True)

    supervisor = Supervisor(job, worker_env, {HARNESS: config.harness_timeout_s}, JOB_STEPS["peaks"])
    try:
        fault = supervisor.run(on_message)
    except (ValidationError, judging.Refused) as exc:
        return None, f"the worker sent invalid peaks ({exc})"
    if found:
        return found[0], ""
    return None, f"{fault.step}: {fault.detail}" if fault else "the worker sent no peaks"


class _Evaluation:
    """The parent's side of one implementation's ``evaluate`` job: a
    :class:`~pagedbench.harness.verdict.judging.CaseJudge` per case (its truths cached
    under ``config.cache_dir``, its work within ``config.harness_timeout_s``), the
    listing row the worker sent when it loaded, and each concluded case's record."""

    def __init__(self, name: str, target: str, cases: list[PagedCase], sites: list[str],
                 config: RunConfig, judge_device: str, record: Callable[..., None]) -> None:
        self.name, self.target, self.cases, self.sites = name, target, cases, sites
        self.config, self.judge_device, self.record = config, judge_device, record
        self.row: ListingRow | None = None
        self.start = 0
        self.worker_pid: int | None = None
        self.rng = random.Random()
        self.judge: judging.CaseJudge | None = None

    def begin(self, worker_pid: int) -> None:
        """A fresh worker (``worker_pid``) begins at :attr:`start`: a fresh judge."""
        self.worker_pid, self.judge = worker_pid, None

    def _case_judge(self) -> judging.CaseJudge:
        if self.judge is None:
            cache = self.config.cache_dir
            self.judge = judging.CaseJudge(
                self.cases[self.start], self.judge_device, site=self.sites[self.start],
                truth=partial(truth_for, cache_dir=cache),
                device_truth=partial(device_truth_for, cache_dir=cache),
                timing=self.config.timing, samples=self.config.repetitions, rng=self.rng,
                work=_Budget(self.config.harness_timeout_s),
                cpu_seconds=lambda: tree_cpu_seconds(self.worker_pid),
                threads=self.config.threads)
        return self.judge

    def max_payload_bytes(self) -> int:
        """The largest payload a message of this job may carry: an output and its LSE, or
        the judged timed calls' outputs and LSEs."""
        most = max((c.total_q * c.num_q_heads * c.v_head_dim * 4 for c in self.cases), default=0)
        return 2 * judging.JUDGED * most

    def on_message(self, message: Message) -> Answer:
        """Answer the worker (see :class:`~pagedbench.harness.verdict.judging.CaseJudge`).

        Raises
        ------
        judging.Refused
            If the message is not one the job can get now.
        """
        if isinstance(message, Loaded):
            try:
                self.row = ListingRow.model_validate(message.row)
            except ValidationError as exc:
                raise judging.Refused(validation_problem(exc)) from exc
            if not self.row.available:
                self._rest(Status.UNAVAILABLE, self.row.reason, "available")
            return Answer()
        if isinstance(message, Fatal):  # a loading fault is always the implementation's
            self._rest(Status.ERROR, message.reason, message.step)
            return Answer()
        judge = self._case_judge()
        reply = judge.handle(message)
        if judge.verdict is None:
            return Answer(as_json(reply) if reply is not None else None)
        verdict = judge.verdict
        if verdict.status in REPLAYED:
            hint = replay.hint(self.cases[self.start], self.name,
                               timed=verdict.step == "timing")
            verdict = replace(verdict, reason=f"{verdict.reason}; {hint}")
        self.record(self.cases[self.start], verdict.status, verdict.reason, verdict.step,
                    verdict)
        self.start += 1
        self.judge = None
        return Answer(as_json(reply) if reply is not None else None, item_done=True)

    def _rest(self, status: Status, reason: str, step: str | None) -> None:
        for case in self.cases[self.start:]:
            self.record(case, status, reason, step)
        self.start = len(self.cases)


def run_target(name: str, target: str, cases: list[PagedCase], config: RunConfig,
               run_id: str, env: Environment, emit: Callable[[ResultRecord], None],
               peaks: DevicePeaks | None = None, slot: DeviceSlot | None = None,
               stop: Stop | None = None) -> None:
    """Evaluate ``cases`` with the adapter ``target`` in worker processes, judged here
    (:class:`_Evaluation`), calling ``emit`` with each record as it arrives; faults
    become records too. ``peaks`` (the device's, measured once per run) go into every
    record. A case whose truth fits nowhere (:func:`~pagedbench.harness.verdict.truth.truth_site`)
    is a ``harness-error`` without a worker. With a ``slot`` (:mod:`.spread`), the workers
    run there and the judge on its ``judge_device``; ``stop`` cancels them."""
    judge_device = slot.judge_device if slot else config.device
    evaluation: _Evaluation | None = None

    def record(case: PagedCase, status: Status, reason: str, step: str | None,
               verdict: judging.Verdict | None = None) -> None:
        row = evaluation.row if evaluation else None
        fields = dict(run_id=run_id, env=env, suite=config.suite, device=config.device,
                      name=name, target=target, case=case, row=row, peaks=peaks,
                      status=status, reason=reason, step=step, verdict=verdict,
                      truth=verdict.truth_site if verdict else None)
        try:
            emit(result_record(**fields))
        except ValidationError as exc:
            emit(result_record(**fields | dict(
                status=Status.ERROR, step="describe", verdict=replace(verdict, details={}),
                reason=f"describe returned data that is not JSON: {validation_problem(exc)}")))

    sited: list[tuple[PagedCase, str]] = []
    for case in cases:
        try:
            sited.append((case, truth_site(case, judge_device, config.host_truth_bytes)))
        except PagedValueError as exc:  # the CLI leaves such points out before
            record(case, Status.HARNESS_ERROR, str(exc), "truth")
    cases, sites = [c for c, _ in sited], [s for _, s in sited]
    if not cases:
        return
    evaluation = _Evaluation(name, target, cases, sites, config, judge_device, record)
    worker_config = replace(config, device=slot.worker_device, devices="") if slot else config
    worker_env = (worker_environment(worker_config.device, config.cache_dir)
                  | (slot.environment() if slot else {}))
    job = {"kind": "evaluate", "name": name, "target": target,
           "cases": [c.to_dict() for c in cases], "sites": sites,
           "config": worker_config.to_dict()}
    while evaluation.start < len(cases):
        start = evaluation.start
        supervisor = Supervisor(job | {"start": start}, worker_env,
                                {IMPL: config.case_timeout_s}, JOB_STEPS["evaluate"],
                                evaluation.max_payload_bytes(), on_start=evaluation.begin)
        try:
            with stop.watching(supervisor) if stop else contextlib.nullcontext():
                fault = supervisor.run(evaluation.on_message)
        except judging.Refused as exc:
            fault = Fault("invalid", evaluation.start, IMPL, "result",
                          f"sent a message the parent refuses ({exc})")
        if fault is None:
            if evaluation.start < len(cases):  # done without all results: pagedbench's bug
                for case in cases[evaluation.start:]:
                    record(case, Status.HARNESS_ERROR, "the worker finished without this "
                           "result", "result")
            return
        status, reason = fault_outcome(fault, config)
        if fault.item is None:  # while loading: every remaining case
            for case in cases[evaluation.start:]:
                record(case, status, reason, fault.step)
            return
        if evaluation.start < len(cases):
            record(cases[evaluation.start], status, reason, fault.step)
        evaluation.start += 1


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
    those pairs of the plan run: a shard (:mod:`pagedbench.harness.results.shard`), whose
    ``shard`` the ``started`` record names. With ``config.devices``, the pairs run on those
    devices at once (:mod:`.spread`). Returns every result of the run.

    Raises
    ------
    Interrupted
        On SIGTERM, SIGINT or SIGHUP (recorded as ``interrupted``; resumable).
    PagedValueError
        If ``config.devices`` names devices this machine lacks (before anything is
        recorded).
    """
    slots = device_slots(config.devices, config.device)
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
    units = [(impl, todo) for impl in plan.impls
             if (todo := [c for c in cases if (impl.name, c.case_id) not in done])]
    with _interruptible():
        try:
            if slots:
                _spread(units, slots, config, run_id, emit, peaks)
            else:
                for impl, todo in units:
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


def _spread(units: list[tuple[PlannedImpl, list[PagedCase]]], slots: list[DeviceSlot],
            config: RunConfig, run_id: str, emit: Callable[[ResultRecord], None],
            peaks: DevicePeaks | None) -> None:
    """:func:`run`'s units over ``slots`` (:func:`~.spread.spread`): each implementation's
    cases dealt round-robin into one part per slot, so that its parts run side by side;
    each record names its slot (``env.device_index``, ``env.device_uuid``, the GPU's
    name); ``emit`` is called under a lock, never after the run stopped."""
    envs = {slot: Environment.model_validate(
        environment(slot.judge_device) | {"threads": config.threads, "device_index": slot.index,
                                          "device_uuid": slot.uuid}) for slot in slots}
    parts = [(impl, todo[i::len(slots)]) for impl, todo in units
             for i in range(min(len(slots), len(todo)))]
    lock = threading.Lock()

    def work(part: tuple[PlannedImpl, list[PagedCase]], slot: DeviceSlot, stop: Stop) -> None:
        def guarded(record: ResultRecord) -> None:
            with lock:
                stop.check()  # what a cancelled worker still reports is not a result
                emit(record)

        impl, todo = part
        run_target(impl.name, impl.target, todo, config, run_id, envs[slot], guarded, peaks,
                   slot, stop)

    spread(parts, slots, work)


__all__ = ["Interrupted", "RunConfig", "device_peaks", "judges_running", "make_plan", "missing",
           "run", "run_target"]
