"""The GPU lane: one call on a bare GPU machine checks and times what it has.

Started by ``scripts/gpu_lane.sh`` (which makes ``pagedbench`` importable and installs the
carried wheels first)::

    python -m pagedbench.harness.lane.steps --out DIR [--device cuda|cpu]
        [--git-sha SHA --dirty 0|1] [--impl NAME ...] [--points N] [--started-at T]

First the time model of the plan (:mod:`.model`) is printed, and a plan over its limit
refused (exit 2). Then the steps, each a child process with its own budget
(:data:`BUDGETS_S`), in the order that returns the most first: ``env`` (``env.json``: the
machine, its copy bandwidth and bf16 rate measured), ``list`` (``list.json``),
``warmup`` (every implementation's kernels compiled at once, :mod:`.warmup`; the host
truths computed beside it), ``conformance`` (``pagedbench run --no-timing`` on the
conformance cases: ``conformance.jsonl``, ``junit.xml``) and ``sweep`` (``pagedbench bench
--point-major``: every implementation, the baseline included, at a point before the
next; ``sweep.jsonl``/``.md``), which has what is left of :data:`TOTAL_BUDGET_S`. A step
past its budget gets SIGINT, then SIGKILL after :data:`GRACE_S`; what it wrote by then
stays (the results files are appended line by line). After ``list`` the sweep's points
are fitted again to the implementations found available.

The commit and dirtiness come from outside (no ``.git`` travels) and reach every result line
through :data:`~pagedbench.harness.results.store.GIT_SHA_ENV`. At the end the folder is
packed to at most :data:`MAX_FILES_BACK` plain files (:data:`KEPT_FILES`, the rest in
``logs.tar.gz``), ``lane.json`` records every step, the model and what was measured, and a
summary line starting with :data:`~.outcome.SUMMARY_PREFIX` is printed last. Exit 0 when
every step passed within budget, else 1. ``--device cpu`` is the CI rehearsal
(:data:`CPU_SELECTION`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pagedbench.harness.lane import BUILD, ROOT
from pagedbench.harness.lane.outcome import lane_record, summary_line
from pagedbench.harness.lane.model import (COSTS, H200_L2_BYTES, LanePlan, lane_model,
                                           model_table, points_that_fit)
from pagedbench.harness.lane.probe import available_impls, environment_record, write_listing
from pagedbench.harness.lane.sweep import (CPU_SELECTION, CUDA_SELECTION, SWEEP_BASELINE,
                                           Selection, conformance_command, flags,
                                           sweep_command, sweep_coverage,
                                           write_sweep_markdown, write_truths)
from pagedbench.harness.results.store import GIT_DIRTY_ENV, GIT_SHA_ENV, new_run_id
from pagedbench.harness.run.environment import cache_environment

DEVICES = ("cuda", "cpu")
#: Per-step budgets (s), by device; ``truths`` starts with ``warmup`` and runs beside it
#: (the host's cores), within a budget no longer than the warm-up's. The sweep has what is
#: left of :data:`TOTAL_BUDGET_S`.
BUDGETS_S = {
    "cuda": {"env": 40, "list": 45, "warmup": 90, "truths": 90, "conformance": 150},
    "cpu": {"env": 60, "list": 60, "warmup": 60, "truths": 60, "conformance": 90},
}
#: Cap on the whole lane (s), from the start of scripts/gpu_lane.sh (``--started-at``), by
#: device: each step's budget is cut to what is left. CUDA: 9 minutes, so that a machine's
#: start (1-2 minutes) and the lane fit the 15 minutes of device time a session of the
#: project's GPU machine has. CPU: room for a host shared with other jobs.
TOTAL_BUDGET_S = {"cuda": 540, "cpu": 300}
#: Seconds between SIGINT and SIGKILL for a step past its budget.
GRACE_S = 10
#: Files the device machine sends back: at most 8, plain, at the top of the folder.
MAX_FILES_BACK = 8
ARCHIVE = "logs.tar.gz"
KEPT_FILES = ("lane.json", "env.json", "list.json", "junit.xml", "conformance.jsonl",
              "sweep.jsonl", "sweep.md", ARCHIVE)
#: Written into the output folder by scripts/gpu_lane.sh before the lane starts.
LAUNCHER_FILES = ("pip.log",)
_SHA = re.compile(r"[0-9a-f]{40}")


@dataclass
class Step:
    """One step's outcome, as recorded in ``lane.json``."""

    name: str
    command: list[str]
    budget_s: float
    returncode: int | None = None
    wall_s: float = 0.0
    timed_out: bool = False
    log: str = ""
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out

    @property
    def state(self) -> str:
        if self.returncode is None and not self.timed_out:
            return "not run"
        return "ok" if self.ok else "out of budget" if self.timed_out else f"exit {self.returncode}"


def _child_env() -> dict[str, str]:
    """This process's environment, with caches under ``build/`` unless already set."""
    return {**os.environ, **cache_environment(BUILD)}


def start_step(step: Step, out: Path) -> tuple[subprocess.Popen, contextlib.ExitStack, float]:
    """Start ``step.command`` in its own process group from the checkout's root, output
    to ``out/<name>.log``."""
    step.log = f"{step.name}.log"
    files = contextlib.ExitStack()
    log = files.enter_context((out / step.log).open("w"))
    log.write(f"$ {shlex.join(step.command)}\n")
    log.flush()
    proc = subprocess.Popen(step.command, cwd=ROOT, env=_child_env(), stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    return proc, files, time.monotonic()


def finish_step(step: Step, started: tuple[subprocess.Popen, contextlib.ExitStack, float],
                budget_s: float) -> Step:
    """Wait up to ``budget_s`` for a started step; past it SIGINT its process group, then
    SIGKILL after :data:`GRACE_S`."""
    proc, files, start = started
    with files:
        try:
            step.returncode = proc.wait(timeout=max(budget_s, 0))
        except subprocess.TimeoutExpired:
            step.timed_out = True
            os.killpg(proc.pid, signal.SIGINT)
            try:
                step.returncode = proc.wait(timeout=GRACE_S)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                step.returncode = proc.wait()
    step.wall_s = round(time.monotonic() - start, 1)
    return step


def run_step(step: Step, out: Path) -> Step:
    """Run ``step`` to its end or its budget (:func:`start_step`, :func:`finish_step`);
    not at all when no budget is left."""
    if step.budget_s <= 0:
        step.notes.append("not run: the lane's total budget was spent")
        return step
    started = start_step(step, out)
    return finish_step(step, started, step.budget_s - (time.monotonic() - started[2]))


def pack(out: Path) -> list[str]:
    """Leave at most :data:`MAX_FILES_BACK` plain files at the top of ``out``: those of
    :data:`KEPT_FILES`, everything else moved into :data:`ARCHIVE`; returns the names.

    Raises
    ------
    RuntimeError
        If more than :data:`MAX_FILES_BACK` would remain (a kept name that is a folder).
    """
    rest = sorted(p for p in out.iterdir() if p.name not in KEPT_FILES or not p.is_file())
    if rest:
        with tarfile.open(out / ARCHIVE, "w:gz") as archive:
            for path in rest:
                archive.add(path, arcname=path.name)
        for path in rest:
            if path.is_dir() and not path.is_symlink():
                subprocess.run(["rm", "-rf", str(path)], check=True)
            else:
                path.unlink()
    names = sorted(p.name for p in out.iterdir())
    if len(names) > MAX_FILES_BACK or not all((out / n).is_file() for n in names):
        raise RuntimeError(f"{out} holds {names}: more than {MAX_FILES_BACK} plain files")
    return names


def lane_impls(selection: Selection) -> tuple[str, ...]:
    """The implementations of a lane: :data:`SWEEP_BASELINE` first, then the selection's."""
    return tuple(dict.fromkeys((SWEEP_BASELINE, *selection.impls)))


def plan_of(selection: Selection, device: str, impls: tuple[str, ...],
            l2_bytes: int) -> LanePlan:
    """The time model's plan of ``selection`` with ``impls``."""
    return LanePlan(device, impls, len(selection.conformance_cases()),
                    tuple(selection.sweep_cases()), l2_bytes)


def fit_points(selection: Selection, device: str, impls: tuple[str, ...],
               l2_bytes: int) -> tuple[Selection, dict[str, Any]]:
    """``selection`` with as many sweep points as the model fits when it names none, and
    the model of the result.

    Raises
    ------
    ValueError
        If the model of the plan is over its limit (``--points`` too many, or not even one
        point fits), naming both.
    """
    if selection.points is None:
        fit = points_that_fit(plan_of(selection, device, impls, l2_bytes))
        selection = selection.with_(points=max(fit, 1))
    model = lane_model(plan_of(selection, device, impls, l2_bytes))
    if model["total"] > model["limit"]:
        raise ValueError(f"the plan's time model is {model['total']:.0f} s, over the lane's "
                         f"{model['limit']} s:\n{model_table(model)}\n(fewer --points or "
                         "--impl)")
    return selection, model


def run_lane(out: Path, device: str, selection: Selection, argv: list[str],
             git_sha: str | None = None, dirty: bool | None = None,
             started_at: float | None = None, l2_bytes: int = 0) -> dict[str, Any]:
    """Run the steps into ``out`` (created if missing), pack it (:func:`pack`) and
    write ``lane.json``; returns its record. ``started_at``: the ``time.time()`` the lane's
    launcher started (its setup counts against the budget).

    Raises
    ------
    ValueError
        If ``device`` is not one of :data:`DEVICES`, ``git_sha`` is not 40 hex digits,
        ``out`` holds anything but :data:`LAUNCHER_FILES` (it would be packed with the
        lane's files), or the plan's model is over its limit (:func:`fit_points`).
    """
    if device not in DEVICES:
        raise ValueError(f"device must be one of {DEVICES}, got {device!r}")
    if git_sha is not None and not _SHA.fullmatch(git_sha):
        raise ValueError(f"git_sha must be 40 lowercase hex digits, got {git_sha!r}")
    out.mkdir(parents=True, exist_ok=True)
    found = sorted(p.name for p in out.iterdir() if p.name not in LAUNCHER_FILES)
    if found:
        raise ValueError(f"out must be a new or empty folder, {out} holds {found}")
    impls = lane_impls(selection)
    points_named = selection.points is not None
    selection, model = fit_points(selection, device, impls, l2_bytes)
    print(model_table(model), flush=True)
    if git_sha is not None:
        os.environ[GIT_SHA_ENV] = git_sha
    if dirty is not None:
        os.environ[GIT_DIRTY_ENV] = "1" if dirty else "0"
    run_id = new_run_id()
    start = time.monotonic()
    spent = max(0.0, time.time() - started_at) if started_at is not None else 0.0
    deadline = start - spent + TOTAL_BUDGET_S[device]
    budgets = BUDGETS_S[device]
    python, work = sys.executable, out / "work"
    work.mkdir(exist_ok=True)
    lane = [python, "-m", "pagedbench.harness.lane.steps", "--device", device, "--out",
            str(out)]

    def left(name: str | None = None) -> float:
        return round(min(budgets.get(name, float("inf")), deadline - time.monotonic()), 1)

    env = Step("env", [*lane, "--env-only"], left("env"))
    run_step(env, out)
    listing = Step("list", [*lane, "--list-only", *flags("--impl", impls)], left("list"))
    run_step(listing, out)
    available = available_impls(out / "list.json")
    if not listing.ok:
        available = impls
        listing.notes.append("the later steps run the whole selection (the runner records "
                             "what is unavailable)")
    model_after_list = model
    if not points_named and set(available) != set(impls):
        selection, model_after_list = _refit(selection, device, available, l2_bytes, listing)
    cases, judged = work / "warm.json", work / "judged.json"
    cases.write_text(json.dumps([c.to_dict() for c in _warm_cases(selection)]))
    judged.write_text(json.dumps([c.to_dict() for c in (*selection.sweep_cases(),
                                                        *selection.conformance_cases())]))
    truths = Step("truths", [*lane, "--truths-only", "--cases", str(judged)], budgets["truths"])
    truths_started = start_step(truths, out)
    warmup = Step("warmup", [python, "-m", "pagedbench.harness.lane.warmup", "--device", device,
                             "--cases", str(cases), "--out", str(work / "warmup.jsonl"),
                             "--budget-s", str(left("warmup")),
                             *(f"--impl={n}={t}" for n, t in _targets(available))],
                  left("warmup") + GRACE_S)
    run_step(warmup, out)
    finish_step(truths, truths_started, min(truths.budget_s - (time.monotonic()
                                                                - truths_started[2]),
                                            deadline - time.monotonic()))
    if truths.timed_out:
        truths.notes.append("stopped at its budget; the runners compute the rest")
    conformance = Step("conformance", conformance_command(
        python, device, available, selection, work / "conformance", out / "junit.xml"),
        left("conformance"))
    _run_if_any(conformance, out, available)
    _first_results(work / "conformance", out / "conformance.jsonl")
    peaks = out / "env.json" if env.ok and (out / "env.json").is_file() else None
    command, notes = sweep_command(python, device, available, selection, work / "sweep", peaks)
    sweep = Step("sweep", command, left(), notes=notes)
    _run_if_any(sweep, out, available)
    if _first_results(work / "sweep", out / "sweep.jsonl"):
        with contextlib.suppress(OSError):
            next((work / "sweep").glob("*.md")).rename(out / "sweep.md")
    write_sweep_markdown(out / "sweep.jsonl", out / "sweep.md")
    coverage = sweep_coverage(out / "sweep.jsonl")
    if coverage["not_run"]:
        sweep.notes.append(f"{len(coverage['not_run'])} (implementation, point) pairs not "
                           "run within the budget: lane.json sweep_not_run")
    if coverage["left_out"]:
        sweep.notes.append(f"{len(coverage['left_out'])} points left out: lane.json "
                           "sweep_left_out")
    steps = [env, listing, warmup, truths, conformance, sweep]
    record = lane_record(out, run_id, argv, device, selection, available, steps,
                         COSTS[device].__dict__, {"before": model, "after_list": model_after_list},
                         TOTAL_BUDGET_S[device], start, spent, coverage)
    (out / "lane.json").unlink(missing_ok=True)
    record["files"] = sorted([*pack(out), "lane.json"])
    record["summary"] = summary_line(record)
    (out / "lane.json").write_text(json.dumps(record, indent=2) + "\n")
    return record


def _run_if_any(step: Step, out: Path, impls: tuple[str, ...]) -> None:
    """:func:`run_step`, unless ``list`` found no implementation available (a runner
    given none would take every one)."""
    if impls:
        run_step(step, out)
    else:
        step.notes.append("not run: no implementation is available (see list.json)")


def _targets(names: tuple[str, ...]) -> list[tuple[str, str]]:
    """``(name, module:Class)`` of each of ``names`` that the registry knows."""
    from pagedbench.adapters import entries

    known = {e.name: e.target for e in entries()}
    return [(name, known[name]) for name in names if name in known]


def _refit(selection: Selection, device: str, available: tuple[str, ...], l2_bytes: int,
           listing: Step) -> tuple[Selection, dict[str, Any]]:
    """The sweep's points fitted again to the implementations ``list`` found available."""
    impls = lane_impls(selection.with_(impls=available))
    refit, model = fit_points(selection.with_(points=None), device, impls, l2_bytes)
    listing.notes.append(f"available: {', '.join(impls)}; the sweep's points fitted again "
                         f"to {refit.points} (time model {model['total']:.0f} s)")
    return refit, model


def _warm_cases(selection: Selection) -> list:
    """What the warm-up compiles for: a miniature of each sweep point and the
    conformance cases, each once."""
    from pagedbench.harness.lane.warmup import miniature

    cases = [miniature(c) for c in selection.sweep_cases()] + selection.conformance_cases()
    return list({c.case_id: c for c in cases}.values())


def _first_results(folder: Path, dest: Path) -> bool:
    """Move the results file a runner wrote into ``folder`` to ``dest``; whether there
    was one."""
    for found in sorted(folder.glob("*.jsonl"))[:1]:
        found.rename(dest)
        return True
    return False


def _dirty(text: str) -> bool:
    if text not in ("0", "1"):
        raise argparse.ArgumentTypeError(f"must be 0 or 1, got {text!r}")
    return text == "1"


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m pagedbench.harness.lane.steps",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for everything written")
    parser.add_argument("--device", default="cuda", choices=DEVICES,
                        help="cuda (default): the full lane; cpu: the small CI rehearsal")
    parser.add_argument("--git-sha", help="the commit of this copy (40 hex digits)")
    parser.add_argument("--dirty", type=_dirty, help="1 if the copy differs from the commit")
    parser.add_argument("--impl", action="append", default=[], metavar="NAME",
                        help="implementation (repeatable; default: the device's selection; "
                             f"{SWEEP_BASELINE}, the baseline, always runs)")
    parser.add_argument("--points", type=_positive, default=None, metavar="N",
                        help="the sweep's first N points (default: as many as the time model "
                             "fits); a plan over the model's limit is refused")
    parser.add_argument("--started-at", type=float, default=None, metavar="UNIX_TIME",
                        help="when the launcher started (its setup counts against the budget)")
    parser.add_argument("--cases", type=Path, help="with --truths-only: the cases (JSON)")
    only = parser.add_mutually_exclusive_group()
    only.add_argument("--env-only", action="store_true",
                      help="only write OUT/env.json (the lane's first step)")
    only.add_argument("--list-only", action="store_true",
                      help="only write OUT/list.json (pagedbench list --json of the selection)")
    only.add_argument("--truths-only", action="store_true",
                      help="only cache the host truths of --cases under build/")
    return parser


def _l2_bytes(device: str) -> int:
    """The L2 of the lane's GPU (bytes), 0 on the CPU."""
    if device != "cuda":
        return 0
    from pagedbench.harness.measure.timing import device_l2_bytes

    return device_l2_bytes(0)


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit status (0: every step passed within budget)."""
    argv = sys.argv[1:] if argv is None else argv
    args = _parser().parse_args(argv)
    base = CUDA_SELECTION if args.device == "cuda" else CPU_SELECTION
    selection = base.with_(impls=tuple(args.impl) or base.impls, points=args.points)
    if args.env_only:
        args.out.mkdir(parents=True, exist_ok=True)
        for measure in (False, True):  # a record without the measurements first
            record = environment_record(args.device, selection.to_dict(), measure=measure)
            (args.out / "env.json").write_text(json.dumps(record, indent=2) + "\n")
        return 0
    if args.list_only:
        args.out.mkdir(parents=True, exist_ok=True)
        print(f"{write_listing(args.device, selection.impls, args.out / 'list.json')} "
              "available")
        return 0
    if args.truths_only:
        from pagedbench.reference import PagedCase

        cases = [PagedCase.from_dict(c) for c in json.loads(args.cases.read_text())]
        print(f"{write_truths(cases, args.device)} truths cached under {BUILD}")
        return 0
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("gpu_lane: --device cuda but torch sees no CUDA device (use --device cpu "
                  "for the rehearsal)", file=sys.stderr)
            return 2
    try:
        if args.device == "cpu":  # what the same command plans on the H200
            h200 = CUDA_SELECTION.with_(impls=tuple(args.impl) or CUDA_SELECTION.impls,
                                        points=args.points)
            _, model = fit_points(h200, "cuda", lane_impls(h200), H200_L2_BYTES)
            print(f"the H200 lane's {model_table(model)[len('gpu-lane '):]}", flush=True)
        record = run_lane(args.out, args.device, selection, argv, args.git_sha, args.dirty,
                          args.started_at, _l2_bytes(args.device))
    except ValueError as exc:
        print(f"gpu_lane: {exc}", file=sys.stderr)
        return 2
    for step in record["steps"]:
        print(f"{step['name']:<11} {step['state']:<14} {step['wall_s']:7.1f} s  "
              f"{step['log']} {' '.join(step['notes'])}")
    print(record["summary"])
    return 0 if record["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
