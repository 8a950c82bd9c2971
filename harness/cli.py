"""The ``pagedbench`` command line.

``pagedbench run``   check and time implementations on cases; exit 1 on any conformance
                     failure (``fail``, ``error``, ``crash`` or ``timeout``), 0 otherwise.
``pagedbench list``  implementations, their availability (with reasons) and capabilities.
``pagedbench report`` the leaderboard of stored result files (Markdown or CSV).
``pagedbench simulate`` KV capacity: contiguous reservation vs paged allocation on a trace.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

import pandas as pd
from rich.console import Console

from pagedbench.adapters import registry
from pagedbench.reference import DTYPES

from . import report, simulate
from .cases import DEFAULT_BLOCK_SIZES, DEFAULT_DTYPES, MODEL_PRESETS, default_cases
from .runner import RunConfig, apply_environment, cache_environment, run, worker_environment
from .store import DEFAULT_RESULTS_DIR, ResultsFile, Status, new_run_id, read_records

#: Caches and scratch files of every command (compilers, matplotlib, TMPDIR, truths).
DEFAULT_CACHE_DIR = Path("build")
#: Exit code of `pagedbench run` when no implementation passed any case (all
#: unavailable or unsupported): a GPU runner with a broken driver must not look green.
NOTHING_RAN = 2
#: Statuses that mean an implementation got a case it claims to support wrong.
FAILING = {str(Status.FAIL), str(Status.ERROR), str(Status.CRASH), str(Status.TIMEOUT)}


def _device(text: str) -> str:
    if text == "cpu" or text == "cuda" or (text.startswith("cuda:") and text[5:].isdigit()):
        return text
    raise argparse.ArgumentTypeError(f"must be cpu, cuda or cuda:N, got {text!r}")


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds > 0, got {text!r}")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {value}")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedbench", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    run_p = sub.add_parser("run", help="check and time implementations on model-preset cases")
    run_p.add_argument("--impl", action="append", default=[], metavar="NAME",
                       help="implementation to run (repeatable; default: all)")
    run_p.add_argument("--preset", action="append", default=[], choices=list(MODEL_PRESETS),
                       metavar="NAME", help=f"model preset (repeatable; default: all of {', '.join(MODEL_PRESETS)})")
    run_p.add_argument("--device", type=_device, default="cpu",
                       help="cpu (default), cuda or cuda:N")
    run_p.add_argument("--block-size", action="append", type=_positive_int, default=[],
                       help=f"block size (repeatable; default: {' '.join(map(str, DEFAULT_BLOCK_SIZES))})")
    run_p.add_argument("--dtype", action="append", default=[], choices=list(DTYPES),
                       help=f"dtype (repeatable; default: {' '.join(DEFAULT_DTYPES)})")
    run_p.add_argument("--results-dir", type=Path, default=DEFAULT_RESULTS_DIR,
                       help=f"folder for <run-id>.jsonl and .md (default: {DEFAULT_RESULTS_DIR})")
    run_p.add_argument("--no-timing", action="store_true", help="check correctness only")
    run_p.add_argument("--threads", type=_positive_int, default=os.cpu_count() or 1,
                       help="torch threads per worker (default: all cores)")
    run_p.add_argument("--repetitions", type=_positive_int, default=RunConfig.repetitions,
                       help=f"timed calls per case on the CPU, at most "
                            f"{RunConfig.time_budget_s:g} s of them (default: {RunConfig.repetitions})")
    run_p.add_argument("--case-timeout", type=_positive_seconds, default=300.0, metavar="SECONDS",
                       help="a case taking longer is 'timeout' (default: 300)")
    run_p.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE_DIR,
                       help=f"truth, compiler and scratch caches (default: {DEFAULT_CACHE_DIR})")

    list_p = sub.add_parser("list", help="implementations, availability and capabilities")
    list_p.add_argument("--device", type=_device, default="cpu",
                        help="device to check availability on: cpu, cuda or cuda:N")
    list_p.add_argument("--json", action="store_true", help="machine-readable output")
    report_p = sub.add_parser("report", help="leaderboard from stored result files")
    report_p.add_argument("paths", nargs="+", type=Path,
                          help=".jsonl result files or folders of them (merged in order)")
    report_p.add_argument("--format", choices=["md", "csv"], default="md",
                          help="md: leaderboard + summary; csv: one row per result")
    report_p.add_argument("--output", type=Path, help="write here instead of stdout")
    simulate.add_arguments(sub.add_parser(
        "simulate", help="KV capacity: contiguous reservation vs paged allocation on a trace"))
    return parser


def _select(names: list[str]) -> dict[str, str]:
    adapters = {name: target for name, (target, _) in registry().items()}
    unknown = [n for n in names if n not in adapters]
    if unknown:
        raise SystemExit(f"pagedbench: unknown --impl {unknown}; choose from {list(adapters)}")
    return {n: adapters[n] for n in names} if names else adapters


def _progress_line(record: dict[str, Any]) -> str:
    status = record["status"]
    colour = {"pass": "green", "fail": "red", "error": "red", "crash": "red",
              "timeout": "red"}.get(status, "dim")
    detail = report.cell_text(record)
    if status in FAILING:
        detail += f": {record['reason']}"
    return f"[{colour}]{record['impl']:<22}[/] {record['case_id']:<58} {detail}"


def cmd_run(args: argparse.Namespace) -> int:
    if args.results_dir.exists() and not args.results_dir.is_dir():
        raise SystemExit(f"pagedbench run: --results-dir {args.results_dir} is a file, "
                         "not a folder")
    adapters = _select(args.impl)
    cases = default_cases(
        args.preset or None,
        tuple(args.block_size) or DEFAULT_BLOCK_SIZES,
        tuple(args.dtype) or DEFAULT_DTYPES,
    )
    config = RunConfig(device=args.device, timing=not args.no_timing, threads=args.threads,
                       repetitions=args.repetitions, case_timeout_s=args.case_timeout,
                       cache_dir=args.cache_dir)
    run_id = new_run_id()
    results = ResultsFile(args.results_dir / f"{run_id}.jsonl")
    console = Console(highlight=False, soft_wrap=True)
    console.print(f"pagedbench run {run_id}: {len(adapters)} implementations x {len(cases)} "
                  f"cases on {args.device} -> {results.path}")
    records = run(adapters, cases, config, results, run_id,
                  on_record=lambda r: console.print(_progress_line(r)))
    text = report.markdown(records, title=f"pagedbench leaderboard ({args.device})")
    md_path = results.path.with_suffix(".md")
    md_path.write_text(text)
    print(f"\n{text}")
    failing = sorted({r["impl"] for r in records if r["status"] in FAILING})
    console.print(f"results: {results.path}  report: {md_path}")
    if failing:
        console.print(f"[red]conformance failures in: {', '.join(failing)}[/]")
        return 1
    if not any(r["status"] == str(Status.PASS) for r in records):
        console.print("[red]nothing ran: every implementation was unavailable or every case "
                      "unsupported (a CI lane that checks nothing must not pass)[/]")
        return NOTHING_RAN
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    # Availability as a worker of `pagedbench run` would see it (the Triton interpreter on
    # the CPU is switched on before any kernel module is imported).
    apply_environment(worker_environment(args.device, DEFAULT_CACHE_DIR))
    rows = []
    for name, (target, adapter) in registry().items():
        availability = adapter.available(args.device)
        rows.append({
            "name": name,
            "target": target,
            "description": adapter.description,
            "available": availability.ok,
            "reason": availability.reason,
            "version": availability.version,
            "details": availability.details,
            "interpreted": adapter.is_interpreted(args.device),
            "capabilities": adapter.capabilities(args.device).to_dict(),
        })
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(capability_matrix(rows))
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    missing = [str(p) for p in args.paths if not p.exists()]
    if missing:
        raise SystemExit(f"pagedbench report: no such file or folder: {', '.join(missing)}")
    if args.output and not args.output.parent.is_dir():
        raise SystemExit(f"pagedbench report: --output folder {args.output.parent} "
                         "does not exist")
    try:
        records = list(read_records(args.paths))
        if args.format == "csv":
            text = report.frame(records).drop(columns=["cell"]).to_csv(index=False)
        else:
            text = report.markdown(records)
    except ValueError as exc:
        raise SystemExit(f"pagedbench report: {exc}") from None
    if args.output:
        args.output.write_text(text)
    else:
        print(text)
    return 0


def capability_matrix(rows: list[dict[str, Any]]) -> str:
    """Markdown table: implementations x (availability, devices, dtypes, block sizes,
    head dims, modes, features), from ``pagedbench list --json`` rows."""
    def join(values: list[Any] | None) -> str:
        if values is None:
            return "any"
        steps = {b - a for a, b in zip(values, values[1:])} if all(
            isinstance(v, int) for v in values) else set()
        if len(values) > 6 and len(steps) == 1:
            return f"{values[0]}..{values[-1]} step {steps.pop()}"
        return ", ".join(map(str, values)) or "-"

    table = pd.DataFrame([
        {
            "implementation": r["name"],
            "available": "yes" + (" (interp.)" if r["interpreted"] else "") if r["available"]
            else f"no: {r['reason']}",
            "version": r["version"],
            "devices": join(r["capabilities"]["devices"]),
            "dtypes": join(r["capabilities"]["dtypes"]),
            "block sizes": join(r["capabilities"]["block_sizes"]),
            "head dims": join(r["capabilities"]["head_dims"]),
            "modes": join(r["capabilities"]["modes"]),
            "features": join(r["capabilities"]["features"]),
            "kv cache": join(r["capabilities"]["kv_cache_dtypes"]),
            "NaN-safe tail": "yes" if r["capabilities"]["nan_safe_tail"] else "no (†)",
        }
        for r in rows
    ])
    return table.to_markdown(index=False)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``pagedbench`` console script; returns the exit code."""
    args = _parser().parse_args(argv)
    cache_dir = getattr(args, "cache_dir", DEFAULT_CACHE_DIR)
    if cache_dir.exists() and not cache_dir.is_dir():
        raise SystemExit(f"pagedbench: --cache-dir {cache_dir} is a file, not a folder")
    apply_environment(cache_environment(cache_dir))
    commands = {"run": cmd_run, "list": cmd_list, "report": cmd_report,
                "simulate": simulate.run}
    try:
        return commands[args.command](args)
    except BrokenPipeError:  # e.g. `pagedbench report ... | head`: not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
