"""``pagedbench loop``'s options (its body: :mod:`.loop`). Nothing heavy is imported here:
``pagedbench loop --help`` and its usage errors answer without torch."""

from __future__ import annotations

import argparse
from pathlib import Path

from pagedbench.reference.axes import DTYPES, FP8_SCALES, KV_CACHE_DTYPES

from pagedbench.harness.cases.presets import MODEL_PRESETS
from pagedbench.harness.cli.options import (cache_dir_argument, device_arg, int_in, positive_int,
                                            positive_seconds)
from pagedbench.harness.run.config import RunConfig
from pagedbench.harness.verdict.status import exit_codes_help

#: The loop's shape when no preset is named: small enough for an interpreted kernel.
DEFAULT_HEADS, DEFAULT_HEAD_DIM = (8, 2), 64


def add_parser(sub: argparse._SubParsersAction) -> None:
    """``pagedbench loop`` and its options."""
    p = sub.add_parser(
        "loop", description="Drive one implementation through a serving loop: the reference "
                    "allocator admits requests (half sharing a cached prompt prefix), "
                    "prefills them in chunks beside decodes, forks, finishes, preempts and "
                    "swaps them, on one persistent pool whose freed blocks keep their K/V; "
                    "every step's output is judged against the float64 truth. A failing "
                    "loop's trace is saved; `pagedbench replay TRACE --impl NAME` reruns it.",
        epilog=exit_codes_help(), formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--impl", required=True, metavar="NAME", help="the implementation")
    p.add_argument("--steps", type=int_in(1, 100_000), default=50,
                   help="forward steps (default: 50)")
    p.add_argument("--seed", type=int_in(0, 2**31 - 1), default=0,
                   help="seeds the scheduler and the values (default: 0)")
    p.add_argument("--trace", type=Path, metavar="FILE",
                   help="replay this trace's events instead of scheduling")
    p.add_argument("--preset", choices=list(MODEL_PRESETS), metavar="NAME",
                   help=f"model shape (heads, head dim; one of {', '.join(MODEL_PRESETS)}); "
                        f"default: {DEFAULT_HEADS[0]}/{DEFAULT_HEADS[1]} heads of "
                        f"{DEFAULT_HEAD_DIM}")
    p.add_argument("--block-size", type=positive_int, default=16, help="default: 16")
    p.add_argument("--dtype", choices=list(DTYPES), default="bfloat16",
                   help="default: bfloat16")
    p.add_argument("--kv-cache-dtype", choices=list(KV_CACHE_DTYPES),
                   default="auto", help="default: auto (the dtype's); fp8 takes k_scale "
                                        f"{FP8_SCALES[0][0]} and v_scale {FP8_SCALES[0][1]}")
    p.add_argument("--num-blocks", type=int_in(2, 1 << 20), default=48,
                   help="blocks the allocator hands out (default: 48)")
    p.add_argument("--max-batch", type=int_in(1, 4096), default=8, help="default: 8")
    p.add_argument("--max-tokens", type=int_in(1, 1 << 20), default=160,
                   help="longest sequence (default: 160)")
    p.add_argument("--device", type=device_arg, default=None,
                   help="cpu (default), cuda or cuda:N; checked against this machine")
    p.add_argument("--case-timeout", type=positive_seconds, default=None, metavar="SECONDS",
                   help="the implementation's own time per step (default: "
                        f"{RunConfig.case_timeout_s:g})")
    cache_dir_argument(p)
