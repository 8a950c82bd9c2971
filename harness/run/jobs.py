"""The worker's job bodies (run in the worker process that
:func:`~pagedbench.harness.run.protocol.worker_main` starts, the only one that imports an
adapter): ``evaluate`` (one implementation on cases: the implementation's side of each
check, :func:`~pagedbench.harness.verdict.conformance.implementation_side`, its messages
sent over the channel and the judge's replies fed back), ``loop`` (the serving loop's
implementation side, :func:`~pagedbench.harness.verdict.serving.implementation_side`, one
tick per item), ``list`` (implementations' availability) and ``peaks`` (the device's copy
bandwidth and bf16 throughput).
"""

from __future__ import annotations

from typing import Any

import torch
from pydantic import ValidationError

from pagedbench.adapters import Adapter, load
from pagedbench.reference import PagedCase

from pagedbench.harness.measure.cuda_timers import release_device_memory
from pagedbench.harness.measure.timing import (DriftProbe, Timing, device_l2_bytes,
                                               measure_peaks, point_plan, time_cpu,
                                               time_cuda_point, time_once)
from pagedbench.harness.results.record import DevicePeaks, ListingRow
from pagedbench.harness.run.config import RunConfig
from pagedbench.harness.run.environment import heavy_imports
from pagedbench.harness.run.protocol import Channel
from pagedbench.harness.verdict import conformance, judging, serving
from pagedbench.harness.verdict.messages import (Data, Entered, Fatal, Go, Loaded, LoopTick,
                                                 Output, Ready, TimeIt, Timed, Waiting,
                                                 Watched, validation_problem)
from pagedbench.harness.verdict.status import Status

#: The reply each message waits for.
_REPLIES = {Ready: Go, Output: TimeIt, Timed: Watched}


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


def _load(name: str, target: str, device: str, channel: Channel,
          item: int | None) -> tuple[Adapter | None, ListingRow, str]:
    """Import ``target`` and ask it about itself: the adapter (None when that failed), its
    row (an ``error`` row when it failed) and the step it got to."""
    channel.step(item, "import")
    try:
        with heavy_imports():
            adapter = load(target)
    except (Exception, SystemExit) as exc:
        return None, ListingRow.error(name, target, "error", f"importing {target} raised "
                                      f"{judging.describe_exception(exc)}"), "import"
    channel.step(item, "available")
    try:
        return adapter, _listing(name, target, adapter, device), "available"
    except ValidationError as exc:
        reason = ("available/capabilities returned data that is not JSON: "
                  f"{validation_problem(exc)}")
    except (Exception, SystemExit) as exc:
        reason = (f"available/is_interpreted/capabilities raised "
                  f"{judging.describe_exception(exc)}")
    return None, ListingRow.error(name, target, "error", reason), "available"


def _start(job: dict[str, Any], device: str,
           channel: Channel) -> tuple[Adapter, ListingRow] | None:
    """Load the job's implementation and tell the parent: ``Fatal`` when that failed, else
    ``Loaded`` with its row. The adapter and its row when it is available on ``device``,
    else None (nothing more to do)."""
    adapter, row, step = _load(job["name"], job["target"], device, channel, None)
    if adapter is None:
        channel.send(Fatal(status=str(Status.ERROR), step=step, reason=row.reason))
        return None
    channel.send(Loaded(row=row.model_dump(mode="json")))
    return (adapter, row) if row.available else None


def timer_for(config: RunConfig, interpreted: bool) -> conformance.Timer:
    """How the worker times ``run`` under ``config``: one wall-clock call for an
    interpreter; on a GPU the point's one method for every implementation
    (:func:`~pagedbench.harness.measure.timing.point_plan`: cold events, or graph replay
    over rotated input copies); blocks of calls with a drift probe on the CPU. Each call of
    a CPU timing, and on a GPU the pre-roll's first and each cold sample, comes between
    its ``before`` and ``after``."""
    def timer(call, before, after, case: PagedCase, copy) -> Timing:
        if interpreted:
            before(0)
            out: list[object] = []
            timing = time_once(lambda: out.append(call()))
            after(0, out[0])
            return timing
        if torch.device(config.device).type == "cuda":
            with torch.cuda.device(torch.device(config.device)):
                plan = point_plan(case, device_l2_bytes(config.device))
                return time_cuda_point([call, *(copy() for _ in range(plan.copies - 1))],
                                       plan, before=before, after=after)
        probe = DriftProbe(case)
        return time_cpu(call, threads=config.threads, warmup=config.warmup,
                        min_samples=config.repetitions, min_run_time_s=config.time_budget_s,
                        max_run_time_s=config.time_limit_s,
                        probe=probe if probe.enabled else None, before=before, after=after)
    return timer


def _drive(side: Any, channel: Channel, item: int) -> None:
    """Send each message of ``side`` (a check's implementation side) for ``item``, feeding
    back the reply each kind waits for."""
    reply = None
    while True:
        try:
            message = side.send(reply)
        except StopIteration:
            return
        if isinstance(message, Entered):
            channel.step(item, message.step)
            reply = None
            continue
        channel.send(message.model_copy(update={"item": item}))
        wanted = _REPLIES.get(type(message))
        reply = channel.receive(wanted) if wanted else None


def _evaluate_job(job: dict[str, Any], channel: Channel) -> None:
    """The implementation's side of a run: per case, the check's implementation side."""
    config = RunConfig.from_dict(job["config"], RunConfig.cache_dir)
    torch.set_num_threads(config.threads)
    started = _start(job, config.device, channel)
    if started is None:
        return
    adapter, row = started
    timer = timer_for(config, bool(row.interpreted))
    for index in range(job["start"], len(job["cases"])):
        channel.step(index, "case")
        case = PagedCase.from_dict(job["cases"][index])
        side = conformance.implementation_side(
            adapter, case, config.device, on_device=job["sites"][index] == "device",
            timer=timer)
        _drive(side, channel, index)
        if torch.device(config.device).type == "cuda":
            release_device_memory()  # the case's pools and copies, before the next


def _loop_job(job: dict[str, Any], channel: Channel) -> None:
    """The serving loop's implementation side: one pool and one adapter for every tick,
    each tick an item."""
    device = job["device"]
    torch.set_num_threads(job["threads"])
    started = _start(job, device, channel)
    if started is None:
        return
    side = serving.implementation_side(started[0], serving.LoopSpec.model_validate(job["spec"]),
                                       device)
    item, reply = 0, None
    while True:
        try:
            message = side.send(reply)
        except StopIteration:
            return
        reply = None
        if isinstance(message, Entered):
            channel.step(item, message.step)
            continue
        channel.send(message.model_copy(update={"item": item}))
        if isinstance(message, Waiting):
            reply = channel.receive(LoopTick)
        else:
            item += 1


def _list_job(job: dict[str, Any], channel: Channel) -> None:
    for index in range(job["start"], len(job["entries"])):
        name, target = job["entries"][index]
        _, row, _ = _load(name, target, job["device"], channel, index)
        channel.send(Data(item=index, data=row.model_dump(mode="json")))


def _peaks_job(job: dict[str, Any], channel: Channel) -> None:
    channel.step(0, "device peaks")
    peaks = measure_peaks(job["device"], job["threads"])
    channel.send(Data(item=0, data=DevicePeaks.model_validate(peaks.to_dict())
                      .model_dump(mode="json")))


def work(job: dict[str, Any], channel: Channel) -> None:
    """The body of a worker process (:func:`~.protocol.worker_main`): its job by kind."""
    {"evaluate": _evaluate_job, "loop": _loop_job, "list": _list_job,
     "peaks": _peaks_job}[job["kind"]](job, channel)
