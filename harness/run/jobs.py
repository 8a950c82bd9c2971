"""The worker's job bodies, the implementation's side of a run (run in the worker process,
:mod:`.worker`, the only one that imports an adapter): an ``evaluate`` job (one
implementation on cases: per case ``why_unsupported``; then, once the parent has the truth,
inputs, ``prepare``, ``run``, ``describe`` and the output; then, if the parent says so, the
timing), a ``list`` job (implementations' availability) or a ``peaks`` job (the device's
copy bandwidth and bf16 throughput). Each step is announced to the parent first
(:meth:`~.protocol.Channel.step`), which charges it to its party's budget.
"""

from __future__ import annotations

import itertools
from functools import partial
from typing import Any

import torch
from pydantic import ValidationError

from pagedbench.adapters import Adapter, load
from pagedbench.reference import PagedCase, PagedTypeError, PagedValueError, materialize

from pagedbench.harness.measure.timing import (DriftProbe, Timing, measure_peaks, time_cpu,
                                               time_cuda, time_once)
from pagedbench.harness.results.record import (DevicePeaks, ListingRow, to_json_data,
                                               validation_problem)
from pagedbench.harness.run.config import RunConfig
from pagedbench.harness.run.judge import SPOT_EVERY, encode_output, spot_case
from pagedbench.harness.run.protocol import Channel
from pagedbench.harness.run.records import error_row
from pagedbench.harness.verdict import conformance
from pagedbench.harness.verdict.status import Status


def _listing(name: str, target: str, adapter: Adapter, device: str) -> ListingRow:
    """What ``adapter`` says about itself, validated as JSON data (raises
    ``ValidationError`` or whatever the adapter raises)."""
    availability = adapter.available(device)
    return ListingRow(
        name=name, target=target,
        status="available" if availability.ok is True else "unavailable",
        description=type(adapter).description, available=availability.ok,
        reason=availability.reason, version=availability.version,
        details=availability.details, interpreted=adapter.is_interpreted(device),
        capabilities=adapter.capabilities(device).to_dict(),
    )


def _load_listing(name: str, target: str, device: str, channel: Channel,
                  item: int | None) -> tuple[Adapter | None, ListingRow, str]:
    """Import ``target`` and ask it about itself: the adapter (None when that failed), its
    row (an ``error`` row when it failed) and the step it got to."""
    channel.step(item, conformance.IMPL, "import")
    try:
        adapter = load(target)
    except (Exception, SystemExit) as exc:
        return None, error_row(name, target, "error", f"importing {target} raised "
                                f"{conformance.describe_exception(exc)}"), "import"
    channel.step(item, conformance.IMPL, "available")
    try:
        return adapter, _listing(name, target, adapter, device), "available"
    except ValidationError as exc:
        reason = ("available/capabilities returned data that is not JSON: "
                  f"{validation_problem(exc)}")
    except (Exception, SystemExit) as exc:
        reason = (f"available/is_interpreted/capabilities raised "
                  f"{conformance.describe_exception(exc)}")
    return None, error_row(name, target, "error", reason), "available"


def _time(adapter: Adapter, prepared: Any, spot: Any, case: PagedCase, config: RunConfig,
          interpreted: bool) -> tuple[Timing, list[object]]:
    """Time ``adapter.run`` on ``prepared``, every :data:`~.judge.SPOT_EVERY`-th call
    (the first included) on ``spot`` instead (prepared from the fresh inputs of
    :func:`~.judge.spot_case`; None: no spot check): the timing and the last output on
    each (``[on prepared, on spot]``, None for one never called)."""
    preps = [prepared] if spot is None else [spot, prepared]
    last: list[object] = [None] * len(preps)
    calls = itertools.count()

    def call() -> object:
        index = min(next(calls) % SPOT_EVERY, len(preps) - 1)
        last[index] = adapter.run(preps[index])
        return last[index]

    if interpreted:
        timing = time_once(call)
    elif torch.device(config.device).type == "cuda":
        with torch.cuda.device(torch.device(config.device)):
            timing = time_cuda(call)
    else:
        probe = DriftProbe(case)
        timing = time_cpu(call, threads=config.threads, warmup=config.warmup,
                          min_samples=config.repetitions, min_run_time_s=config.time_budget_s,
                          max_run_time_s=config.time_limit_s,
                          probe=probe if probe.enabled else None)
    conformance.synchronize(config.device)
    return timing, [last[-1], last[0] if spot is not None else None]


def _outcome(channel: Channel, index: int, verdict: conformance.Verdict) -> None:
    channel.send({"kind": "outcome", "item": index, "status": str(verdict.status),
                  "step": verdict.step, "reason": verdict.reason})


def _timed(channel: Channel, index: int, adapter: Adapter, done: conformance.Attempt,
           case: PagedCase, config: RunConfig, interpreted: bool, spot: bool) -> None:
    """Time ``done.prepared`` (with spot checks on fresh inputs when ``spot``) and send the
    timing with the last outputs (``timed``), or what was raised."""
    try:
        fresh = None
        if spot:
            fresh = adapter.prepare(materialize(spot_case(case), config.device,
                                                tail_poison=done.tail_poison))
        timing, outs = _time(adapter, done.prepared, fresh, case, config, interpreted)
        encoded = [None if out is None else encode_output(out, checked)
                   for out, checked in zip(outs, (case, spot_case(case)))]
    except (Exception, SystemExit) as exc:
        channel.send({"kind": "timed", "item": index,
                      "error": conformance.describe_exception(exc)})
        return
    channel.send({"kind": "timed", "item": index, "samples_ms": list(timing.samples_ms),
                  "method": timing.method, "probe_ms": list(timing.probe_ms),
                  "outputs": [None if e is None else e[0] for e in encoded]},
                 b"".join(e[1] for e in encoded if e is not None))


def _evaluate_job(job: dict[str, Any], channel: Channel) -> None:
    """The implementation's side of a run (see :class:`~.judge.Judge` for the parent's):
    per case, ``why_unsupported``; then, once the parent has the truth, inputs,
    ``prepare``, ``run``, ``describe`` and the output; then, if the parent says so, the
    timing."""
    config = RunConfig.from_dict(job["config"], RunConfig.cache_dir)
    torch.set_num_threads(config.threads)
    name, target = job["name"], job["target"]
    adapter, row, step = _load_listing(name, target, config.device, channel, None)
    if adapter is None:
        channel.send({"kind": "fatal", "status": str(Status.ERROR), "step": step,
                      "reason": row.reason})
        return
    channel.send({"kind": "loaded", "row": row.model_dump_json()})
    if not row.available:
        return
    for index in range(job["start"], len(job["cases"])):
        on_step = partial(channel.step, index)
        on_step(conformance.IMPL, "case")
        case = PagedCase.from_dict(job["cases"][index])
        claimed = conformance.claims(adapter, case, config.device, on_step)
        if claimed.verdict is not None:
            _outcome(channel, index, claimed.verdict)
            continue
        channel.send({"kind": "ready", "item": index, "tail_poison": claimed.tail_poison,
                      "logits_precision": claimed.logits_precision})
        if not channel.receive()["go"]:
            continue
        done = conformance.attempt(adapter, case, config.device, claimed, on_step=on_step,
                                   on_device=job["sites"][index] == "device")
        if done.verdict is not None:
            _outcome(channel, index, done.verdict)
            continue
        on_step(conformance.IMPL, "output")
        try:
            details = to_json_data(done.details, "impl_details")
        except (PagedTypeError, PagedValueError) as exc:
            _outcome(channel, index, conformance.Verdict(
                Status.ERROR, f"describe returned data that is not JSON: {exc}", "describe"))
            continue
        try:
            descriptor, payload = encode_output(done.out, case)
        except (Exception, SystemExit) as exc:
            _outcome(channel, index, conformance.Verdict(
                Status.ERROR, f"its output cannot be read: {conformance.describe_exception(exc)}",
                "run"))
            continue
        channel.send({"kind": "output", "item": index, "outputs": [descriptor],
                      "details": details,
                      "nan_tail_output_finite": done.nan_tail_output_finite}, payload)
        reply = channel.receive()
        if reply["time"]:
            on_step(conformance.IMPL, "timing")
            _timed(channel, index, adapter, done, case, config, bool(row.interpreted),
                   reply["spot"])


def _list_job(job: dict[str, Any], channel: Channel) -> None:
    for index in range(job["start"], len(job["entries"])):
        name, target = job["entries"][index]
        _, row, _ = _load_listing(name, target, job["device"], channel, index)
        channel.send({"kind": "output", "item": index, "data": row.model_dump_json()})


def _peaks_job(job: dict[str, Any], channel: Channel) -> None:
    channel.step(0, conformance.HARNESS, "device peaks")
    peaks = measure_peaks(job["device"], job["threads"])
    channel.send({"kind": "output", "item": 0,
                  "data": DevicePeaks.model_validate(peaks.to_dict()).model_dump_json()})


def work(job: dict[str, Any], channel: Channel) -> None:
    """The body of a worker process (:func:`~.worker.main`): an ``evaluate`` job (one
    implementation on cases), a ``list`` job (implementations' availability) or a
    ``peaks`` job (the device's copy bandwidth and bf16 throughput)."""
    {"evaluate": _evaluate_job, "list": _list_job, "peaks": _peaks_job}[job["kind"]](
        job, channel)
