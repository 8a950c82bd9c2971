"""``pagedbench list``'s options (its body: :mod:`.listing`). Nothing heavy is imported
here: ``pagedbench list --help`` and its usage errors answer without torch."""

from __future__ import annotations

import argparse

from pagedbench.harness.cli.options import cache_dir_argument, device_arg, positive_seconds
from pagedbench.harness.run.config import LIST_TIMEOUT_S


def add_parser(sub: argparse._SubParsersAction) -> None:
    """``pagedbench list`` and its options."""
    list_p = sub.add_parser("list")
    list_p.add_argument("names", nargs="*", metavar="NAME",
                        help="show what these implementations declare, one block each")
    list_p.add_argument("--device", type=device_arg, default="cpu",
                        help="device to check availability on: cpu, cuda or cuda:N")
    list_p.add_argument("--wide", action="store_true",
                        help="every implementation's declarations in one Markdown table "
                             "(devices, dtypes, block sizes, head dims, modes, features, ...)")
    list_p.add_argument("--json", action="store_true", help="machine-readable output")
    list_p.add_argument("--timeout", type=positive_seconds, default=LIST_TIMEOUT_S,
                        metavar="SECONDS", help="each implementation's time to import and "
                        f"answer; past it: 'timeout' (default: {LIST_TIMEOUT_S:g})")
    cache_dir_argument(list_p, "compiler and scratch caches of the workers that answer")
