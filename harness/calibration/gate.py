"""False alarms and power of the regression gate, measured by rerunning real runs.

``python -m pagedbench.harness.calibration.gate --tries 20`` runs ``pagedbench run`` 20
times (``--repetitions 20`` samples per point, 1 thread); each run times four
implementations one after another on the same cases:
``sdpa-contiguous`` (A), the same code under another name (B, an unchanged rerun) and
the same code slowed by 25% and by 50% (C, D: a busy wait of a quarter or a half of each
call's own duration; ``suites/harness/plugins/slowed.py``, registered as entry points for
these runs only). Each is gated under A's name (:func:`pagedbench.harness.gate.compare.compare`),
two ways:

- ``fresh``: try i's B, C and D against try i's A (a baseline measured just before);
- ``stored``: try i's B, C and D against try 0's A (a golden recorded once, as in CI).

An unchanged rerun must pass (exit 0) in at least 19 of 20 tries and a slowed one must fail
(exit 1) in at least 19 of 20 (the gate's targets, docs/gate.md); the command exits 0 when
that holds for every gate, else 1. ``--load-jobs N`` runs N CPU-bound busy loops beside the
tries (a loaded machine; stopped at the end); the load averages before and after each try
are recorded. ``--samples FILE`` keeps every try's raw samples (the recorded noise a test in
``make test`` replays); ``--from-runs DIR`` judges runs made before. Runs, caches and the
plug-ins' metadata go under ``--work-dir``; ``--output`` gets the rates as JSON.

``--threads-study`` instead times a few decode cases in this process with 1 thread and
with every core, and writes their medians, spreads and distances to the nearest multiple
of 4 ms (a scheduler slice) with the load averages: the measurement behind
:data:`~pagedbench.harness.run.config.CPU_THREADS`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path


from pagedbench.adapters import ENTRY_POINT_GROUP

from pagedbench.harness.gate.compare import compare
from pagedbench.harness.measure.speed import Thresholds
from pagedbench.harness.results.record import ResultRecord
from pagedbench.harness.results.store import read_lines, results_of
from pagedbench.harness.verdict.status import ExitCode

PLUGINS = "pagedbench.suites.harness.plugins.slowed"
#: The implementations of every try: baseline, unchanged rerun, slowed by 25% and 50%.
BASELINE, RERUN, SLOWED, SLOWED_HALF = ("sdpa-contiguous", "sdpa-rerun", "sdpa-slowed-25pct",
                                        "sdpa-slowed-50pct")
SLOWED_IMPLS = (SLOWED, SLOWED_HALF)
ENTRIES = {RERUN: f"{PLUGINS}:Rerun", SLOWED: f"{PLUGINS}:Slowed",
           SLOWED_HALF: f"{PLUGINS}:SlowedHalf",
           "sdpa-slowed-3x": f"{PLUGINS}:SlowedThreeTimes"}
#: Tries an unchanged rerun must pass, and a slowed one fail, out of 20 (docs/gate.md).
REQUIRED_OF_20 = 19


def plugin_environment(site: Path, entries: dict[str, str] = ENTRIES) -> dict[str, str]:
    """This process's environment with a minimal distribution under ``site`` whose entry
    points register ``entries`` (name -> ``"module:Class"``; default: the calibration's
    adapters), as an installed out-of-tree package would."""
    dist = site / "pagedbench_test_plugins-0.0.dist-info"
    dist.mkdir(parents=True, exist_ok=True)
    (dist / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: pagedbench-test-plugins\nVersion: 0.0\n")
    lines = "".join(f"{name} = {target}\n" for name, target in entries.items())
    (dist / "entry_points.txt").write_text(f"[{ENTRY_POINT_GROUP}]\n{lines}")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(site), env.get("PYTHONPATH")) if p)
    return env


def run_once(work_dir: Path, run_args: list[str], impls: tuple[str, ...]) -> Path:
    """One ``pagedbench run`` of ``impls`` with ``run_args``; returns its results file.

    Raises
    ------
    RuntimeError
        If the run does not exit 0 (its output is in the message).
    """
    results = work_dir / "runs"
    before = set(results.glob("*.jsonl"))
    argv = [sys.executable, "-m", "pagedbench.harness.cli", "run", *run_args,
            *(a for impl in impls for a in ("--impl", impl)),
            "--results-dir", str(results), "--cache-dir", str(work_dir / "cache")]
    proc = subprocess.run(argv, env=plugin_environment(work_dir / "site"),
                          capture_output=True, text=True)
    if proc.returncode != ExitCode.CLEAN:
        raise RuntimeError(f"{' '.join(argv)} exited {proc.returncode}:\n"
                           f"{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    (new,) = set(results.glob("*.jsonl")) - before
    return new


def as_baseline(records: list[ResultRecord], impl: str) -> list[ResultRecord]:
    """``impl``'s records renamed to :data:`BASELINE`, so the gate pairs them with its."""
    return [r.model_copy(update={"impl": BASELINE}) for r in records if r.impl == impl]


def gate_outcomes(tries: list[list[ResultRecord]], thresholds: Thresholds) -> dict[str, dict]:
    """Exit codes and outcome counts of every gate of :data:`RERUN` and the slowed
    implementations present against :data:`BASELINE`, ``fresh`` and ``stored`` (module
    docstring)."""
    out: dict[str, dict] = {}
    present = {r.impl for records in tries for r in records}
    for way in ("fresh", "stored"):
        for impl in (i for i in (RERUN, *SLOWED_IMPLS) if i in present):
            codes, outcomes = [], Counter()
            for records in tries:
                baseline = as_baseline(tries[0] if way == "stored" else records, BASELINE)
                report = compare(baseline, as_baseline(records, impl), thresholds)
                codes.append(int(report.exit_code))
                outcomes.update(str(p.outcome) for p in report.points)
            out[f"{way} {impl}"] = {"exit_codes": codes, "outcomes": dict(outcomes)}
    return out


def verdict(judged: dict[str, dict]) -> tuple[bool, list[str]]:
    """Whether every rate meets :data:`REQUIRED_OF_20` (scaled to the tries), with one
    line per gate: ``passed k / n`` or ``failed k / n``."""
    lines, ok = [], True
    for name, data in judged.items():
        codes = data["exit_codes"]
        wanted = (ExitCode.REGRESSION if name.endswith(SLOWED_IMPLS) else ExitCode.CLEAN)
        hits = sum(code == wanted for code in codes)
        needed = -(-REQUIRED_OF_20 * len(codes) // 20)  # ceil(19 n / 20)
        ok &= hits >= needed
        word = "failed (exit 1)" if wanted == ExitCode.REGRESSION else "passed (exit 0)"
        lines.append(f"{name}: {word} in {hits} / {len(codes)} (needed {needed}); "
                     f"exit codes {dict(sorted(Counter(codes).items()))}; "
                     f"outcomes {data['outcomes']}")
    return ok, lines


def samples_of(tries: list[list[ResultRecord]]) -> list[dict[str, dict[str, list[float]]]]:
    """Every try's raw samples (ms) by implementation, then case id."""
    out = []
    for records in tries:
        by_impl: dict[str, dict[str, list[float]]] = {}
        for r in records:
            if r.time_ms is not None and r.time_ms.samples:
                by_impl.setdefault(r.impl, {})[r.case_id] = list(r.time_ms.samples)
        out.append(by_impl)
    return out


#: A CPU-bound job that loads one core until it is stopped (``--load-jobs``).
BUSY_LOOP = "while True: pass"


def start_load(jobs: int) -> list[subprocess.Popen]:
    """``jobs`` busy-loop processes (:data:`BUSY_LOOP`); stop them with :func:`stop_load`."""
    return [subprocess.Popen([sys.executable, "-c", BUSY_LOOP]) for _ in range(jobs)]


def stop_load(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        proc.kill()
        proc.wait()


#: Decode cases of the threads study (batch specs, gqa4 heads, bf16, block size 16).
STUDY_SPECS = ("1q1s64", "4q1s512", "16q1s1k")
#: A scheduler slice of a 250 Hz kernel (ms): timings that wait for a preempted thread
#: sit near its multiples.
SLICE_MS = 4.0


def threads_study(thread_counts: tuple[int, ...]) -> list[dict]:
    """Each of :data:`STUDY_SPECS` timed (``time_cpu``, 10 samples over at least 0.5 s) by
    ``sdpa-contiguous`` and ``torch-gather`` in this process with each thread count: the
    median, p10, p90 and IQR / median (ms), the median's distance to the nearest multiple
    of :data:`SLICE_MS`, and the 1-minute load average when it ended."""
    from pagedbench.adapters.torch_sdpa import SdpaContiguous, TorchGather
    from pagedbench.reference import materialize

    from pagedbench.harness.measure.timing import time_cpu
    from pagedbench.harness.cases.workloads import spec_workload

    rows = []
    for spec in STUDY_SPECS:
        case = spec_workload(spec, "gqa4").case(16, "bfloat16")
        inputs = materialize(case)
        for adapter in (SdpaContiguous(), TorchGather()):
            prepared = adapter.prepare(inputs)
            for threads in thread_counts:
                t = time_cpu(prepared.launch, threads=threads, min_samples=10,
                             min_run_time_s=0.5, max_run_time_s=5.0)
                rows.append({"case": case.case_id, "impl": adapter.name, "threads": threads,
                             "median_ms": t.median_ms, "p10_ms": t.p10_ms, "p90_ms": t.p90_ms,
                             "iqr_over_median": t.iqr_ms / t.median_ms, "n": t.n,
                             "off_slice_ms": abs(t.median_ms - SLICE_MS * round(
                                 t.median_ms / SLICE_MS)),
                             "load_1min": os.getloadavg()[0]})
                print(json.dumps(rows[-1]), flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pagedbench.harness.calibration.gate",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--tries", type=int, default=20, help="runs (default: 20)")
    parser.add_argument("--preset", default="phi3-mini", help="model preset of the cases")
    parser.add_argument("--block-size", default="16")
    parser.add_argument("--threads", default="1", help="torch threads per worker")
    parser.add_argument("--repetitions", default="20",
                        help="samples per point (default: 20, as README advises for a gate)")
    parser.add_argument("--min-effect", type=float, default=Thresholds.min_effect)
    parser.add_argument("--work-dir", type=Path, default=Path("build/gate-calibration"))
    parser.add_argument("--samples", type=Path, help="write every try's raw samples here")
    parser.add_argument("--output", type=Path, help="write the rates here as JSON")
    parser.add_argument("--from-runs", type=Path, metavar="DIR",
                        help="judge the runs already in DIR (one try per .jsonl, in name "
                             "order) instead of running new ones")
    parser.add_argument("--load-jobs", type=int, default=0, metavar="N",
                        help="run N busy loops beside the tries (default: 0)")
    parser.add_argument("--threads-study", action="store_true",
                        help="time the study's cases with 1 thread and every core instead")
    args = parser.parse_args(argv)
    if args.tries < 1 or args.load_jobs < 0:
        parser.error(f"need --tries >= 1 and --load-jobs >= 0, got {args.tries}, "
                     f"{args.load_jobs}")
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    load = start_load(args.load_jobs)
    try:
        return _main(args, parser, started)
    finally:
        stop_load(load)


def _write(path: Path | None, data: dict) -> None:
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data, indent=1) + "\n")


def _main(args: argparse.Namespace, parser: argparse.ArgumentParser, started: str) -> int:
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    host = {"cores": os.cpu_count(), "started": started, "load_before": os.getloadavg()}
    if args.threads_study:
        rows = threads_study((1, os.cpu_count() or 1))
        _write(args.output, {"host": {**host, "load_after": os.getloadavg()},
                             "args": settings, "timings": rows})
        return 0
    thresholds = Thresholds(min_effect=args.min_effect)
    run_args = ["--preset", args.preset, "--block-size", args.block_size,
                "--threads", args.threads, "--repetitions", args.repetitions]
    tries, loads = [], []
    if args.from_runs is not None:
        tries = [results_of(read_lines([p])) for p in sorted(args.from_runs.glob("*.jsonl"))]
    for i in range(args.tries if args.from_runs is None else 0):
        before = os.getloadavg()
        path = run_once(args.work_dir, run_args, (BASELINE, RERUN, *SLOWED_IMPLS))
        tries.append(results_of(read_lines([path])))
        loads.append({"before": before, "after": os.getloadavg()})
        print(f"try {i + 1}/{args.tries}: {path} (load average {loads[-1]['after'][0]:.1f})",
              flush=True)
    if not tries:
        parser.error(f"--from-runs {args.from_runs}: no .jsonl results there")
    judged = gate_outcomes(tries, thresholds)
    ok, lines = verdict(judged)
    device = tries[0][0].env.device if tries[0] else "?"
    print(f"device {device}, {args.threads} thread(s), {args.repetitions} repetitions, preset "
          f"{args.preset}, block size {args.block_size}, min effect {thresholds.min_effect:g}")
    print("\n".join(lines))
    if args.samples is not None:
        args.samples.write_text(json.dumps(samples_of(tries)) + "\n")
    _write(args.output, {"device": device, "host": {**host, "load_after": os.getloadavg(),
                                                    "finished": time.strftime(
                                                        "%Y-%m-%dT%H:%M:%SZ", time.gmtime())},
                         "args": settings, "load_per_try": loads, "gates": judged,
                         "verdict": lines})
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
