"""``pagedbench run``'s options (its body: :mod:`.run`). Nothing heavy is imported here:
``pagedbench run --help`` and its usage errors answer without torch."""

from __future__ import annotations

import argparse

from pagedbench.reference import DTYPES

from pagedbench.harness.cases.presets import DEFAULT_BLOCK_SIZES, DEFAULT_DTYPES, MODEL_PRESETS
from pagedbench.harness.cli.options import (device_arg, int_in, positive_int, positive_seconds,
                                            run_and_bench_arguments, run_id_arg)
from pagedbench.harness.run.config import RunConfig
from pagedbench.harness.verdict.status import exit_codes_help


def add_parser(sub: argparse._SubParsersAction) -> None:
    """``pagedbench run`` and its options."""
    run_p = sub.add_parser("run", epilog=exit_codes_help(),
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    run_p.add_argument("--impl", action="append", default=[], metavar="NAME",
                       help="implementation to run (repeatable; default: all)")
    run_p.add_argument("--preset", action="append", default=[], choices=list(MODEL_PRESETS),
                       metavar="NAME", help=f"model preset (repeatable; default: all of {', '.join(MODEL_PRESETS)})")
    run_p.add_argument("--device", type=device_arg, default=None,
                       help="cpu (default), cuda or cuda:N; checked against this machine")
    run_p.add_argument("--block-size", action="append", type=positive_int, default=[],
                       help=f"block size (repeatable; default: {' '.join(map(str, DEFAULT_BLOCK_SIZES))}, "
                            "or the preset's own)")
    run_p.add_argument("--dtype", action="append", default=[], choices=list(DTYPES),
                       help=f"dtype (repeatable; default: {' '.join(DEFAULT_DTYPES)}, or the "
                            "preset's own)")
    run_p.add_argument("--no-timing", action="store_const", const=True, default=None,
                       help="check correctness only")
    run_p.add_argument("--repetitions", type=int_in(1, 100_000), default=None,
                       help="CPU timing samples per case, as the time limit of "
                            f"{RunConfig.time_limit_s:g} s allows (at least "
                            f"{RunConfig.time_budget_s:g} s of blocks of calls; "
                            f"default: {RunConfig.repetitions})")
    run_p.add_argument("--harness-timeout", type=positive_seconds, default=None,
                       metavar="SECONDS",
                       help="pagedbench's own time per case (truth and compare, in the "
                            "judging parent); past it: 'harness-error' (default: "
                            f"{RunConfig.harness_timeout_s:g})")
    run_p.add_argument("--resume", type=run_id_arg, metavar="RUN_ID",
                       help="finish the interrupted run RUN_ID of --results-dir with its "
                            "recorded selection, skipping the results it already has")
    run_and_bench_arguments(run_p, "case")
