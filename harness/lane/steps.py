"""The GPU lane: one call on a bare GPU machine checks and times what it has.

Started by ``scripts/gpu_lane.sh`` (which makes ``pagedbench`` importable and installs the
carried wheels first)::

    python -m pagedbench.harness.lane.steps --out DIR [--device cuda|cpu]
        [--git-sha SHA --dirty 0|1] [--impl NAME ...] [--preset NAME ...]
        [--block-size N ...] [--tests PATH ...]

Steps, each a child process with its own budget (:data:`BUDGETS_S`), so that one hung
step cannot take the others down: ``env`` (``env.json``: :func:`environment_record`, the
machine measured), ``list`` (``list.json``), ``pytest`` (``junit.xml``: the suites that
matter on a GPU, :data:`GPU_TESTS`), ``sweep`` (``sweep.jsonl``/``.md``:
:func:`sweep_command`, ``pagedbench bench`` on the selection's grid, only the
implementations ``list`` found available, ours first, its fractions of peak taken of the
copy bandwidth and bf16 rate that ``env`` measured). ``truths`` computes the float64
truths of the sweep's points that take the host path (:data:`HOST_TRUTH_BYTES`) on the
CPU while ``pytest`` holds the GPU; the larger points get device truths in the sweep.
A step past its budget gets SIGINT, then SIGKILL after :data:`GRACE_S`;
:data:`TOTAL_BUDGET_S` caps the lane; ``lane.json`` lists the sweep's pairs that did not
run within it and the points it left out.

The commit and dirtiness come from outside (no ``.git`` travels) and reach every result
line through :data:`~pagedbench.harness.results.store.GIT_SHA_ENV`. At the end the folder is packed
to at most :data:`MAX_FILES_BACK` plain files (:data:`KEPT_FILES`, the rest in ``logs.tar.gz``),
``lane.json`` records every step, and a summary line starting with :data:`SUMMARY_PREFIX` is
printed last. Exit 0 when every step passed within budget, else 1. ``--device cpu`` is the CI
rehearsal: a tiny selection (:data:`CPU_SELECTION`), budgets for a busy host. What the steps run is
in :mod:`.sweep` (the selection, the truths and sweep steps) and :mod:`.probe` (the env and list
steps); this module runs them, with their budgets.
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
from dataclasses import asdict, dataclass, field
from importlib.util import find_spec
from pathlib import Path
from typing import Any

from pagedbench.harness.lane import BUILD, ROOT
from pagedbench.harness.lane.probe import available_impls, environment_record, write_listing
from pagedbench.harness.lane.sweep import (CPU_SELECTION, CUDA_SELECTION, Selection, flags,
                                           sweep_command, sweep_counts, sweep_coverage,
                                           write_sweep_markdown, write_truths)
from pagedbench.harness.results.store import GIT_DIRTY_ENV, GIT_SHA_ENV, new_run_id
from pagedbench.harness.run.environment import cache_environment
DEVICES = ("cuda", "cpu")
#: Per-step budgets (s), by device; ``truths`` starts with ``pytest`` and runs beside
#: it, within a budget no longer than pytest's.
BUDGETS_S = {
    "cuda": {"env": 40, "list": 30, "truths": 140, "pytest": 140, "sweep": 140},
    "cpu": {"env": 60, "list": 60, "truths": 90, "pytest": 90, "sweep": 90},
}
#: Cap on the whole lane (s), by device: each step's budget is cut to what is left.
#: On CUDA: one machine start (about 2 min) and two lanes fit the 15 minutes of device
#: time the project's GPU machine lends a session (10 minutes a command), so a failed
#: first try can be run again.
#: On the CPU (about 40 s of CPU time on 2 cores) the budgets leave room for a host
#: shared with other jobs.
TOTAL_BUDGET_S = {"cuda": 360, "cpu": 300}
#: Seconds between SIGINT and SIGKILL for a step past its budget.
GRACE_S = 10
#: Per-test limit (s) when ``pytest-timeout`` is there; pytest-xdist workers on CUDA.
TEST_TIMEOUT_S = 60
XDIST_WORKERS = 8
#: Files the device machine sends back: at most 8, plain, at the top of the folder.
MAX_FILES_BACK = 8
ARCHIVE = "logs.tar.gz"
KEPT_FILES = ("lane.json", "env.json", "list.json", "junit.xml", "sweep.jsonl", "sweep.md",
              ARCHIVE)
SUMMARY_PREFIX = "gpu-lane:"
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


def pytest_command(python: str, device: str, tests: tuple[str, ...], junit: Path) -> list[str]:
    """``pytest`` on ``tests`` without benchmarks, with ``--timeout`` when pytest-timeout
    is installed and pytest-xdist workers on CUDA when it is."""
    command = [python, "-m", "pytest", *tests, "-m", "not bench", "-q", "-p", "no:cacheprovider",
               f"--junitxml={junit}"]
    if find_spec("pytest_timeout") is not None:
        command += [f"--timeout={TEST_TIMEOUT_S}"]
    if device == "cuda" and find_spec("xdist") is not None:
        command += ["-n", str(XDIST_WORKERS)]
    return command


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


def _junit_counts(junit: Path) -> dict[str, int]:
    import xml.etree.ElementTree as ET

    try:
        root = ET.parse(junit).getroot()
    except (OSError, ET.ParseError):
        return {}
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    return {key: sum(int(s.get(key, 0)) for s in suites)
            for key in ("tests", "failures", "errors", "skipped")}


def summary_line(record: dict[str, Any]) -> str:
    """The line printed last: verdict, device, commit, each step, the files."""
    steps = {s["name"]: s for s in record["steps"]}
    parts = []
    for name, step in steps.items():
        text = f"{name} {step['state']}"
        if name == "pytest" and record["tests"]:
            t = record["tests"]
            text += (f" ({t['tests']} tests, {t['failures']} failed, {t['errors']} errors, "
                     f"{t['skipped']} skipped)")
        if name == "sweep" and record["sweep_statuses"]:
            text += " (" + ", ".join(f"{n} {k}" for k, n in record["sweep_statuses"].items())
            if record.get("sweep_not_run"):
                text += f", {len(record['sweep_not_run'])} not run"
            text += ")"
        parts.append(text)
    git = (record["git_sha"] or "unknown")[:12] + ("+dirty" if record["dirty"] else "")
    return (f"{SUMMARY_PREFIX} {'OK' if record['ok'] else 'FAILED'}"
            f"{' (CPU rehearsal)' if record['rehearsal'] else ''} | device {record['device_name']}"
            f" | git {git} | {'; '.join(parts)} | {len(record['files'])} files in {record['out']}")


def run_lane(out: Path, device: str, selection: Selection, argv: list[str],
             git_sha: str | None = None, dirty: bool | None = None) -> dict[str, Any]:
    """Run the steps into ``out`` (created if missing), pack it (:func:`pack`) and
    write ``lane.json``; returns its record.

    Raises
    ------
    ValueError
        If ``device`` is not one of :data:`DEVICES`, ``git_sha`` is not 40 hex digits, or
        ``out`` holds anything but :data:`LAUNCHER_FILES` (it would be packed with the
        lane's files).
    """
    if device not in DEVICES:
        raise ValueError(f"device must be one of {DEVICES}, got {device!r}")
    if git_sha is not None and not _SHA.fullmatch(git_sha):
        raise ValueError(f"git_sha must be 40 lowercase hex digits, got {git_sha!r}")
    out.mkdir(parents=True, exist_ok=True)
    found = sorted(p.name for p in out.iterdir() if p.name not in LAUNCHER_FILES)
    if found:
        raise ValueError(f"out must be a new or empty folder, {out} holds {found}")
    if git_sha is not None:
        os.environ[GIT_SHA_ENV] = git_sha
    if dirty is not None:
        os.environ[GIT_DIRTY_ENV] = "1" if dirty else "0"
    run_id = new_run_id()
    start, deadline = time.monotonic(), time.monotonic() + TOTAL_BUDGET_S[device]
    budgets = BUDGETS_S[device]
    python = sys.executable
    work = out / "work"
    work.mkdir(exist_ok=True)

    def left(name: str) -> float:
        return round(min(budgets[name], deadline - time.monotonic()), 1)

    env = Step("env", [python, "-m", "pagedbench.harness.lane.steps", "--env-only",
                       "--device", device, "--out", str(out), *_selection_flags(selection)],
               left("env"))
    run_step(env, out)
    listing = Step("list", [python, "-m", "pagedbench.harness.lane.steps", "--list-only",
                            "--device", device, "--out", str(out),
                            *flags("--impl", selection.impls)], left("list"))
    run_step(listing, out)
    impls = available_impls(out / "list.json")
    if not listing.ok:
        from pagedbench.adapters import entries

        impls = selection.impls or tuple(e.name for e in entries())
        listing.notes.append("the sweep runs the whole selection (the runner records what "
                             "is unavailable)")
    truths = Step("truths", [python, "-m", "pagedbench.harness.lane.steps", "--truths-only",
                             "--device", device, "--out", str(out),
                             *_selection_flags(selection)], budgets["truths"])
    truths_started = start_step(truths, out)
    tests = Step("pytest", pytest_command(python, device, selection.tests, out / "junit.xml"),
                 left("pytest"))
    run_step(tests, out)
    # Its budget (at most pytest's) ran beside pytest's; what it has not done by then,
    # the sweep's runner computes itself (the cache's writes are atomic).
    spent = time.monotonic() - truths_started[2]
    finish_step(truths, truths_started,
                min(truths.budget_s - spent, deadline - time.monotonic()))
    if truths.timed_out:
        truths.notes.append("stopped at its budget; the sweep computes the rest")
    peaks = out / "env.json" if env.ok and (out / "env.json").is_file() else None
    command, notes = sweep_command(python, device, impls, selection, work, peaks)
    sweep = Step("sweep", command, left("sweep"), notes=notes)
    steps = [env, listing, truths, tests, sweep]
    if impls:
        run_step(sweep, out)
    else:
        sweep.notes.append("not run: no implementation is available (see list.json)")
    for found in sorted(work.glob("*.jsonl"))[:1]:
        found.rename(out / "sweep.jsonl")
        with contextlib.suppress(OSError):
            found.with_suffix(".md").rename(out / "sweep.md")
    write_sweep_markdown(out / "sweep.jsonl", out / "sweep.md")
    coverage = sweep_coverage(out / "sweep.jsonl")
    if coverage["not_run"]:
        sweep.notes.append(f"{len(coverage['not_run'])} (implementation, point) pairs not "
                           "run within the budget: lane.json sweep_not_run")
    if coverage["left_out"]:
        sweep.notes.append(f"{len(coverage['left_out'])} points left out: lane.json "
                           "sweep_left_out")
    env_record = {}
    with contextlib.suppress(OSError, ValueError):
        env_record = json.loads((out / "env.json").read_text())
    record = {
        "run_id": run_id, "argv": argv, "device": device, "rehearsal": device == "cpu",
        "device_name": (env_record.get("environment") or {}).get("device", "unknown"),
        "git_sha": os.environ.get(GIT_SHA_ENV), "dirty": os.environ.get(GIT_DIRTY_ENV) == "1",
        "total_budget_s": TOTAL_BUDGET_S[device], "wall_s": round(time.monotonic() - start, 1),
        "impls": list(impls),
        "ok": all(s.ok for s in steps if s.name != "truths") and bool(impls),
        "steps": [{**asdict(s), "ok": s.ok, "state": s.state} for s in steps],
        "tests": _junit_counts(out / "junit.xml"),
        "sweep_statuses": sweep_counts(out / "sweep.jsonl"),
        "sweep_not_run": coverage["not_run"],
        "sweep_left_out": coverage["left_out"],
        "out": str(out),
    }
    (out / "lane.json").unlink(missing_ok=True)
    record["files"] = sorted([*pack(out), "lane.json"])
    record["summary"] = summary_line(record)
    (out / "lane.json").write_text(json.dumps(record, indent=2) + "\n")
    return record


def _selection_flags(selection: Selection) -> list[str]:
    """The lane's own options that give ``selection`` again (to its child steps)."""
    return [*flags("--impl", selection.impls), *flags("--preset", selection.sweep.layouts),
            *flags("--block-size", selection.sweep.block_sizes),
            *flags("--tests", selection.tests)]


def _dirty(text: str) -> bool:
    if text not in ("0", "1"):
        raise argparse.ArgumentTypeError(f"must be 0 or 1, got {text!r}")
    return text == "1"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m pagedbench.harness.lane.steps",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for everything written")
    parser.add_argument("--device", default="cuda", choices=DEVICES,
                        help="cuda (default): the full lane; cpu: the small CI rehearsal")
    parser.add_argument("--git-sha", help="the commit of this copy (40 hex digits)")
    parser.add_argument("--dirty", type=_dirty, help="1 if the copy differs from the commit")
    parser.add_argument("--impl", action="append", default=[], metavar="NAME",
                        help="implementation (repeatable; default: every available one)")
    parser.add_argument("--preset", action="append", default=[], metavar="NAME",
                        help="model preset (repeatable; default: the device's selection)")
    parser.add_argument("--block-size", action="append", default=[], type=int, metavar="N",
                        help="block size (repeatable; default: the device's selection)")
    parser.add_argument("--tests", action="append", default=[], metavar="PATH",
                        help="pytest target (repeatable; default: the device's selection)")
    only = parser.add_mutually_exclusive_group()
    only.add_argument("--env-only", action="store_true",
                      help="only write OUT/env.json (the lane's first step)")
    only.add_argument("--list-only", action="store_true",
                      help="only write OUT/list.json (pagedbench list --json of the selection)")
    only.add_argument("--truths-only", action="store_true",
                      help="only cache the sweep's truths under build/")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit status (0: every step passed within budget)."""
    argv = sys.argv[1:] if argv is None else argv
    args = _parser().parse_args(argv)
    base = CUDA_SELECTION if args.device == "cuda" else CPU_SELECTION
    selection = Selection(
        impls=tuple(args.impl) or base.impls,
        sweep=base.sweep.with_(layouts=tuple(args.preset) or base.sweep.layouts,
                               block_sizes=tuple(args.block_size) or base.sweep.block_sizes),
        tests=tuple(args.tests) or base.tests,
    )
    if args.env_only:
        args.out.mkdir(parents=True, exist_ok=True)
        record = environment_record(args.device, selection.to_dict())
        (args.out / "env.json").write_text(json.dumps(record, indent=2) + "\n")
        return 0
    if args.list_only:
        args.out.mkdir(parents=True, exist_ok=True)
        print(f"{write_listing(args.device, selection.impls, args.out / 'list.json')} "
              "available")
        return 0
    if args.truths_only:
        print(f"{write_truths(selection, args.device)} truths cached under {BUILD}")
        return 0
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("gpu_lane: --device cuda but torch sees no CUDA device (use --device cpu "
                  "for the rehearsal)", file=sys.stderr)
            return 2
    try:
        record = run_lane(args.out, args.device, selection, argv, args.git_sha, args.dirty)
    except ValueError as exc:
        print(f"gpu_lane: {exc}", file=sys.stderr)
        return 2
    for step in record["steps"]:
        print(f"{step['name']:<7} {step['state']:<14} {step['wall_s']:7.1f} s  "
              f"{step['log']} {' '.join(step['notes'])}")
    print(record["summary"])
    return 0 if record["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
