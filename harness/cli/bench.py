"""``pagedbench bench``: the benchmark sweep, each point checked, then timed
(:mod:`pagedbench.harness.run.bench`; its options, :mod:`.bench_options`, back from a
sweep: :meth:`~pagedbench.harness.run.bench.Sweep.arguments`)."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import pandas as pd
from rich.markup import escape as rich_escape

from pagedbench.adapters import entries
from pagedbench.reference import PagedInputError, PagedValueError, check_fits

from pagedbench.harness.cases.batch_trace import trace_workloads
from pagedbench.harness.cases.workloads import BENCH_SUITE
from pagedbench.harness.cli.bench_options import AXES
from pagedbench.harness.cli.options import (checked_device, existing_file, select_impls,
                                            writable_file, writable_folder)
from pagedbench.harness.cli.run import (check_balance_from, device_peaks, interrupted,
                                        results_of_run, shard_of, warn_oversubscribed)
from pagedbench.harness.results import report
from pagedbench.harness.results.derived import trace_times
from pagedbench.harness.results.junit import write_junit_xml
from pagedbench.harness.results.record import ResultRecord
from pagedbench.harness.results.store import ResultsFile, new_run_id, write_output
from pagedbench.harness.run import bench, runner
from pagedbench.harness.run.progress import RunProgress
from pagedbench.harness.run.summary import print_summary, terminal
from pagedbench.harness.verdict.status import Status, exit_code
from pagedbench.harness.verdict.truth import truth_site


def bench_sweep(args: argparse.Namespace) -> bench.Sweep:
    """The sweep of ``pagedbench bench``'s options: the device's default (or ``--quick``'s)
    with each axis given replaced; ``--batch-spec``/``--preset`` without a grid axis option
    replace the grid (raises ``PagedValueError`` naming the option of a bad value)."""
    sweep = bench.default_sweep(args.device, args.quick)
    changes: dict[str, Any] = {}
    for dest in AXES.values():
        if getattr(args, dest):
            changes[dest] = tuple(dict.fromkeys(getattr(args, dest)))
    grid_given = any(getattr(args, d) for d in ("modes", "batch_sizes", "contexts"))
    if args.grid:
        changes["grid"] = args.grid
    elif (args.batch_specs or args.presets or args.trace) and not grid_given:
        changes["grid"] = "none"
    if (args.batch_specs or args.trace or args.grid == "none") and not args.presets:
        changes.setdefault("presets", ())
    if args.trace is not None:
        changes["trace"] = tuple(trace_workloads(args.trace, (args.layouts or [None])[0]))
        changes["trace_file"] = str(args.trace)
    if args.no_contiguous or (args.trace and not (grid_given or args.batch_specs
                                                  or args.presets)):
        changes["contiguous"] = False
    try:
        return sweep.with_(**changes)
    except PagedValueError as exc:
        option = next((flag for flag, dest in AXES.items() if dest == exc.parameter), None)
        if option is None:
            raise
        raise PagedValueError(option, exc.value, exc.allowed, f"{option}: {exc}") from None


def _bench_impls(args: argparse.Namespace) -> dict[str, str]:
    known = {e.name: e.target for e in entries()}
    if args.baseline not in known:
        raise PagedValueError("--baseline", args.baseline, f"among {list(known)}")
    if args.impl:
        chosen = select_impls(args.impl)
    elif args.device == "cpu":
        chosen = {n: t for n, t in known.items() if n in bench.CPU_IMPLS}
    else:
        chosen = known
    return {args.baseline: known[args.baseline], **chosen}


def cmd_bench(args: argparse.Namespace) -> int:
    writable_folder(args.results_dir, "--results-dir")
    if args.junit_xml is not None:
        writable_file(args.junit_xml, "--junit-xml")
    device = checked_device(args.device, args.devices)
    sweep = bench_sweep(args)
    cases = sweep.cases()
    if args.points is not None:
        cases = cases[:args.points]
    impls = _bench_impls(args)
    console = terminal(soft_wrap=True)
    left_out = sweep.left_out()
    check_balance_from(args)  # a dry run refuses it too
    if args.dry_run:
        for case in cases:
            print(case.case_id)
        for note in left_out:
            print(f"left out: {note}")
    if not cases:  # a dry run too (after its list): it answers what the run would
        # what the user typed as the option, what the sweep took by default without dashes
        presets = ([f"--preset {p}" for p in sweep.presets] if args.presets else
                   [f"presets {', '.join(sweep.presets)}"] if sweep.presets else [])
        given = [f"--grid {sweep.grid}" if args.grid else f"grid {sweep.grid}", *presets,
                 *(f"--workload '{p}'" for p in sweep.workload_patterns),
                 *([f"{len(left_out)} left out, the first {left_out[0]}"] if left_out else [])]
        raise PagedValueError("bench options", "no point", "options that keep at least one "
                              "point", f"the options leave no point to time ({'; '.join(given)})")
    if args.dry_run:
        console.print(f"{len(cases)} points x {len(impls)} implementations "
                      f"({', '.join(impls)})")
        return 0
    existing_file(args.peaks, "--peaks")  # read by the run (a dry run plans without it)
    kept = []
    for case in cases:  # a point whose truth fits neither the host budget nor the device
        try:
            check_fits(case, device)
            truth_site(case, device, args.host_truth_bytes)
        except PagedInputError as exc:
            left_out.append(f"{case.case_id}: {exc}")
        else:
            kept.append(case)
    for note in left_out:
        console.print(f"[yellow]left out: {rich_escape(note)}[/]")
    if not kept:
        raise PagedValueError("bench options", "no point", "a point that fits",
                              f"every point was left out ({'; '.join(left_out)})")
    cases = kept
    defaults = runner.RunConfig()
    timing = bench.CPU_TIMING["quick" if args.quick else "default"] if device == "cpu" else {}
    if args.repetitions:
        timing = {**timing, "repetitions": args.repetitions}
    config = runner.RunConfig(
        device=device, suite=BENCH_SUITE, cache_dir=args.cache_dir,
        host_truth_bytes=args.host_truth_bytes,
        threads=args.threads or defaults.threads, devices=args.devices or "",
        case_timeout_s=args.case_timeout or defaults.case_timeout_s,
        **({**timing, "time_budget_s": args.min_time,
            "time_limit_s": max(args.min_time, defaults.time_limit_s)} if args.min_time
           else timing))
    plan = runner.make_plan(impls, cases)
    run_id = new_run_id()
    results = ResultsFile(args.results_dir / f"{run_id}.jsonl")
    part, pairs = shard_of(args, plan, results, run_id, console)
    warn_oversubscribed(config, console)
    console.print(f"pagedbench bench {run_id}: {len(cases)} points x {len(impls)} "
                  f"implementations ({', '.join(impls)}) on {device} -> {results.path}")
    peaks = device_peaks(args, config, console)
    start = time.monotonic()
    order = ([p for point in bench.point_order(plan, pairs) for p in point]
             if args.point_major else
             [p for p in runner.missing(plan, []) if pairs is None or p in pairs])
    run = bench.run_point_major if args.point_major else runner.run
    with RunProgress(console, "bench", order) as progress:
        try:
            records = run(plan, config, results, run_id, on_record=progress.update,
                          peaks=peaks, left_out=left_out, shard=part, pairs=pairs)
        except runner.Interrupted as exc:
            if args.junit_xml is not None:
                write_junit_xml(results_of_run(results, run_id), args.junit_xml,
                                f"pagedbench bench {run_id} (interrupted)", progress.seconds)
            return interrupted(exc, console, run_id, results, args.results_dir)
    if args.junit_xml is not None:
        write_junit_xml(records, args.junit_xml, f"pagedbench bench {run_id}",
                        progress.seconds)
        console.print(f"JUnit XML: {args.junit_xml}")
    lines = [line for line in results.lines() if line.run_id == run_id]
    md_path = results.path.with_suffix(".md")
    text = report.markdown(lines, title=f"pagedbench bench ({device})", baseline=args.baseline)
    if sweep.trace:
        steps = trace_section(records, [w.name for w in sweep.trace], args.trace)
        print(f"\n{steps}")
        text += f"\n{steps}"
    write_output(md_path, text)
    print_summary(console, records, f"pagedbench bench {run_id} ({device})",
                  files=[("results", results.path), ("report", md_path)])
    counts = {str(s): n for s in Status
              if (n := sum(r.status is s for r in records))}
    timed = [r for r in records if r.time_ms is not None and r.status is Status.PASS]
    noisy = sum(bool(r.time_ms.noisy) for r in timed)
    code = exit_code(r.status for r in records)
    console.print(
        f"bench {run_id}: {len(records)} results ({', '.join(f'{n} {s}' for s, n in counts.items())}), "
        f"{len(timed)} timed ({noisy} noisy) in {time.monotonic() - start:.0f} s; exit "
        f"{int(code)}")
    return int(code)


def trace_section(records: list[ResultRecord], steps: list[str], path: Path) -> str:
    """The Markdown of a trace's times (:func:`~pagedbench.harness.results.derived.
    trace_times`): per block size and dtype, each step's median ms per implementation and
    their total."""
    times = trace_times(records, steps)
    out = [f"## Trace {report.escape(path)}", "",
           report.escape(f"Median ms per step (a step: one batch of the trace), and the total "
                         f"over its {len(steps)} steps: the time the trace's attention takes "
                         "per layer. '-': not a timed pass (see the reasons above), and no "
                         "total then."), ""]
    for (block_size, dtype), table in times.groupby(["block_size", "dtype"], sort=False):
        shown = table.drop(columns=["block_size", "dtype"]).set_index("step")
        shown = shown.map(lambda v: "-" if pd.isna(v) else f"{v:.4g}")
        out += [f"### block_size {block_size}, {dtype}", "",
                report.escape_frame(shown).to_markdown(), ""]
    return "\n".join(out)
