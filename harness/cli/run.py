"""``pagedbench run``: check and time implementations on model-preset cases (``--resume
RUN_ID`` finishes an interrupted run); what ``run`` and ``bench`` share (sharding, the
device's peaks, the oversubscription warning, an interrupted run's message). Its options:
:mod:`.run_options`."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rich.console import Console
from rich.markup import escape as rich_escape

from pagedbench.adapters import entries
from pagedbench.reference import PagedInputError, PagedValueError, check_fits

from pagedbench.harness.cases.presets import default_cases
from pagedbench.harness.cli.options import (checked_device, existing_file, select_impls,
                                            writable_file, writable_folder)
from pagedbench.harness.measure.timing import oversubscribed
from pagedbench.harness.results import report
from pagedbench.harness.results.junit import write_junit_xml
from pagedbench.harness.results import shard
from pagedbench.harness.results.record import DevicePeaks, Plan, ResultRecord, RunRecord, Shard
from pagedbench.harness.results.store import (ResultsFile, ResultsFileError, new_run_id,
                                              results_of, run_states, write_output)
from pagedbench.harness.run import runner
from pagedbench.harness.run.progress import RunProgress
from pagedbench.harness.run.summary import print_summary, terminal
from pagedbench.harness.verdict.status import ExitCode, exit_code


def _finish(records: list[ResultRecord], lines: list, results: ResultsFile,
            console: Console, device: str, run_id: str) -> int:
    """Write the full report of a run, print its summary; its exit code."""
    text = report.markdown(lines, title=f"pagedbench leaderboard ({device})")
    md_path = results.path.with_suffix(".md")
    write_output(md_path, text)
    print_summary(console, records, f"pagedbench run {run_id} ({device})",
                  files=[("results", results.path), ("report", md_path)])
    code = exit_code(r.status for r in records)
    failing = sorted({r.impl for r in records if r.status.failing})
    if code is ExitCode.CONFORMANCE_FAILURE:
        console.print(f"[red]conformance failures in: {rich_escape(', '.join(failing))}[/]")
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
                                      ("--shard", args.shard),
                                      ("--devices", args.devices)) if value]
    if given:
        raise PagedValueError("--resume", given,
                              "only --results-dir, --cache-dir, --junit-xml, the peaks "
                              "options and --balance-from beside it",
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


def interrupted(exc: runner.Interrupted, console: Console, run_id: str, results: ResultsFile,
                 results_dir: Path) -> int:
    """Say how to finish an interrupted run; its exit code (128 + the signal)."""
    console.print(f"[yellow]{exc}: the results so far are in {results.path}; finish the "
                  f"run with: pagedbench run --resume {run_id} --results-dir {results_dir}[/]")
    return 128 + exc.signum


def cmd_run(args: argparse.Namespace) -> int:
    existing_file(args.peaks, "--peaks")
    writable_folder(args.results_dir, "--results-dir")
    if args.junit_xml is not None:
        writable_file(args.junit_xml, "--junit-xml")
    console = terminal(soft_wrap=True)
    if args.resume:
        plan, config, results = _resume_target(args)
        checked_device(config.device, config.devices)
        run_id = args.resume
        state = run_states(results.lines())[run_id]
        if state.finished is not None and state.results >= state.planned:
            console.print(f"run {run_id} already finished ({state.results} results); "
                          "nothing to resume")
    else:
        device = checked_device(args.device or "cpu", args.devices)
        impls = select_impls(args.impl)
        cases = default_cases(list(dict.fromkeys(args.preset)) or None,
                              tuple(dict.fromkeys(args.block_size)) or None,
                              tuple(dict.fromkeys(args.dtype)) or None)
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
            harness_timeout_s=args.harness_timeout or defaults.harness_timeout_s,
            devices=args.devices or "")
        plan = runner.make_plan(impls, cases)
        run_id = new_run_id()
        results = ResultsFile(args.results_dir / f"{run_id}.jsonl")
    part, pairs = shard_of(args, plan, results, run_id, console)
    warn_oversubscribed(config, console)
    with results.locked():  # one writer per run: a second resume is refused
        impls, cases = len(plan.impls), len(plan.cases)
        console.print(f"pagedbench run {run_id}: {impls} implementation{'s' * (impls != 1)} x "
                      f"{cases} case{'s' * (cases != 1)} on {config.device} -> {results.path}")
        peaks = device_peaks(args, config, console)
        earlier = results_of_run(results, run_id) if args.resume else []
        order = runner.missing(plan, earlier)
        order = order if pairs is None else [p for p in order if p in pairs]
        with RunProgress(console, "run", order, earlier) as progress:
            try:
                records = runner.run(plan, config, results, run_id, resume=bool(args.resume),
                                     on_record=progress.update,
                                     peaks=peaks, shard=part, pairs=pairs)
            except runner.Interrupted as exc:
                if args.junit_xml is not None:
                    write_junit_xml(results_of_run(results, run_id), args.junit_xml,
                                    f"pagedbench run {run_id} (interrupted)", progress.seconds)
                return interrupted(exc, console, run_id, results, args.results_dir)
        lines = [line for line in results.lines() if line.run_id == run_id]
        if args.junit_xml is not None:
            write_junit_xml(records, args.junit_xml, f"pagedbench run {run_id}",
                            progress.seconds)
            console.print(f"JUnit XML: {args.junit_xml}")
        return _finish(records, lines, results, console, config.device, run_id)


def check_balance_from(args: argparse.Namespace) -> None:
    """Refuse ``--balance-from`` without ``--shard`` (but for ``run --resume``, which
    rebalances as the run was), before anything is planned: a dry run refuses it too (it
    reads no input file, which may be written later: the GPU lane's ``--peaks``).

    Raises
    ------
    PagedValueError
        Naming ``--balance-from``.
    """
    if args.balance_from is not None and args.shard is None and not getattr(
            args, "resume", None):
        raise PagedValueError("--balance-from", str(args.balance_from), "with --shard",
                              "--balance-from balances the parts of --shard: give both")


def shard_of(args: argparse.Namespace, plan: Plan, results: ResultsFile, run_id: str,
             console: Console) -> tuple[Shard | None, set[tuple[str, str]] | None]:
    """``--shard``'s record and pairs of ``plan``, balanced by ``--balance-from``'s
    seconds where given (a resumed run's: those it recorded); ``(None, None)`` for the
    whole plan.

    Raises
    ------
    PagedValueError
        ``--balance-from`` without ``--shard``, or results that cannot be read.
    """
    seconds = None
    if args.balance_from is not None:
        check_balance_from(args)
        existing_file(args.balance_from, "--balance-from", folder_too=True)
        seconds = shard.measured_seconds([args.balance_from])
    if getattr(args, "resume", None):  # run --resume (bench has none)
        return None, shard.recorded_pairs(plan, results.lines(), run_id, seconds)
    if args.shard is None:
        return None, None
    part = shard.shard_record(plan, args.shard, seconds)
    pairs = shard.pairs_of(plan, args.shard, seconds)
    how = ("bytes moved" if part.balance is None else
           f"the seconds measured in {args.balance_from}")
    console.print(f"shard {args.shard} of plan {part.plan_sha256[:12]}, balanced by {how}: "
                  f"{len(pairs)} of {plan.size} (implementation, point) pairs")
    return part, pairs


def peaks_file(path: Path) -> DevicePeaks:
    """The device peaks in ``path`` (``--peaks``): a JSON object of
    :class:`~pagedbench.harness.results.record.DevicePeaks`, at its top or under ``"peaks"``.

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


def device_peaks(args: argparse.Namespace, config: runner.RunConfig,
                 console: Console) -> DevicePeaks | None:
    """The device's peaks for a timed run or bench (the fractions of peak, the roofline
    and the physical floor: ``harness/results/floor.py``): read from ``--peaks FILE``,
    else measured in a worker (:func:`~pagedbench.harness.run.runner.device_peaks`), said
    on ``console``; None with ``--no-peaks``, without timing, or when the measurement
    failed (then said why)."""
    if args.peaks is not None:
        peaks = peaks_file(args.peaks)
        console.print(f"device peaks from {args.peaks}: {_peaks_text(peaks)}")
        return peaks
    if args.no_peaks or not config.timing:
        return None
    peaks, why = runner.device_peaks(config)
    console.print(f"device peaks: {_peaks_text(peaks)}" if peaks
                  else f"[yellow]device peaks not measured: {rich_escape(why)}[/]")
    return peaks


def _peaks_text(peaks: DevicePeaks) -> str:
    cached = ("" if peaks.cache_copy_gbps is None
              else f", {peaks.cache_copy_gbps:.1f} GB/s copy in cache")
    return (f"{peaks.copy_gbps:.1f} GB/s copy{cached}, {peaks.bf16_tflops:.3g} TFLOP/s bf16 "
            "matmul")


def warn_oversubscribed(config: runner.RunConfig, console: Console) -> None:
    """Warn when a CPU timing's threads oversubscribe the host
    (:func:`~pagedbench.harness.measure.timing.oversubscribed`)."""
    workers = int(config.devices[4:]) if config.devices.startswith("cpu:") else 1
    warning = (oversubscribed(config.threads * workers, workers=workers)
               if config.device == "cpu" and config.timing else "")
    if warning:
        console.print(f"[yellow]warning: {rich_escape(warning)}[/]")


def results_of_run(results: ResultsFile, run_id: str) -> list[ResultRecord]:
    """The results ``results`` holds for ``run_id``."""
    return [r for r in results_of(results.lines()) if r.run_id == run_id]
