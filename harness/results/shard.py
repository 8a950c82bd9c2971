"""Sharding a plan over machines (``pagedbench run|bench --shard K/N``, or ``--shard
auto`` from the CI's own variables) and merging the shards back (``pagedbench report``,
``pagedbench gate``).

- :func:`~.shard_spec.resolve`: ``K/N``, or ``auto`` from the CI's variables (the
  :class:`~.shard_spec.ShardSpec`; its own module, imported before anything heavy).
- :func:`assign`: the plan's (implementation, case) pairs in N shards balanced by expected
  cost, greedily, largest first, onto the least loaded shard (the LPT rule, within 4/3 of
  the best balance: Graham, "Bounds on multiprocessing timing anomalies", 1969). A pair's
  cost is :func:`pair_cost`, the bytes its case moves
  (:func:`~pagedbench.harness.measure.roofline.bytes_moved`) plus a fixed cost per pair:
  computed from the case alone, integers only, ties broken by names, so every machine given
  the same plan makes the same shards. (The interpreter cost model of Triton adapters needs
  the adapter, which the parent never imports.) With ``--balance-from FILE``
  (:func:`measured_seconds`) the cost of a pair is the seconds it took there, and of a pair
  it lacks its bytes at the seconds per byte of those it has (:func:`pair_costs`); the same
  file gives the same shards.
- Each shard's run records the whole plan and a :class:`~.record.Shard`: K, N, the plan's
  SHA-256 (:func:`plan_sha256`), its number of pairs and how they were balanced; it runs
  only its pairs.
- :func:`merged_lines`: the lines of results files read together, once, after checking
  that their sharded runs are of one plan, one N and one balance, every shard present on
  every device that ran one, and no pair measured twice on one device; else
  :class:`ShardMergeError` (exit 2) naming the files. Runs without ``--shard`` are not
  checked.
"""

from __future__ import annotations

import hashlib
import heapq
import json
import warnings
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from pagedbench.reference import PagedCase, PagedValueError

from pagedbench.harness.results.record import Plan, ResultRecord, RunRecord, Shard, result_key
from pagedbench.harness.results.shard_spec import ShardSpec
from pagedbench.harness.results.store import numbered_lines
from pagedbench.harness.measure.roofline import bytes_moved

#: What every pair costs beside its bytes (bytes): a worker's call overhead, so that
#: shards of many tiny points are balanced by their count.
PAIR_COST_BYTES = 1 << 20

Pair = tuple[str, str]


def plan_sha256(plan: Plan) -> str:
    """SHA-256 (hex) of ``plan``'s JSON with sorted keys: the same plan, the same hash."""
    text = json.dumps(plan.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def pair_cost(case: PagedCase) -> int:
    """Expected cost of one pair on ``case`` (bytes):
    :func:`~pagedbench.harness.measure.roofline.bytes_moved` plus :data:`PAIR_COST_BYTES`."""
    return bytes_moved(case) + PAIR_COST_BYTES


#: Measured seconds of (implementation, case id) pairs (:func:`measured_seconds`).
Seconds = Mapping[Pair, float]


def pair_costs(plan: Plan, seconds: Seconds | None = None) -> dict[Pair, int]:
    """The cost of each of the plan's pairs: :func:`pair_cost` (bytes) without
    ``seconds``; with them, microseconds: a measured pair's, and for a pair they lack its
    :func:`pair_cost` at the microseconds per byte of the plan's measured pairs (bytes
    alone where none is measured). Integers, so every machine computes the same."""
    by_bytes = {(impl.name, c.case_id): pair_cost(c) for impl in plan.impls
                for c in plan.paged_cases()}
    measured = {pair: seconds[pair] for pair in by_bytes if seconds and pair in seconds}
    if not measured:
        return by_bytes
    per_byte = sum(measured.values()) * 1e6 / sum(by_bytes[p] for p in measured)
    return {pair: round(measured[pair] * 1e6) if pair in measured else round(cost * per_byte)
            for pair, cost in by_bytes.items()}


def balance_of(plan: Plan, seconds: Seconds | None = None) -> str | None:
    """What a shard records of how it was balanced: None for bytes (no ``seconds`` of the
    plan's pairs), else ``seconds:`` and the SHA-256 of the pairs' costs."""
    if not seconds or not any(pair in seconds for pair in pair_costs(plan)):
        return None
    text = json.dumps(sorted(pair_costs(plan, seconds).items()), separators=(",", ":"))
    return "seconds:" + hashlib.sha256(text.encode()).hexdigest()


def assign(plan: Plan, count: int, seconds: Seconds | None = None) -> list[set[Pair]]:
    """The plan's (implementation name, case id) pairs in ``count`` shards (index 0 is
    shard 1/N): largest :func:`pair_costs` first (ties: implementation, then case id), each
    onto the shard with the least cost so far (ties: the lowest index)."""
    if count < 1:
        raise PagedValueError("count", count, "an int >= 1")
    costs = pair_costs(plan, seconds)
    pairs = sorted(((cost, impl, case) for (impl, case), cost in costs.items()),
                   key=lambda p: (-p[0], p[1], p[2]))
    shards: list[set[Pair]] = [set() for _ in range(count)]
    loads = [(0, i) for i in range(count)]
    for cost, impl, case in pairs:
        load, index = heapq.heappop(loads)
        shards[index].add((impl, case))
        heapq.heappush(loads, (load + cost, index))
    return shards


def pairs_of(plan: Plan, spec: ShardSpec, seconds: Seconds | None = None) -> set[Pair]:
    """The pairs shard ``spec`` of ``plan`` runs (:func:`assign`)."""
    return assign(plan, spec.count, seconds)[spec.index - 1]


def shard_record(plan: Plan, spec: ShardSpec, seconds: Seconds | None = None) -> Shard:
    """What the ``started`` line of shard ``spec`` of ``plan`` records."""
    return Shard(index=spec.index, count=spec.count, plan_sha256=plan_sha256(plan),
                 pairs=len(pairs_of(plan, spec, seconds)), balance=balance_of(plan, seconds))


def measured_seconds(paths: Iterable[Path]) -> dict[Pair, float]:
    """The seconds each (implementation, case id) pair took in the results files or
    folders ``paths`` (``--balance-from``): the time from the record before it in its run
    and device slot (``env.device_index``; the run's start or resumption for the first),
    to its own: its worker's start where it was the first, its inputs, calls, timing and
    judging. A pair measured in several runs keeps the last.

    Raises
    ------
    ResultsFileError
        From reading a file (:func:`~.store.numbered_lines`).
    """
    started: dict[str, datetime] = {}
    last: dict[tuple[str, str | None], datetime] = {}
    out: dict[Pair, float] = {}
    for _, _, line in numbered_lines(paths):
        if isinstance(line, RunRecord):
            if line.event in ("started", "resumed"):
                started[line.run_id] = line.timestamp
                for key in [k for k in last if k[0] == line.run_id]:
                    del last[key]
            continue
        slot = (line.run_id, line.env.device_index)
        before = last.get(slot, started.get(line.run_id))
        last[slot] = line.timestamp
        if before is not None:
            out[(line.impl, line.case_id)] = max(0.0, (line.timestamp - before).total_seconds())
    return out


def recorded_pairs(plan: Plan, lines: Iterable[ResultRecord | RunRecord],
                   run_id: str, seconds: Seconds | None = None) -> set[Pair] | None:
    """The pairs run ``run_id`` runs, from its last ``started`` line among ``lines``
    (``--resume``): its shard's (:func:`pairs_of` of ``plan``, with the ``seconds`` it was
    balanced by), or None for a run without ``--shard``.

    Raises
    ------
    PagedValueError
        If ``plan`` is not the plan the shard was made of (its hash differs), or
        ``seconds`` do not balance it as it was (``--balance-from``).
    """
    starts = [line for line in lines if isinstance(line, RunRecord)
              and line.run_id == run_id and line.event == "started"]
    shard = starts[-1].shard if starts else None
    if shard is None:
        return None
    if plan_sha256(plan) != shard.plan_sha256:
        raise PagedValueError("--resume", run_id, "a shard of the plan it recorded",
                              f"--resume {run_id}: its plan's hash is not the "
                              f"{shard.plan_sha256[:12]} its shard recorded")
    if balance_of(plan, seconds) != shard.balance:
        recorded = "bytes moved" if shard.balance is None else "measured seconds"
        raise PagedValueError("--balance-from", run_id, "the balance the shard recorded", (
            f"--resume {run_id}: its shard was balanced by {recorded}, which the options "
            "given do not reproduce: give the --balance-from FILE it ran with, or none"))
    return pairs_of(plan, ShardSpec(shard.index, shard.count), seconds)


class ShardMergeError(PagedValueError):
    """Shards that do not make one plan: of another plan or N, missing, or measuring a
    pair twice on one device; the message names the files (exit 2)."""

    def __init__(self, problem: str) -> None:
        super().__init__("results files", "shards", "the shards of one plan, each once "
                         "per device", problem)


@dataclass
class _Run:
    file: Path
    line: int
    shard: Shard
    devices: set[str]


def merged_lines(paths: Iterable[Path]) -> list[ResultRecord | RunRecord]:
    """Every line of ``paths`` (results files or folders of them), read once
    (:func:`~.store.numbered_lines`), once the sharded runs among them are checked to merge
    into their plan: one plan hash and one N among them, on each device (the name in the
    results' environment) that ran a shard every shard 1..N (a shard without pairs counts
    everywhere), and no (implementation, case) measured by two runs on one device.

    Raises
    ------
    ShardMergeError
        Naming the files of a shard of another plan or N, the device and the shards
        missing (and the files of those present), or the two files of a pair measured
        twice.
    ResultsFileError
        From reading a file.
    """
    numbered = list(numbered_lines(paths))
    _check_merge(numbered)
    lines = [line for _, _, line in numbered]
    _warn_remeasured(lines)
    return lines


def _warn_remeasured(lines: list[ResultRecord | RunRecord]) -> None:
    """One warning when some points (:func:`~.record.result_key`) have results of more than
    one run among ``lines``: readers show each point's result measured last
    (:func:`~.record.latest`), the others unseen."""
    runs: dict[tuple[str, str, str, str], set[str]] = defaultdict(set)
    for line in lines:
        if isinstance(line, ResultRecord):
            runs[result_key(line)].add(line.run_id)
    twice = [ids for ids in runs.values() if len(ids) > 1]
    if twice:
        names = sorted(set().union(*twice))
        shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        warnings.warn(f"{len(twice)} point(s) measured by more than one run ({shown}): each "
                      "shows the result measured last; name one run's file to read only its "
                      "results", stacklevel=2)


def _check_merge(numbered: list[tuple[Path, int, ResultRecord | RunRecord]]) -> None:
    """:func:`merged_lines`' check, on the lines read with their file and line number."""
    runs: dict[str, _Run] = {}
    results: list[tuple[Path, int, ResultRecord]] = []
    for file, number, line in numbered:
        if isinstance(line, RunRecord) and line.event == "started" and line.shard is not None:
            runs[line.run_id] = _Run(file, number, line.shard, set())
        elif isinstance(line, ResultRecord):
            results.append((file, number, line))
    if not runs:
        return
    first = next(iter(runs.values()))
    for run in runs.values():
        if (run.shard.plan_sha256, run.shard.count) != (first.shard.plan_sha256,
                                                        first.shard.count):
            raise ShardMergeError(
                f"{run.file}:{run.line}: shard {run.shard.index}/{run.shard.count} of plan "
                f"{run.shard.plan_sha256[:12]} is not a shard of the plan of {first.file} "
                f"(shard {first.shard.index}/{first.shard.count} of plan "
                f"{first.shard.plan_sha256[:12]}): merge only the shards of one plan")
        if run.shard.balance != first.shard.balance:
            raise ShardMergeError(
                f"{run.file}:{run.line}: shard {run.shard.index}/{run.shard.count} was "
                f"balanced by {run.shard.balance or 'bytes'}, shard "
                f"{first.shard.index}/{first.shard.count} of {first.file} by "
                f"{first.shard.balance or 'bytes'}: their pairs may overlap or miss some; "
                "give every shard the same --balance-from FILE")
    seen: dict[tuple[str, str, str], tuple[Path, int, str]] = {}
    for file, number, record in results:
        run = runs.get(record.run_id)
        if run is None:
            continue
        run.devices.add(record.env.device)
        key = (record.env.device, record.impl, record.case_id)
        before = seen.setdefault(key, (file, number, record.run_id))
        if before[::2] != (file, record.run_id):  # another run, or a copy of this one
            raise ShardMergeError(
                f"{record.impl} on {record.case_id} was measured twice on "
                f"{record.env.device}: {before[0]}:{before[1]} and {file}:{number}: give "
                "each shard once")
    by_device: dict[str, dict[int, list[Path]]] = defaultdict(lambda: defaultdict(list))
    for run in runs.values():
        for device in run.devices:
            by_device[device][run.shard.index].append(run.file)
    empty = {run.shard.index for run in runs.values() if run.shard.pairs == 0}
    for device, present in sorted(by_device.items()):
        absent = [k for k in range(1, first.shard.count + 1) if k not in present
                  and k not in empty]
        if absent:
            have = "; ".join(f"{k}/{first.shard.count} in {', '.join(map(str, files))}"
                             for k, files in sorted(present.items()))
            raise ShardMergeError(
                f"plan {first.shard.plan_sha256[:12]} on {device}: shard"
                f"{'s' if len(absent) > 1 else ''} "
                f"{', '.join(f'{k}/{first.shard.count}' for k in absent)} missing (have "
                f"{have})")


__all__ = ["PAIR_COST_BYTES", "ShardMergeError", "assign", "balance_of", "measured_seconds",
           "merged_lines", "pair_cost", "pair_costs", "pairs_of", "plan_sha256",
           "recorded_pairs", "shard_record"]
