"""``pagedbench simulate`` and ``pagedbench tune``: their parsers (the bodies and options
are :mod:`pagedbench.harness.capacity.simulate` and :mod:`~pagedbench.harness.capacity.tune`,
whose options import nothing heavy)."""

from __future__ import annotations

import argparse

from pagedbench.harness.capacity import simulate, tune
from pagedbench.harness.cli.options import cache_dir_argument
from pagedbench.harness.verdict.status import exit_codes_help


def add_simulate_parser(sub: argparse._SubParsersAction) -> None:
    """``pagedbench simulate`` and its options."""
    simulate.add_arguments(sub.add_parser("simulate"))


def add_tune_parser(sub: argparse._SubParsersAction) -> None:
    """``pagedbench tune`` and its options."""
    tune_parser = sub.add_parser("tune", description=tune.__doc__.split("\n\n")[0],
                                 epilog=exit_codes_help(),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    tune.add_arguments(tune_parser)
    cache_dir_argument(tune_parser)
