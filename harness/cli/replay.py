"""``pagedbench replay`` (one case again, through the conformance check, in a worker)
and ``pagedbench selftest`` (the conformance suite against the fault catalogue); their
options: :mod:`.replay_options`."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pandas as pd
from rich.console import Console

from pagedbench.reference import PagedInputError, PagedValueError, check_fits

from pagedbench.harness.cli.loop import is_trace, replay_trace
from pagedbench.harness.cli.options import (checked_device, select_impls, writable_file,
                                            writable_folder)
from pagedbench.harness.results import report
from pagedbench.harness.results.record import COMPARISON_FIELDS, Environment, ResultRecord
from pagedbench.harness.results.store import environment, new_run_id
from pagedbench.harness.run import replay, runner, selftest
from pagedbench.harness.run.config import CHECKOUT, REGRESSION_CASES
from pagedbench.harness.verdict.status import ExitCode, exit_code


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
    if not (CHECKOUT / "pyproject.toml").is_file():
        raise PagedValueError("--save", None, "a folder (--save DIR)",
                              f"--save needs a folder: pagedbench is installed at "
                              f"{CHECKOUT}, not run from a checkout, and nothing is "
                              "written into an installed package")
    return REGRESSION_CASES


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
    if is_trace(args.case):
        return _replay_trace(args)
    found = replay.load(args.case)
    names = args.impl or ([found.impl] if found.impl else [])
    selftest.register_catalogue_if_named(names)
    if not names:
        raise PagedValueError("--impl", None, "an implementation name",
                              f"--impl NAME is needed: {args.case} is a bare case and names "
                              "no implementation")
    impls = select_impls(names)
    device = checked_device(args.device or "cpu")
    save = regression_folder(args.save) if args.save is not None else None
    case = found.case
    try:
        check_fits(case, device)
    except PagedInputError as exc:
        raise PagedValueError("CASE", str(args.case), exc.allowed, f"CASE {args.case}: {exc}") from None
    defaults = runner.RunConfig()
    config = runner.RunConfig(device=device, timing=args.timed, cache_dir=args.cache_dir,
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


def _replay_trace(args: argparse.Namespace) -> int:
    """``pagedbench replay TRACE --impl NAME``: the serving loop of a saved trace."""
    if not args.impl:
        raise PagedValueError("--impl", None, "an implementation name",
                              f"--impl NAME is needed: {args.case} is a loop trace")
    selftest.register_catalogue_if_named(args.impl)
    device = checked_device(args.device or "cpu")
    defaults = runner.RunConfig()
    config = runner.RunConfig(device=device, timing=False, cache_dir=args.cache_dir,
                              case_timeout_s=args.case_timeout or defaults.case_timeout_s,
                              suite="loop")
    console = Console(highlight=False, soft_wrap=True)
    codes = [replay_trace(args.case, name, target, config, console)
             for name, target in select_impls(args.impl).items()]
    return max(codes)


# pagedbench selftest -----------------------------------------------------------------
def cmd_selftest(args: argparse.Namespace) -> int:
    if args.json:
        writable_file(args.json, "--json")
    try:
        rows = selftest.run(args.catalogue, args.output_dir, args.cache_dir,
                            args.hypothesis_profile, first_catch=args.first_catch,
                            search_seconds=args.search_seconds)
    except RuntimeError as exc:
        print(f"pagedbench selftest: {exc}", file=sys.stderr)
        return int(ExitCode.HARNESS_FAULT)
    print(report.escape_frame(pd.DataFrame(selftest.table(rows))).to_markdown(index=False))
    if args.json:
        args.json.write_text(json.dumps([r.to_dict() for r in rows], indent=1) + "\n")
    if args.save_regressions:
        config = runner.RunConfig(timing=False, cache_dir=args.cache_dir, suite="selftest")
        for path in selftest.save_regressions(rows, REGRESSION_CASES, config):
            print(f"saved: {path}")
    faults = [r for r in rows if r.name != selftest.CONTROL]
    print(f"\n{sum(map(selftest.caught, faults))} of {len(faults)} faults caught "
          f"({sum(r.verdict == 'caught' for r in faults)} by the per-call suite, "
          f"{sum(r.loop_verdict == 'caught' for r in faults)} by the serving loop; "
          f"{args.hypothesis_profile} profile); {sum(r.seconds for r in rows):.0f} s")
    return int(ExitCode.CLEAN if selftest.passed(rows) else ExitCode.CONFORMANCE_FAILURE)
