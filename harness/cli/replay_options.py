"""The options of ``pagedbench replay`` and ``pagedbench selftest`` (their bodies:
:mod:`.replay`). Nothing heavy is imported here: their ``--help`` and usage errors answer
without torch."""

from __future__ import annotations

import argparse
from pathlib import Path

from pagedbench.harness.cli.options import cache_dir_argument, device_arg, positive_seconds
from pagedbench.harness.run.config import DEFAULT_CATALOGUE, REGRESSION_CASES, RunConfig
from pagedbench.harness.run.environment import default_cache_dir
from pagedbench.harness.verdict.status import exit_codes_help


def add_replay_parser(sub: argparse._SubParsersAction) -> None:
    """``pagedbench replay`` and its options."""
    replay_p = sub.add_parser(
        "replay", description="Re-run one case (what a conformance failure message names, a result "
                    "line, or a regression case) through the conformance check in a "
                    "worker, as `pagedbench run` does, and show the verdict and figures.",
        epilog=exit_codes_help(), formatter_class=argparse.RawDescriptionHelpFormatter)
    replay_p.add_argument("case", type=Path, metavar="CASE.json",
                          help="a PagedCase as JSON, a whole result line, a regression "
                               "case (suites/regressions/cases), or a serving loop's trace "
                               "(.jsonl, from pagedbench loop or suites/serving)")
    replay_p.add_argument("--impl", action="append", default=[], metavar="NAME",
                          help="implementation to run it on (repeatable; default: the one "
                               "a result line or regression case names)")
    replay_p.add_argument("--device", type=device_arg, default=None,
                          help="cpu (default), cuda or cuda:N; checked against this machine")
    replay_p.add_argument("--case-timeout", type=positive_seconds, default=None,
                          metavar="SECONDS", help="the implementation's own time for the "
                          f"case (default: {RunConfig.case_timeout_s:g})")
    replay_p.add_argument("--timed", action="store_true",
                          help="time it as pagedbench run does, new inputs written before "
                               "timed calls and those calls' outputs judged (what step "
                               "'timing' failed on)")
    cache_dir_argument(replay_p)
    replay_p.add_argument("--save", nargs="?", type=Path, const=True, default=None,
                          metavar="DIR",
                          help="keep the case as a regression case when an implementation "
                               "fails it: in DIR, or without DIR in the checkout's "
                               "suites/regressions/cases (an installed pagedbench needs DIR: "
                               "nothing is written into the installed package)")


def add_selftest_parser(sub: argparse._SubParsersAction) -> None:
    """``pagedbench selftest`` and its options."""
    selftest_p = sub.add_parser(
        "selftest", description="Run `pytest suites/conformance` on every fault of the catalogue "
                    "(suites/faults) and on its fault-free control; print which property "
                    "caught each fault, its shrunk case and the seconds it took. Exit 1 "
                    "when a fault is missed or the control fails.",
        epilog=exit_codes_help(), formatter_class=argparse.RawDescriptionHelpFormatter)
    selftest_p.add_argument("--hypothesis-profile", default="ci", metavar="NAME",
                            help="hypothesis profile of the run (default: ci)")
    selftest_p.add_argument("--catalogue", type=Path, default=DEFAULT_CATALOGUE,
                            help="folder of the catalogue's distribution metadata "
                                 f"(default: {DEFAULT_CATALOGUE})")
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
    selftest_p.add_argument("--search-seconds", type=positive_seconds, metavar="S",
                            help="seconds of search per implementation (default: the "
                                 "profile's; make test passes its own)")
    selftest_p.add_argument("--save-regressions", action="store_true",
                            help="keep the case the search found for each fault in "
                                 f"{REGRESSION_CASES} (replacing its earlier one)")
