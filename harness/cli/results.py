"""The commands that read results: ``pagedbench report`` (leaderboards of stored result
files), ``schema`` (the JSON Schema of a results line) and ``gate`` (current results
against a baseline, :mod:`pagedbench.harness.gate.compare`); their options:
:mod:`.results_options`."""

from __future__ import annotations

import argparse
import json
import math
import re
import sys

from rich.console import Console
from rich.markup import escape as rich_escape
from rich.text import Text

from pagedbench.reference import PagedValueError

from pagedbench.harness.cases.workloads import DEFAULT_BASELINE
from pagedbench.harness.cli.options import existing_file, writable_file, writable_folder
from pagedbench.harness.gate import baselines, compare as gate
from pagedbench.harness.measure.speed import Outcome, Thresholds
from pagedbench.harness.results import plots, report, shard, site
from pagedbench.harness.results.record import ResultRecord, json_schema
from pagedbench.harness.results.store import results_of, write_output
from pagedbench.harness.run.summary import fitted_table, print_summary, terminal
from pagedbench.harness.verdict.status import ExitCode


#: The gate's outcomes that moved (its summary lists them, then the too noisy ones).
MOVED = (Outcome.BROKEN, Outcome.SLOWER, Outcome.FASTER, Outcome.FIXED)
#: Most points the gate's summary lists (the report of --output has every one).
MAX_GATE_ROWS = 30


def _baseline(given: str | None, lines: list[object]) -> str:
    """The implementation speedups are against: ``given``, which must have results among
    ``lines`` (else every speedup would be empty, silently), or :data:`DEFAULT_BASELINE`."""
    if given is None:
        return DEFAULT_BASELINE
    impls = sorted({line.impl for line in lines if isinstance(line, ResultRecord)})
    if given not in impls:
        raise PagedValueError("--baseline", given, f"one of {', '.join(impls) or 'none'}",
                              f"--baseline {given}: no result of it in these files; "
                              f"the implementations there: {', '.join(impls) or 'none'}")
    return given


def cmd_report(args: argparse.Namespace) -> int:
    missing = [str(p) for p in args.paths if not p.exists()]
    if missing:
        raise PagedValueError("paths", missing, "existing files or folders",
                              f"no such file or folder: {', '.join(missing)}")
    if args.format == "site":
        if args.output is None:
            raise PagedValueError("--output", None, "a folder",
                                  "--format site needs --output DIR, the site's folder")
        writable_folder(args.output, "--output")
    elif args.output:
        writable_file(args.output, "--output")
    lines = shard.merged_lines(args.paths)
    args.baseline = _baseline(args.baseline, lines)
    if args.format == "site":
        for path in site.build(lines, args.output, args.baseline):
            print(f"site: {path}", file=sys.stderr)
    else:
        text = (report.csv_text(lines, args.baseline) if args.format == "csv"
                else site.single_page(lines, args.baseline) if args.format == "html"
                else report.markdown(lines, baseline=args.baseline))
        if args.output:
            write_output(args.output, text)
        else:
            print(text)
    if args.plots_dir:
        found = report.sections(lines, args.baseline)
        for section in found:
            prefix = "" if len(found) == 1 else (
                re.sub(r"[^A-Za-z0-9]+", "-", section["title"]).strip("-")[:60] + "-")
            peaks = section["copy_gbps"]
            for path in plots.save(section["bench"], section["scores"], args.plots_dir,
                                   prefix, peaks):
                print(f"plot: {path}", file=sys.stderr)
    return 0


def cmd_schema(args: argparse.Namespace) -> int:
    print(json.dumps(json_schema(), indent=2, sort_keys=True))
    return 0


def print_gate(console: Console, result: gate.GateReport, written: bool) -> None:
    """The gate's part of its summary: its notes (whole, wrapped), the points that moved
    (broken and slower first, each by effect) and those too noisy, in a table cut to the
    console's width, then its one-line verdict
    (:meth:`~pagedbench.harness.gate.compare.GateReport.summary`, printed whole)."""
    for note in result.notes:  # whole, wrapped: "nothing comparable" says why there
        console.print(Text(note, style="dim"))
    shown = [p for p in result.points if p.outcome in MOVED or p.outcome is Outcome.NOISY]
    shown.sort(key=lambda p: (list(Outcome).index(p.outcome), -abs(p.ratio - 1)
                              if math.isfinite(p.ratio) else 0))
    if shown:
        rows = [(f"[{_colour(p.outcome)}]{p.outcome}[/]", rich_escape(p.key.impl),
                 rich_escape(p.key.case_id), _ms(p.baseline_ms), _ms(p.current_ms),
                 f"{p.ratio - 1:+.1%}{'*' * p.probe_applied}" if math.isfinite(p.ratio)
                 else "")
                for p in shown[:MAX_GATE_ROWS]]
        console.print(fitted_table(
            f"Points that moved or were too noisy ({len(shown)})",
            ("outcome", "implementation", "case", "baseline ms", "current ms", "change"),
            rows, console.width, shrink=(1, 2)))
        if len(shown) > MAX_GATE_ROWS:
            console.print(f"... and {len(shown) - MAX_GATE_ROWS} more" + (
                " in the gate report" if written else " (--output FILE writes them all)"))
        if any(p.probe_applied for p in shown[:MAX_GATE_ROWS]):
            console.print(Text("*: the change judged, of samples each divided by the drift "
                               "probe timed after it; the ms columns are raw medians",
                               style="dim"))
    console.print(rich_escape(result.summary()), soft_wrap=True)


def _ms(value: float | None) -> str:
    return "" if value is None else f"{value:.4g}"


def _colour(outcome: Outcome) -> str:
    if outcome.fails_gate:
        return "red"
    return "green" if outcome in (Outcome.FASTER, Outcome.FIXED) else "yellow"


def cmd_gate(args: argparse.Namespace) -> int:
    thresholds = Thresholds(alpha=args.alpha, min_effect=args.min_effect,
                            min_samples=args.min_samples, probe=not args.raw)
    existing_file(args.current, "--current", folder_too=True)
    if not args.update_baseline:
        existing_file(args.baseline, "--baseline", folder_too=True,
                      hint=" (create the golden with --update-baseline)")
    current = results_of(shard.merged_lines([args.current]))
    sources = baselines.baseline_paths(args.baseline, {r.env.device for r in current})
    result = gate.compare(results_of(shard.merged_lines(sources)), current, thresholds,
                          allow_unjudged=args.allow_unjudged)
    if args.output:
        writable_file(args.output, "--output")
        write_output(args.output, result.markdown())
    console = terminal(soft_wrap=True)
    print_summary(console, current, f"pagedbench gate: {args.current}",
                  files=[("gate report", args.output)] if args.output else (),
                  write_cases=False)
    print_gate(console, result, bool(args.output))
    if args.update_baseline:
        for path in baselines.write_baseline(current, args.baseline):
            print(f"baseline written: {path}")
        return int(ExitCode.CLEAN)
    if result.exit_code is ExitCode.NOTHING_COMPARABLE:
        read = ", ".join(map(str, sources)) or f"none for these devices under {args.baseline}"
        print(f"read: baseline {read}; current {args.current}", file=sys.stderr)
    return int(result.exit_code)
