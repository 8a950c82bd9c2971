"""The options of the commands that read results: ``pagedbench report``, ``schema`` and
``gate`` (their bodies: :mod:`.results`). Nothing heavy is imported here: their ``--help``
and usage errors answer without pandas or torch."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from pagedbench.harness.cases.workloads import DEFAULT_BASELINE
from pagedbench.harness.cli.options import fraction, int_in
from pagedbench.harness.gate import baselines
from pagedbench.harness.measure.speed import Thresholds
from pagedbench.harness.verdict.status import GATE_EXIT_MEANING, exit_codes_help


def add_report_parser(sub: argparse._SubParsersAction) -> None:
    """``pagedbench report`` and its options."""
    report_p = sub.add_parser("report")
    report_p.add_argument("paths", nargs="+", type=Path,
                          help=".jsonl result files or folders of them (merged in order)")
    report_p.add_argument("--format", choices=["md", "csv", "html", "site"], default="md",
                          help="md: leaderboard + summary (+ bench tables); csv: one row per "
                               "result with derived figures; html: one standalone page "
                               "(board, plots, tables); site: a folder (--output DIR) of "
                               "index.html and one such page per device and environment")
    report_p.add_argument("--baseline", "--baseline-impl", dest="baseline", metavar="NAME",
                          help="implementation speedups are measured against, one of the "
                               f"results' (default: {DEFAULT_BASELINE}, where it ran)")
    report_p.add_argument("--output", type=Path, help="write here instead of stdout (a "
                          "folder with --format site)")
    report_p.add_argument("--plots-dir", type=Path, default=None, metavar="DIR",
                          help="also write the bench plots there as PNG files")


def add_schema_parser(sub: argparse._SubParsersAction) -> None:
    """``pagedbench schema`` (no options)."""
    sub.add_parser("schema")


def add_gate_parser(sub: argparse._SubParsersAction) -> None:
    """``pagedbench gate`` and its options."""
    gate_p = sub.add_parser("gate", epilog=exit_codes_help(GATE_EXIT_MEANING),
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    defaults = Thresholds()
    gate_p.add_argument("--baseline", type=Path, required=True, metavar="FILE_OR_DIR",
                        help="the golden: a .jsonl file, a folder of them, or a folder of "
                             f"device folders such as {baselines.BASELINES_DIR} (the folder of "
                             "each current device is read)")
    gate_p.add_argument("--current", type=Path, required=True, metavar="FILE_OR_DIR",
                        help="the results to judge: a .jsonl file or a folder of them")
    gate_p.add_argument("--alpha", type=fraction(0, 1), default=defaults.alpha,
                        help="family-wise significance level of the U tests "
                             f"(default: {defaults.alpha:g})")
    gate_p.add_argument("--min-effect", type=fraction(0, math.inf),
                        default=defaults.min_effect, metavar="FRACTION",
                        help="smallest change of the median that counts, e.g. 0.1 for 10%% "
                             f"(default: {defaults.min_effect:g})")
    gate_p.add_argument("--min-samples", type=int_in(2, 2**31), default=defaults.min_samples,
                        metavar="N", help="fewest samples on either side that are judged "
                        f"(default: {defaults.min_samples})")
    gate_p.add_argument("--raw", action="store_true",
                        help="judge raw ms, not each CPU sample divided by the drift probe "
                             "timed after it (which cancels a shared machine's drift)")
    gate_p.add_argument("--allow-unjudged", action="store_true",
                        help="exit 0, not 7, when no point regressed but some could not be "
                             "judged (too noisy, timed on one side only, or in only one of "
                             "baseline and current); the last line still counts them")
    gate_p.add_argument("--output", type=Path, default=None, metavar="FILE",
                        help="also write the full report (Markdown: every point that moved or "
                             "was too noisy, with its figures) there; the terminal gets a "
                             "summary")
    gate_p.add_argument("--update-baseline", action="store_true",
                        help="after comparing, write the current results as the new golden "
                             "(--baseline's file, or <folder>/<device>/"
                             f"{baselines.BASELINE_FILE}) and exit 0")
