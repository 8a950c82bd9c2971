"""The ``pagedbench`` command line.

``pagedbench run``      check and time implementations on cases (``--resume RUN_ID``
                        finishes an interrupted run).
``pagedbench bench``    the benchmark sweep: workloads x block sizes x dtypes, each point
                        checked, then timed (``harness.bench``).
``pagedbench list``     implementations, their availability (with reasons) and capabilities.
``pagedbench report``   the leaderboard of stored result files (Markdown, CSV or HTML).
``pagedbench gate``     current results against a baseline: exit 1 on a conformance
                        regression or a slowdown beyond noise (:mod:`.gate`).
``pagedbench schema``   the JSON Schema of a results-file line.
``pagedbench simulate`` KV capacity: contiguous reservation vs paged allocation on a trace.
``pagedbench replay``   re-run one case (a failure's case file, a result line) and show
                        the verdict and its figures.
``pagedbench selftest`` run the conformance suite on the fault catalogue: which property
                        catches each fault.

Implementations are found without importing them and imported only in worker processes
(:mod:`.runner`), so no plug-in can take a command down. Bad options and input files are
refused with the option, the value and what is allowed (exit 2); exit codes are those of
:class:`~.status.ExitCode`.
(Over 500 lines: one parser and one handler per command, kept together so that every
option's name, check and help are read in one place; the work is in the modules named.)
"""

from __future__ import annotations

import argparse
import errno
import json
import math
import os
import re
import signal
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any

import pandas as pd
from rich.console import Console
from rich.markup import escape as rich_escape

from pagedbench.adapters import entries
from pagedbench.reference import (DTYPES, PagedInputError, PagedValueError, check_fits,
                                  resolve_device)

from . import bench, gate, plots, replay, report, runner, selftest, shard, simulate
from .cases import DEFAULT_BLOCK_SIZES, DEFAULT_DTYPES, MODEL_PRESETS, default_cases
from .derived import DEFAULT_BASELINE
from .workloads import BENCH_SUITE, LAYOUT_RATIOS, MODES, parse_batch_spec
from .conformance import CASE_LOGITS_MARK, STALE_TAIL_MARK
from .environment import (CACHE_DIR_VARIABLE, apply_environment, cache_environment,
                          default_cache_dir)
from .junit import write_junit_xml
from .progress import RunProgress
from .record import (COMPARISON_FIELDS, DevicePeaks, Environment, ListingRow, Plan,
                     ResultRecord, RunRecord, Shard, json_schema)
from .speed import Thresholds
from .status import GATE_EXIT_MEANING, ExitCode, Status, exit_code, exit_codes_help
from .store import (DEFAULT_RESULTS_DIR, OutputError, ResultsFile, ResultsFileError,
                    environment, new_run_id, read_lines, results_of, run_states, write_output)
from .timing import oversubscribed
from .truth import HOST_TRUTH_FRACTION, truth_site

#: Most torch threads a worker may be given.
MAX_THREADS = 1024
_RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


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


def _int_in(low: int, high: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"must be an integer >= {low}, got {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low} and <= {high}, "
                                             f"got {value}")
        return value
    return parse


_positive_int = _int_in(1, 2**62)


def _run_id(text: str) -> str:
    if not _RUN_ID.fullmatch(text):
        raise argparse.ArgumentTypeError(f"must be a run id such as 20261130T041502Z-12345 "
                                         f"(letters, digits, '.', '_', '-'), got {text!r}")
    return text


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedbench", description=__doc__.split("\n\n")[0],
                                     epilog=exit_codes_help(),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    run_p = sub.add_parser("run", help="check and time implementations on model-preset cases",
                           epilog=exit_codes_help(),
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    run_p.add_argument("--impl", action="append", default=[], metavar="NAME",
                       help="implementation to run (repeatable; default: all)")
    run_p.add_argument("--preset", action="append", default=[], choices=list(MODEL_PRESETS),
                       metavar="NAME", help=f"model preset (repeatable; default: all of {', '.join(MODEL_PRESETS)})")
    run_p.add_argument("--device", type=_device, default=None,
                       help="cpu (default), cuda or cuda:N; checked against this machine")
    run_p.add_argument("--block-size", action="append", type=_positive_int, default=[],
                       help=f"block size (repeatable; default: {' '.join(map(str, DEFAULT_BLOCK_SIZES))})")
    run_p.add_argument("--dtype", action="append", default=[], choices=list(DTYPES),
                       help=f"dtype (repeatable; default: {' '.join(DEFAULT_DTYPES)})")
    run_p.add_argument("--no-timing", action="store_const", const=True, default=None,
                       help="check correctness only")
    run_p.add_argument("--repetitions", type=_int_in(1, 100_000), default=None,
                       help="CPU timing samples per case, as the time limit of "
                            f"{runner.RunConfig.time_limit_s:g} s allows (at least "
                            f"{runner.RunConfig.time_budget_s:g} s of blocks of calls; "
                            f"default: {runner.RunConfig.repetitions})")
    run_p.add_argument("--harness-timeout", type=_positive_seconds, default=None,
                       metavar="SECONDS",
                       help="pagedbench's own time per case (truth and compare, in the "
                            "judging parent); past it: 'harness-error' (default: "
                            f"{runner.RunConfig.harness_timeout_s:g})")
    run_p.add_argument("--resume", type=_run_id, metavar="RUN_ID",
                       help="finish the interrupted run RUN_ID of --results-dir with its "
                            "recorded selection, skipping the results it already has")
    _run_and_bench_arguments(run_p, "case")

    _bench_arguments(sub.add_parser(
        "bench", help="benchmark sweep: block size x batch x GQA layout x context x mode x dtype",
        description=bench.__doc__.split("\n\n")[0], epilog=exit_codes_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter))

    list_p = sub.add_parser("list", help="implementations, availability and capabilities")
    list_p.add_argument("--device", type=_device, default="cpu",
                        help="device to check availability on: cpu, cuda or cuda:N")
    list_p.add_argument("--json", action="store_true", help="machine-readable output")
    list_p.add_argument("--timeout", type=_positive_seconds, default=runner.LIST_TIMEOUT_S,
                        metavar="SECONDS", help="each implementation's time to import and "
                        f"answer; past it: 'timeout' (default: {runner.LIST_TIMEOUT_S:g})")
    cache_dir_argument(list_p, "compiler and scratch caches of the workers that answer")
    report_p = sub.add_parser("report", help="leaderboard from stored result files")
    report_p.add_argument("paths", nargs="+", type=Path,
                          help=".jsonl result files or folders of them (merged in order)")
    report_p.add_argument("--format", choices=["md", "csv", "html"], default="md",
                          help="md: leaderboard + summary (+ bench tables); csv: one row per "
                               "result with derived figures; html: one standalone page of "
                               "tables and plots")
    report_p.add_argument("--baseline", default=DEFAULT_BASELINE, metavar="NAME",
                          help="implementation speedups are measured against (default: "
                               f"{DEFAULT_BASELINE})")
    report_p.add_argument("--output", type=Path, help="write here instead of stdout")
    report_p.add_argument("--plots-dir", type=Path, default=None, metavar="DIR",
                          help="also write the bench plots there as PNG files")
    sub.add_parser("schema", help="JSON Schema of a results-file line (docs/results.md)")
    _gate_arguments(sub.add_parser(
        "gate", help="current results against a baseline: exit 1 on a conformance "
        "regression or a slowdown", description=gate.__doc__.split("\n\n")[0],
        epilog=exit_codes_help(GATE_EXIT_MEANING),
        formatter_class=argparse.RawDescriptionHelpFormatter))
    simulate.add_arguments(sub.add_parser(
        "simulate", help="KV capacity: contiguous reservation vs paged allocation on a trace"))
    _replay_arguments(sub)
    _selftest_arguments(sub)
    return parser


def _batch_spec(text: str) -> str:
    try:
        parse_batch_spec(text)
    except PagedInputError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _bench_arguments(p: argparse.ArgumentParser) -> None:
    cpu, gpu = bench.CPU_SWEEP, bench.GPU_SWEEP

    def axis(flag: str, dest: str, help: str, **kw: Any) -> None:
        p.add_argument(flag, dest=dest, action="append", default=[], help=help, **kw)

    def show(values: tuple) -> str:
        return " ".join(map(str, values))

    p.add_argument("--impl", action="append", default=[], metavar="NAME",
                   help="implementation to time (repeatable; default on the CPU: "
                        f"{', '.join(bench.CPU_IMPLS)}; on a GPU: all)")
    p.add_argument("--baseline", default=DEFAULT_BASELINE, metavar="NAME",
                   help=f"speedups are against it; run too if not chosen (default: "
                        f"{DEFAULT_BASELINE})")
    p.add_argument("--device", type=_device, default="cpu", help="cpu (default), cuda or cuda:N")
    p.add_argument("--quick", action="store_true",
                   help="a seconds-long sweep (2 workloads, 2 block sizes, float32) with short "
                        "timings, for smoke tests; the axis options still apply")
    axis("--mode", "modes", f"grid mode (repeatable; default CPU: {show(cpu.modes)})",
         choices=list(MODES))
    axis("--layout", "layouts", "GQA layout or preset heads (repeatable; default CPU: "
         f"{show(cpu.layouts)})", choices=[*LAYOUT_RATIOS, *MODEL_PRESETS], metavar="LAYOUT")
    axis("--batch-size", "batch_sizes", f"sequences per batch (repeatable; default CPU: "
         f"{show(cpu.batch_sizes)}, GPU: {show(gpu.batch_sizes)})", type=_positive_int)
    axis("--context", "contexts", f"KV tokens per sequence (repeatable; default CPU: "
         f"{show(cpu.contexts)}, GPU: {show(gpu.contexts)})", type=_positive_int)
    axis("--block-size", "block_sizes", f"block size (repeatable; default CPU: "
         f"{show(cpu.block_sizes)}, GPU: {show(gpu.block_sizes)})", type=_positive_int)
    axis("--dtype", "dtypes", f"dtype (repeatable; default CPU: {show(cpu.dtypes)}, GPU: "
         f"{show(gpu.dtypes)})", choices=list(DTYPES))
    axis("--batch-spec", "batch_specs", "a vLLM batch-spec workload such as 8q1s1k or "
         "2q2k_32q1s1k, with every --layout (repeatable); alone (no --mode, --batch-size or "
         "--context) it replaces the grid", type=_batch_spec, metavar="SPEC")
    axis("--preset", "presets", "a ragged decode batch with a model preset's heads "
         "(repeatable); alone it replaces the grid", choices=list(MODEL_PRESETS),
         metavar="NAME")
    axis("--workload", "workload_patterns", "keep workloads whose name matches this shell "
         "pattern, e.g. 'decode-*' or '*-mqa-*' (repeatable)", metavar="PATTERN")
    p.add_argument("--grid", choices=list(bench.GRIDS), default=None,
                   help="full: every combination of the grid axes; axes: one axis at a time "
                        "around the first values (CPU default); none: no grid workloads")
    p.add_argument("--no-contiguous", action="store_true",
                   help="skip each workload's contiguous point (no paging overhead then)")
    p.add_argument("--no-peaks", action="store_true",
                   help="do not measure the device's copy bandwidth and bf16 throughput")
    p.add_argument("--peaks", type=Path, default=None, metavar="FILE",
                   help="take the device's peaks from FILE instead of measuring them: a JSON "
                        "object with copy_gbps, bf16_tflops and method, at its top or under "
                        "'peaks' (the GPU lane's env.json, measured in the same call)")
    p.add_argument("--host-truth-bytes", type=_int_in(0, 2**62), default=None,
                   metavar="BYTES",
                   help="largest truth (inputs plus one sequence's float64 work) computed on "
                        "the host; larger points get their truth on the device (default: "
                        f"{HOST_TRUTH_FRACTION:g} of the host's memory)"),
    p.add_argument("--dry-run", action="store_true", help="print the points and exit")
    p.add_argument("--repetitions", type=_int_in(1, 100_000), default=None, metavar="N",
                   help="CPU timing samples per point, as the time limit allows (default: "
                        f"{bench.CPU_TIMING['default']['repetitions']}; pagedbench gate "
                        "judges points with at least --min-samples of them)")
    p.add_argument("--min-time", type=_positive_seconds, default=None, metavar="SECONDS",
                   help="CPU: measure each point for at least this long (default: "
                        f"{bench.CPU_TIMING['default']['time_budget_s']:g})")
    _run_and_bench_arguments(p, "point")


def _shard_spec(text: str) -> shard.ShardSpec:
    try:
        return shard.parse_spec(text)
    except PagedValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _run_and_bench_arguments(p: argparse.ArgumentParser, unit: str) -> None:
    """The options ``run`` and ``bench`` share; ``unit`` names what they run (``case`` or
    ``point``)."""
    p.add_argument("--threads", type=_int_in(1, MAX_THREADS), default=None,
                   help="torch threads per worker (default: "
                        f"{runner.RunConfig.threads}: more wait for preempted threads on a "
                        "shared host; docs/gate.md)")
    p.add_argument("--case-timeout", type=_positive_seconds, default=None, metavar="SECONDS",
                   help=f"the implementation's own time per {unit} (import and available, "
                        "then prepare, run, describe, timing); past it: 'timeout' (default: "
                        f"{runner.RunConfig.case_timeout_s:g})")
    p.add_argument("--results-dir", type=Path, default=DEFAULT_RESULTS_DIR,
                   help=f"folder for <run-id>.jsonl and .md (default: {DEFAULT_RESULTS_DIR})")
    cache_dir_argument(p)
    p.add_argument("--junit-xml", type=Path, metavar="FILE",
                   help="also write the verdicts as JUnit XML, one testcase per "
                        f"(implementation, {unit}), for CI test reports")
    p.add_argument("--shard", type=_shard_spec, default=None, metavar="K/N",
                   help=f"run only the K-th of N parts of the (implementation, {unit}) "
                        "pairs, balanced by expected cost and the same on every machine; "
                        "report and gate merge the N results files (docs/ci.md)")


def cache_dir_argument(p: argparse.ArgumentParser,
                       what: str = "truth, compiler and scratch caches") -> None:
    """``--cache-dir DIR``, the same on every command that writes caches: ``what`` goes
    there (default: ``$PAGEDBENCH_CACHE_DIR``, else ``build`` of the working directory,
    as the pytest plugin's ``--pagedbench-cache-dir``)."""
    p.add_argument("--cache-dir", type=Path, default=default_cache_dir(),
                   help=f"{what} (default: ${CACHE_DIR_VARIABLE}, else build; now: "
                        f"{default_cache_dir()})")


def _fraction(low_open: float, high_open: float):
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = float("nan")
        if not (math.isfinite(value) and low_open < value < high_open):
            raise argparse.ArgumentTypeError(f"must be a number > {low_open:g} and < "
                                             f"{high_open:g}, got {text!r}")
        return value
    return parse


def _gate_arguments(gate_p: argparse.ArgumentParser) -> None:
    defaults = Thresholds()
    gate_p.add_argument("--baseline", type=Path, required=True, metavar="FILE_OR_DIR",
                        help="the golden: a .jsonl file, a folder of them, or a folder of "
                             f"device folders such as {gate.BASELINES_DIR} (the folder of "
                             "each current device is read)")
    gate_p.add_argument("--current", type=Path, required=True, metavar="FILE_OR_DIR",
                        help="the results to judge: a .jsonl file or a folder of them")
    gate_p.add_argument("--alpha", type=_fraction(0, 1), default=defaults.alpha,
                        help="family-wise significance level of the U tests "
                             f"(default: {defaults.alpha:g})")
    gate_p.add_argument("--min-effect", type=_fraction(0, math.inf),
                        default=defaults.min_effect, metavar="FRACTION",
                        help="smallest change of the median that counts, e.g. 0.1 for 10%% "
                             f"(default: {defaults.min_effect:g})")
    gate_p.add_argument("--min-samples", type=_int_in(2, 2**31), default=defaults.min_samples,
                        metavar="N", help="fewest samples on either side that are judged "
                        f"(default: {defaults.min_samples})")
    gate_p.add_argument("--raw", action="store_true",
                        help="judge raw ms, not each CPU sample divided by the drift probe "
                             "timed after it (which cancels a shared machine's drift)")
    gate_p.add_argument("--allow-unjudged", action="store_true",
                        help="exit 0, not 7, when no point regressed but some could not be "
                             "judged (too noisy, timed on one side only, or in only one of "
                             "baseline and current); the last line still counts them")
    gate_p.add_argument("--update-baseline", action="store_true",
                        help="after comparing, write the current results as the new golden "
                             "(--baseline's file, or <folder>/<device>/"
                             f"{gate.BASELINE_FILE}) and exit 0")


def writable_folder(path: Path, option: str) -> None:
    """Create ``path`` if missing and check that a file can be written in it.

    Raises
    ------
    PagedValueError
        Naming ``option`` and ``path``: it is a file, lies under a file, or cannot be
        written (``/proc``, permissions).
    """
    if path.exists() and not path.is_dir():
        raise PagedValueError(option, str(path), "a folder",
                              f"{option} {path} is a file, not a folder")
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as exc:
        raise PagedValueError(option, str(path), "a folder pagedbench can create and write to",
                              f"{option} {path}: cannot create or write there "
                              f"({exc.strerror or exc})") from None


def writable_file(path: Path, option: str) -> None:
    """Check that ``path`` can be written: not a folder, in an existing writable folder.

    Raises
    ------
    PagedValueError
        Naming ``option`` and ``path``.
    """
    if path.is_dir():
        raise PagedValueError(option, str(path), "a file", f"{option} {path} is a folder")
    if not path.parent.is_dir():
        raise PagedValueError(option, str(path), "a file in an existing folder",
                              f"{option} folder {path.parent} does not exist")
    try:
        with tempfile.TemporaryFile(dir=path.parent):
            pass
    except OSError as exc:
        raise PagedValueError(option, str(path), "a file in a folder pagedbench can write to",
                              f"{option} {path}: cannot write there "
                              f"({exc.strerror or exc})") from None


def _checked_device(text: str) -> str:
    """``text`` once this machine has that device (before any worker starts)."""
    try:
        resolve_device(text)
    except PagedInputError as exc:
        raise PagedValueError("--device", text, exc.allowed, f"--device {text}: {exc}") from None
    return text


def _select(names: list[str]) -> dict[str, str]:
    known = {e.name: e.target for e in entries()}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise PagedValueError("--impl", unknown, f"among {list(known)}",
                              f"--impl {unknown} unknown; choose from {list(known)}")
    return {n: known[n] for n in dict.fromkeys(names)} if names else known


def _progress_line(record: ResultRecord) -> str:
    status = record.status
    detail = report.cell_text(record)
    if status is not Status.PASS:
        detail += f": {record.reason}"
    return (f"[{status.colour}]{rich_escape(record.impl):<22}[/] "
            f"{rich_escape(record.case_id):<58} {rich_escape(detail)}")


def _finish(records: list[ResultRecord], lines: list, results: ResultsFile,
            console: Console, device: str) -> int:
    """Write and print the report of a run; its exit code."""
    text = report.markdown(lines, title=f"pagedbench leaderboard ({device})")
    md_path = results.path.with_suffix(".md")
    write_output(md_path, text)
    print(f"\n{text}")
    console.print(f"results: {results.path}  report: {md_path}")
    code = exit_code(r.status for r in records)
    failing = sorted({r.impl for r in records if r.status.failing})
    if code is ExitCode.CONFORMANCE_FAILURE:
        console.print(f"[red]conformance failures in: {', '.join(failing)}[/]")
    elif code is ExitCode.HARNESS_FAULT:
        console.print("[yellow]harness errors (pagedbench's own fault, see the reasons)[/]")
    elif code is ExitCode.NOTHING_RAN:
        console.print("[red]nothing ran: every implementation was unavailable or every case "
                      "unsupported (a CI lane that checks nothing must not pass)[/]")
    return int(code)


def _resume_target(args: argparse.Namespace) -> tuple[Plan, runner.RunConfig, ResultsFile]:
    given = [flag for flag, value in (("--impl", args.impl), ("--preset", args.preset),
                                      ("--block-size", args.block_size), ("--dtype", args.dtype),
                                      ("--device", args.device), ("--no-timing", args.no_timing),
                                      ("--threads", args.threads),
                                      ("--repetitions", args.repetitions),
                                      ("--case-timeout", args.case_timeout),
                                      ("--harness-timeout", args.harness_timeout),
                                      ("--shard", args.shard)) if value]
    if given:
        raise PagedValueError("--resume", given,
                              "only --results-dir, --cache-dir and --junit-xml beside it",
                              f"--resume finishes the run with its recorded selection and "
                              f"settings; drop {', '.join(given)}")
    results = ResultsFile(args.results_dir / f"{args.resume}.jsonl")
    if not results.path.is_file():
        raise PagedValueError("--resume", args.resume, "a run in --results-dir",
                              f"--resume {args.resume}: no {results.path} (is --results-dir "
                              "the folder that run wrote to?)")
    starts = [(number, line) for number, line in results.numbered_lines()
              if isinstance(line, RunRecord) and line.run_id == args.resume
              and line.event == "started"]
    if not starts or starts[-1][1].plan is None:
        raise PagedValueError("--resume", args.resume, "a run that recorded its start",
                              f"--resume {args.resume}: {results.path} records no start with "
                              "a plan (written before schema_version 2?)")
    number, start = starts[-1]
    known = {e.name: e.target for e in entries()}
    for impl in start.plan.impls:  # a results file is data: it names adapters, never adds one
        if known.get(impl.name) != impl.target:
            raise ResultsFileError(
                results.path, number, f"the plan's {impl.name!r} = {impl.target!r} is not a "
                f"registered adapter (registered: {known.get(impl.name) or 'no such name'}); "
                "--resume runs only the built-in and installed adapters")
    config = runner.RunConfig.from_dict(start.config or {}, args.cache_dir)
    return start.plan, config, results


def _interrupted(exc: runner.Interrupted, console: Console, run_id: str, results: ResultsFile,
                 results_dir: Path) -> int:
    """Say how to finish an interrupted run; its exit code (128 + the signal)."""
    console.print(f"[yellow]{exc}: the results so far are in {results.path}; finish the "
                  f"run with: pagedbench run --resume {run_id} --results-dir {results_dir}[/]")
    return 128 + exc.signum


def _shard_of(args: argparse.Namespace, plan: Plan, results: ResultsFile, run_id: str,
              console: Console) -> tuple[Shard | None, set[tuple[str, str]] | None]:
    """``--shard K/N``'s record and pairs of ``plan`` (a resumed run's: those it recorded);
    ``(None, None)`` for the whole plan."""
    if getattr(args, "resume", None):  # run --resume (bench has none)
        return None, shard.recorded_pairs(plan, results.lines(), run_id)
    if args.shard is None:
        return None, None
    part, pairs = shard.shard_record(plan, args.shard), shard.pairs_of(plan, args.shard)
    console.print(f"shard {args.shard} of plan {part.plan_sha256[:12]}: {len(pairs)} of "
                  f"{plan.size} (implementation, point) pairs")
    return part, pairs


def cmd_run(args: argparse.Namespace) -> int:
    writable_folder(args.results_dir, "--results-dir")
    if args.junit_xml is not None:
        writable_file(args.junit_xml, "--junit-xml")
    console = Console(highlight=False, soft_wrap=True)
    if args.resume:
        plan, config, results = _resume_target(args)
        _checked_device(config.device)
        run_id = args.resume
        state = run_states(results.lines())[run_id]
        if state.finished is not None and state.results >= state.planned:
            console.print(f"run {run_id} already finished ({state.results} results); "
                          "nothing to resume")
    else:
        device = _checked_device(args.device or "cpu")
        impls = _select(args.impl)
        cases = default_cases(list(dict.fromkeys(args.preset)) or None,
                              tuple(dict.fromkeys(args.block_size)) or DEFAULT_BLOCK_SIZES,
                              tuple(dict.fromkeys(args.dtype)) or DEFAULT_DTYPES)
        for case in cases:
            try:
                check_fits(case, device)
            except PagedInputError as exc:
                option = "--block-size" if exc.parameter == "block_size" else "--preset"
                raise PagedValueError(option, exc.value, exc.allowed,
                                      f"{option} {exc.value}: {exc}") from None
        defaults = runner.RunConfig()
        config = runner.RunConfig(
            device=device, timing=not args.no_timing, cache_dir=args.cache_dir,
            threads=args.threads or defaults.threads,
            repetitions=args.repetitions or defaults.repetitions,
            case_timeout_s=args.case_timeout or defaults.case_timeout_s,
            harness_timeout_s=args.harness_timeout or defaults.harness_timeout_s)
        plan = runner.make_plan(impls, cases)
        run_id = new_run_id()
        results = ResultsFile(args.results_dir / f"{run_id}.jsonl")
    part, pairs = _shard_of(args, plan, results, run_id, console)
    _warn_oversubscribed(config, console)
    with results.locked():  # one writer per run: a second resume is refused
        console.print(f"pagedbench run {run_id}: {len(plan.impls)} implementations x "
                      f"{len(plan.cases)} cases on {config.device} -> {results.path}")
        order = runner.missing(plan, _results_of_run(results, run_id)) if args.resume else \
            runner.missing(plan, [])
        order = order if pairs is None else [p for p in order if p in pairs]
        with RunProgress(console, "run", order) as progress:
            try:
                records = runner.run(plan, config, results, run_id, resume=bool(args.resume),
                                     on_record=lambda r: progress.update(r, _progress_line(r)),
                                     shard=part, pairs=pairs)
            except runner.Interrupted as exc:
                if args.junit_xml is not None:
                    write_junit_xml(_results_of_run(results, run_id), args.junit_xml,
                                    f"pagedbench run {run_id} (interrupted)", progress.seconds)
                return _interrupted(exc, console, run_id, results, args.results_dir)
        lines = [line for line in results.lines() if line.run_id == run_id]
        if args.junit_xml is not None:
            write_junit_xml(records, args.junit_xml, f"pagedbench run {run_id}",
                            progress.seconds)
            console.print(f"JUnit XML: {args.junit_xml}")
        return _finish(records, lines, results, console, config.device)


def bench_sweep(args: argparse.Namespace) -> bench.Sweep:
    """The sweep of ``pagedbench bench``'s options: the device's default (or ``--quick``'s)
    with each axis given replaced; ``--batch-spec``/``--preset`` without a grid axis option
    replace the grid (raises ``PagedValueError`` naming the option of a bad value)."""
    sweep = bench.default_sweep(args.device, args.quick)
    changes: dict[str, Any] = {}
    for dest in ("modes", "layouts", "batch_sizes", "contexts", "block_sizes", "dtypes",
                 "batch_specs", "presets", "workload_patterns"):
        if getattr(args, dest):
            changes[dest] = tuple(dict.fromkeys(getattr(args, dest)))
    grid_given = any(getattr(args, d) for d in ("modes", "batch_sizes", "contexts"))
    if args.grid:
        changes["grid"] = args.grid
    elif (args.batch_specs or args.presets) and not grid_given:
        changes["grid"] = "none"
    if (args.batch_specs or args.grid == "none") and not args.presets:
        changes.setdefault("presets", ())
    if args.no_contiguous:
        changes["contiguous"] = False
    return sweep.with_(**changes)


def _bench_impls(args: argparse.Namespace) -> dict[str, str]:
    known = {e.name: e.target for e in entries()}
    if args.baseline not in known:
        raise PagedValueError("--baseline", args.baseline, f"among {list(known)}")
    if args.impl:
        chosen = _select(args.impl)
    elif args.device == "cpu":
        chosen = {n: t for n, t in known.items() if n in bench.CPU_IMPLS}
    else:
        chosen = known
    return {args.baseline: known[args.baseline], **chosen}


def cmd_bench(args: argparse.Namespace) -> int:
    import time

    writable_folder(args.results_dir, "--results-dir")
    if args.junit_xml is not None:
        writable_file(args.junit_xml, "--junit-xml")
    device = _checked_device(args.device)
    sweep = bench_sweep(args)
    cases = sweep.cases()
    impls = _bench_impls(args)
    console = Console(highlight=False, soft_wrap=True, stderr=False)
    if args.dry_run:
        for case in cases:
            print(case.case_id)
        for note in sweep.left_out():
            print(f"left out: {note}")
        console.print(f"{len(cases)} points x {len(impls)} implementations "
                      f"({', '.join(impls)})")
        return 0
    if not cases:
        raise PagedValueError("bench options", "no point", "options that keep at least one "
                              "point", "the options leave no point to time (--workload "
                              f"{list(sweep.workload_patterns)}, --grid {sweep.grid}; see "
                              "--dry-run)")
    left_out, kept = sweep.left_out(), []
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
        threads=args.threads or defaults.threads,
        case_timeout_s=args.case_timeout or defaults.case_timeout_s,
        **({**timing, "time_budget_s": args.min_time,
            "time_limit_s": max(args.min_time, defaults.time_limit_s)} if args.min_time
           else timing))
    plan = runner.make_plan(impls, cases)
    run_id = new_run_id()
    results = ResultsFile(args.results_dir / f"{run_id}.jsonl")
    part, pairs = _shard_of(args, plan, results, run_id, console)
    _warn_oversubscribed(config, console)
    console.print(f"pagedbench bench {run_id}: {len(cases)} points x {len(impls)} "
                  f"implementations ({', '.join(impls)}) on {device} -> {results.path}")
    peaks = None
    if args.peaks is not None:
        peaks = peaks_file(args.peaks)
        console.print(f"device peaks from {args.peaks}: {peaks.copy_gbps:.1f} GB/s copy, "
                      f"{peaks.bf16_tflops:.3g} TFLOP/s bf16 matmul")
    elif not args.no_peaks:
        peaks, why = runner.device_peaks(config)
        console.print(f"device peaks: {peaks.copy_gbps:.1f} GB/s copy, "
                      f"{peaks.bf16_tflops:.3g} TFLOP/s bf16 matmul" if peaks
                      else f"[yellow]device peaks not measured: {rich_escape(why)}[/]")
    start = time.monotonic()
    order = [p for p in runner.missing(plan, []) if pairs is None or p in pairs]
    with RunProgress(console, "bench", order) as progress:
        def on_record(record: ResultRecord) -> None:
            progress.update(record, None if record.status is Status.PASS
                            else _progress_line(record))

        try:
            records = runner.run(plan, config, results, run_id, on_record=on_record,
                                 peaks=peaks, left_out=left_out, shard=part, pairs=pairs)
        except runner.Interrupted as exc:
            if args.junit_xml is not None:
                write_junit_xml(_results_of_run(results, run_id), args.junit_xml,
                                f"pagedbench bench {run_id} (interrupted)", progress.seconds)
            return _interrupted(exc, console, run_id, results, args.results_dir)
    if args.junit_xml is not None:
        write_junit_xml(records, args.junit_xml, f"pagedbench bench {run_id}",
                        progress.seconds)
        console.print(f"JUnit XML: {args.junit_xml}")
    lines = [line for line in results.lines() if line.run_id == run_id]
    md_path = results.path.with_suffix(".md")
    write_output(md_path, report.markdown(lines, title=f"pagedbench bench ({device})",
                                          baseline=args.baseline))
    counts = {str(s): n for s in Status
              if (n := sum(r.status is s for r in records))}
    timed = [r for r in records if r.time_ms is not None and r.status is Status.PASS]
    noisy = sum(bool(r.time_ms.noisy) for r in timed)
    code = exit_code(r.status for r in records)
    console.print(
        f"bench {run_id}: {len(records)} results ({', '.join(f'{n} {s}' for s, n in counts.items())}), "
        f"{len(timed)} timed ({noisy} noisy) in {time.monotonic() - start:.0f} s; exit "
        f"{int(code)}; results {results.path}, report {md_path}")
    return int(code)


def _warn_oversubscribed(config: runner.RunConfig, console: Console) -> None:
    """Warn when a CPU timing's threads oversubscribe the host (:func:`~.timing.oversubscribed`)."""
    warning = oversubscribed(config.threads) if config.device == "cpu" and config.timing else ""
    if warning:
        console.print(f"[yellow]warning: {rich_escape(warning)}[/]")


def peaks_file(path: Path) -> DevicePeaks:
    """The device peaks in ``path`` (``--peaks``): a JSON object of
    :class:`~.record.DevicePeaks`, at its top or under ``"peaks"``.

    Raises
    ------
    PagedValueError
        Naming ``--peaks`` and the file when it cannot be read or holds no valid peaks.
    """
    try:
        data = json.loads(path.read_text())
        data = data.get("peaks", data) if isinstance(data, dict) else data
        return DevicePeaks.model_validate(data)
    except (OSError, ValueError) as exc:  # ValidationError is a ValueError
        raise PagedValueError("--peaks", str(path), "a JSON file of copy_gbps, bf16_tflops "
                              "and method", f"--peaks {path}: {exc}") from None


def _results_of_run(results: ResultsFile, run_id: str) -> list[ResultRecord]:
    return [r for r in results_of(results.lines()) if r.run_id == run_id]


def cmd_gate(args: argparse.Namespace) -> int:
    thresholds = Thresholds(alpha=args.alpha, min_effect=args.min_effect,
                            min_samples=args.min_samples, probe=not args.raw)
    if not args.current.exists():
        raise PagedValueError("--current", str(args.current), "an existing file or folder",
                              f"--current {args.current}: no such file or folder")
    if not args.baseline.exists() and not args.update_baseline:
        raise PagedValueError("--baseline", str(args.baseline), "an existing file or folder",
                              f"--baseline {args.baseline}: no such file or folder (create "
                              "the golden with --update-baseline)")
    shard.check_merge([args.current])
    current = gate.read_results([args.current])
    sources = gate.baseline_paths(args.baseline, {r.env.device for r in current})
    shard.check_merge(sources)
    result = gate.compare(gate.read_results(sources), current, thresholds,
                          allow_unjudged=args.allow_unjudged)
    print(result.markdown())
    if args.update_baseline:
        for path in gate.write_baseline(current, args.baseline):
            print(f"baseline written: {path}")
        return int(ExitCode.CLEAN)
    if result.exit_code is ExitCode.NOTHING_COMPARABLE:
        read = ", ".join(map(str, sources)) or f"none for these devices under {args.baseline}"
        print(f"read: baseline {read}; current {args.current}", file=sys.stderr)
    return int(result.exit_code)


def cmd_list(args: argparse.Namespace) -> int:
    # Any device, even one this machine lacks: what each implementation declares for it
    # is worth seeing, and its availability there says why it cannot run here.
    rows = runner.list_adapters(entries(), args.device, args.cache_dir, args.timeout)
    if args.json:
        print(json.dumps([row.model_dump(mode="json") for row in rows], indent=2))
        return 0
    print(capability_matrix(rows))
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    missing = [str(p) for p in args.paths if not p.exists()]
    if missing:
        raise PagedValueError("paths", missing, "existing files or folders",
                              f"no such file or folder: {', '.join(missing)}")
    if args.output:
        writable_file(args.output, "--output")
    shard.check_merge(args.paths)
    lines = list(read_lines(args.paths))
    if args.format == "csv":
        text = report.csv_text(lines, args.baseline)
    elif args.format == "html":
        text = report.html(lines, baseline=args.baseline)
    else:
        text = report.markdown(lines, baseline=args.baseline)
    if args.output:
        write_output(args.output, text)
    else:
        print(text)
    if args.plots_dir:
        for section in report.sections(lines, args.baseline):
            prefix = "" if len(report.sections(lines, args.baseline)) == 1 else (
                re.sub(r"[^A-Za-z0-9]+", "-", section["title"]).strip("-")[:60] + "-")
            for path in plots.save(section["bench"], section["scores"], args.plots_dir, prefix):
                print(f"plot: {path}", file=sys.stderr)
    return 0


def cmd_schema(args: argparse.Namespace) -> int:
    print(json.dumps(json_schema(), indent=2, sort_keys=True))
    return 0


def capability_matrix(rows: list[ListingRow]) -> str:
    """Markdown table: implementations x (availability, version, library build and ISA
    paths with those this host cannot take, devices, dtypes, block sizes, head dims,
    modes, features), from ``pagedbench list`` rows."""
    def join(values: Any) -> str:
        if values is None:
            return "any"
        if not isinstance(values, list):
            return str(values)
        steps = {b - a for a, b in zip(values, values[1:])} if all(
            isinstance(v, int) for v in values) else set()
        if len(values) > 6 and len(steps) == 1:
            return f"{values[0]}..{values[-1]} step {steps.pop()}"
        return ", ".join(map(str, values)) or "-"

    def paths(row: ListingRow) -> str:
        # The library build and ISA paths an implementation names (impl_details), and
        # those this host cannot take.
        named = (row.details.get(key) for key in ("library", "cpu_isa", "isa", "isa_not_here"))
        return "; ".join(str(value) for value in named if value) or "-"

    def axes(row: ListingRow) -> dict[str, str]:
        caps = row.capabilities
        if caps is None:
            return {}
        return {
            "devices": join(caps.get("devices")),
            "dtypes": join(caps.get("dtypes")),
            "block sizes": join(caps.get("block_sizes")),
            "head dims": join(caps.get("head_dims")),
            "modes": join(caps.get("modes")),
            "features": join(caps.get("features")),
            "kv cache": join(caps.get("kv_cache_dtypes")),
            "NaN-safe tail": "yes" if caps.get("nan_safe_tail") else f"no ({STALE_TAIL_MARK})",
            "logits": ("float32" if caps.get("logits_precision", "float32") == "float32"
                       else f"case dtype ({CASE_LOGITS_MARK})"),
        }

    table = pd.DataFrame([
        {
            "implementation": row.name,
            "available": "yes" + (" (interp.)" if row.interpreted else "") if row.available
            else f"no: {row.reason}" if row.status == "unavailable"
            else f"{row.status}: {row.reason}",
            "version": row.version,
            "build, ISA paths": paths(row),
            **axes(row),
        }
        for row in rows
    ])
    return report.escape_frame(table.fillna("?")).to_markdown(index=False)


# pagedbench replay -------------------------------------------------------------------
def _replay_arguments(sub: argparse._SubParsersAction) -> None:
    replay_p = sub.add_parser(
        "replay", help="re-run one case through the conformance check, in a worker",
        description="Re-run one case (what a conformance failure message names, a result "
                    "line, or a regression case) through the conformance check in a "
                    "worker, as `pagedbench run` does, and show the verdict and figures.",
        epilog=exit_codes_help(), formatter_class=argparse.RawDescriptionHelpFormatter)
    replay_p.add_argument("case", type=Path, metavar="CASE.json",
                          help="a PagedCase as JSON, a whole result line, or a regression "
                               "case (suites/regressions/cases)")
    replay_p.add_argument("--impl", action="append", default=[], metavar="NAME",
                          help="implementation to run it on (repeatable; default: the one "
                               "a result line or regression case names)")
    replay_p.add_argument("--device", type=_device, default=None,
                          help="cpu (default), cuda or cuda:N; checked against this machine")
    replay_p.add_argument("--case-timeout", type=_positive_seconds, default=None,
                          metavar="SECONDS", help="the implementation's own time for the "
                          f"case (default: {runner.RunConfig.case_timeout_s:g})")
    cache_dir_argument(replay_p)
    replay_p.add_argument("--save", nargs="?", type=Path, const=True, default=None,
                          metavar="DIR",
                          help="keep the case as a regression case when an implementation "
                               "fails it: in DIR, or without DIR in the checkout's "
                               "suites/regressions/cases (an installed pagedbench needs DIR: "
                               "nothing is written into the installed package)")


def regression_folder(save: Path | bool) -> Path:
    """Where ``replay --save [DIR]`` keeps a failing case: ``DIR``, or (``save`` True:
    ``--save`` alone) the checkout's ``suites/regressions/cases`` when pagedbench runs
    from a checkout (its ``pyproject.toml`` beside the packages' folders).

    Raises
    ------
    PagedValueError
        ``--save`` without ``DIR`` from an installed pagedbench (whose folders must not
        be written), or a ``DIR`` that cannot be written.
    """
    if save is not True:
        writable_folder(save, "--save")
        return save
    if not (selftest.CHECKOUT / "pyproject.toml").is_file():
        raise PagedValueError("--save", None, "a folder (--save DIR)",
                              f"--save needs a folder: pagedbench is installed at "
                              f"{selftest.CHECKOUT}, not run from a checkout, and nothing is "
                              "written into an installed package")
    return selftest.REGRESSION_CASES


def _replay_lines(record: ResultRecord) -> list[str]:
    """A verdict and its figures, as ``pagedbench replay`` prints them."""
    head = f"{record.impl} on {record.case_id} ({record.device}): {record.status}"
    lines = [head + (f" in {record.step}" if record.step else "")]
    if record.reason:
        lines.append(f"  reason: {record.reason}")
    figures = {name: getattr(record, name) for name in COMPARISON_FIELDS}
    if figures.get("max_err_ulps") is not None:
        lines.append("  " + ", ".join(f"{name} {value:.4g}" if isinstance(value, float)
                                      else f"{name} {value}"
                                      for name, value in figures.items() if value is not None))
    if record.impl_details:
        lines.append(f"  details: {json.dumps(record.impl_details, sort_keys=True)}")
    return lines


def cmd_replay(args: argparse.Namespace) -> int:
    found = replay.load(args.case)
    names = args.impl or ([found.impl] if found.impl else [])
    selftest.register_catalogue_if_named(names)
    if not names:
        raise PagedValueError("--impl", None, "an implementation name",
                              f"--impl NAME is needed: {args.case} is a bare case and names "
                              "no implementation")
    impls = _select(names)
    device = _checked_device(args.device or "cpu")
    save = regression_folder(args.save) if args.save is not None else None
    case = found.case
    try:
        check_fits(case, device)
    except PagedInputError as exc:
        raise PagedValueError("CASE", str(args.case), exc.allowed, f"CASE {args.case}: {exc}") from None
    defaults = runner.RunConfig()
    config = runner.RunConfig(device=device, timing=False, cache_dir=args.cache_dir,
                              case_timeout_s=args.case_timeout or defaults.case_timeout_s,
                              suite="replay")
    env = Environment.model_validate(environment(device) | {"threads": config.threads})
    print(f"case {case.case_id}: {json.dumps(case.to_dict(), sort_keys=True)}")
    records: list[ResultRecord] = []
    run_id = new_run_id()
    for name, target in impls.items():
        runner.run_target(name, target, [case], config, run_id, env, records.append)
    for record in records:
        print("\n".join(_replay_lines(record)))
        if save is not None and record.status.failing:
            saved = replay.save_regression(case, record.impl, "pagedbench replay",
                                           record.reason, save, str(record.status))
            print(f"  saved: {saved}")
    return int(exit_code(r.status for r in records))


# pagedbench selftest -----------------------------------------------------------------
def _selftest_arguments(sub: argparse._SubParsersAction) -> None:
    selftest_p = sub.add_parser(
        "selftest", help="run the conformance suite on the fault catalogue",
        description="Run `pytest suites/conformance` on every fault of the catalogue "
                    "(suites/faults) and on its fault-free control; print which property "
                    "caught each fault, its shrunk case and the seconds it took. Exit 1 "
                    "when a fault is missed or the control fails.",
        epilog=exit_codes_help(), formatter_class=argparse.RawDescriptionHelpFormatter)
    selftest_p.add_argument("--hypothesis-profile", default="ci", metavar="NAME",
                            help="hypothesis profile of the run (default: ci)")
    selftest_p.add_argument("--catalogue", type=Path, default=selftest.DEFAULT_CATALOGUE,
                            help="folder of the catalogue's distribution metadata "
                                 f"(default: {selftest.DEFAULT_CATALOGUE})")
    selftest_p.add_argument("--output-dir", type=Path, default=default_cache_dir() / "selftest",
                            help="JUnit report, fault log and failing cases (default: "
                                 "selftest/ of the cache folder)")
    cache_dir_argument(selftest_p, "compiler and scratch caches")
    selftest_p.add_argument("--json", type=Path, metavar="FILE",
                            help="also write the rows as JSON here")
    selftest_p.add_argument("--first-catch", action="store_true",
                            help="pinned properties first, and stop checking a fault at "
                                 "the first property that fails on it (minutes, not tens "
                                 "of minutes; what make test runs)")
    selftest_p.add_argument("--save-regressions", action="store_true",
                            help="keep the case the search found for each fault in "
                                 f"{selftest.REGRESSION_CASES} (replacing its earlier one)")


def cmd_selftest(args: argparse.Namespace) -> int:
    if args.json:
        writable_file(args.json, "--json")
    try:
        rows = selftest.run(args.catalogue, args.output_dir, args.cache_dir,
                            args.hypothesis_profile, first_catch=args.first_catch)
    except RuntimeError as exc:
        print(f"pagedbench selftest: {exc}", file=sys.stderr)
        return int(ExitCode.HARNESS_FAULT)
    print(report.escape_frame(pd.DataFrame(selftest.table(rows))).to_markdown(index=False))
    if args.json:
        args.json.write_text(json.dumps([r.to_dict() for r in rows], indent=1) + "\n")
    if args.save_regressions:
        config = runner.RunConfig(timing=False, cache_dir=args.cache_dir, suite="selftest")
        for path in selftest.save_regressions(rows, selftest.REGRESSION_CASES, config):
            print(f"saved: {path}")
    caught = sum(r.verdict == "caught" for r in rows)
    faults = sum(r.name != selftest.CONTROL for r in rows)
    print(f"\n{caught} of {faults} faults caught ({args.hypothesis_profile} profile); "
          f"{sum(r.seconds for r in rows):.0f} s")
    return int(ExitCode.CLEAN if selftest.passed(rows) else ExitCode.CONFORMANCE_FAILURE)


def _writable_outputs(args: argparse.Namespace) -> None:
    """Check every output folder a command was given, before it runs."""
    for dest, option in (("results_dir", "--results-dir"), ("cache_dir", "--cache-dir"),
                         ("output_dir", "--output-dir"), ("plots_dir", "--plots-dir")):
        if getattr(args, dest, None) is not None:
            writable_folder(getattr(args, dest), option)


#: Commands that write nothing unless given an output (``--output``, ``--plots-dir``,
#: ``--update-baseline``): they create no cache folder, so they work in a read-only folder.
READ_ONLY_COMMANDS = frozenset({"schema", "report", "gate"})
#: ``errno`` values of a write the machine refused (full disk or quota, I/O error, file
#: too large, read-only file system): exit :attr:`ExitCode.WRITE_ERROR`, not a bug.
WRITE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EFBIG, errno.EROFS})


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``pagedbench`` console script; returns the exit code
    (:class:`~.status.ExitCode`; ``128 + N`` when stopped by signal N)."""
    args = _parser().parse_args(argv)
    commands = {"run": cmd_run, "bench": cmd_bench, "list": cmd_list, "report": cmd_report,
                "schema": cmd_schema, "simulate": simulate.run, "replay": cmd_replay,
                "selftest": cmd_selftest, "gate": cmd_gate}
    try:
        _writable_outputs(args)
        apply_environment(cache_environment(getattr(args, "cache_dir", default_cache_dir()),
                                            create=args.command not in READ_ONLY_COMMANDS))
        return commands[args.command](args)
    except PagedInputError as exc:
        print(f"pagedbench {args.command}: error: {exc}", file=sys.stderr)
        return int(ExitCode.USAGE_ERROR)
    except BrokenPipeError:  # e.g. `pagedbench report ... | head`: the reader left
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE
    except OutputError as exc:
        print(f"pagedbench {args.command}: error: {exc}", file=sys.stderr)
        return int(ExitCode.WRITE_ERROR)
    except Exception as exc:  # a bug of pagedbench's: say so, with where it happened
        if isinstance(exc, OSError) and exc.errno in WRITE_ERRNOS:  # a write elsewhere
            where = Path(exc.filename) if exc.filename else Path("an output file")
            print(f"pagedbench {args.command}: error: {OutputError.of(where, exc)}",
                  file=sys.stderr)
            return int(ExitCode.WRITE_ERROR)
        print(f"pagedbench {args.command}: internal error (a pagedbench bug; exit "
              f"{int(ExitCode.HARNESS_FAULT)}): {type(exc).__name__}: {exc}", file=sys.stderr)
        traceback.print_exc()
        return int(ExitCode.HARNESS_FAULT)


if __name__ == "__main__":
    sys.exit(main())
