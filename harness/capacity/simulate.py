"""``pagedbench simulate``: the KV capacity simulator from the command line.

Replays one request trace under the contiguous policies (``Max``, ``Pow2``, ``Oracle``)
and paged allocation at several block sizes (:mod:`pagedbench.reference.simulator`); when
the trace shares prefixes or samples, also block-hash prefix caching (``Paged+share``) at
those block sizes and SGLang's radix tree (``Radix``) at ``--radix-page-sizes``. Prints
the policy table (pandas), and writes a plot (matplotlib, PNG): the share of reserved KV
memory holding tokens per policy, and concurrency against block size
(:mod:`~pagedbench.harness.capacity.simulate_output`, imported by :func:`run`: the
options are read without pandas or torch). ``--trace-kind``
draws a trace with shared prefixes (:mod:`~pagedbench.harness.capacity.prefix_traces`).

With no arguments: preset ``llama3.1-8b`` (128 KiB of K/V per token in bfloat16), a
4 GiB KV budget (32768 token slots), ``max_context`` 2048, 1000 requests drawn with
seed 0 from :func:`~pagedbench.harness.capacity.traces.generate_trace`'s distribution, all
queued at step 0; the plot goes to ``results/simulate/capacity.png`` and the table to
``results/simulate/policies.csv``. ``--emit-batches FILE`` also writes every decode step's
kernel batch for ``pagedbench bench --trace`` (:mod:`~pagedbench.harness.capacity.batches`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path

from pagedbench.harness.capacity.prefix_traces import TRACE_KINDS
from pagedbench.harness.capacity.traces import generate_trace, read_trace
from pagedbench.harness.cases.presets import MODEL_PRESETS
from pagedbench.reference.kv_policies import (
    PAGED_BLOCK_SIZES,
    RADIX_PAGE_SIZES,
    CapacityError,
    default_policies,
)
from pagedbench.reference.simulator import budget_tokens_from_bytes, compare_policies
from pagedbench.reference.workload import DEFAULT_MAX_CONTEXT, Request, TraceError, shares

DEFAULT_PRESET = "llama3.1-8b"
DEFAULT_KV_BUDGET_GIB = 4.0
DEFAULT_NUM_REQUESTS = 1000
DEFAULT_OUTPUT_DIR = Path("results/simulate")
PLOT_NAME = "capacity.png"
TABLE_NAME = "policies.csv"
#: Tokens per block of ``--kv-budget-blocks`` (vLLM's default block_size; Kwon et al. 7.2).
BUDGET_BLOCK_SIZE = 16
#: Bytes per K/V element for ``--kv-cache-dtype``.
KV_CACHE_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "fp8": 1}
_GIB = 2**30

def block_sizes(text: str) -> tuple[int, ...]:
    """``--block-sizes``: comma-separated integers >= 1, in the order given, each once;
    ``argparse.ArgumentTypeError`` naming the option otherwise."""
    try:
        sizes = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--block-sizes must be comma-separated integers >= 1, e.g. 16,32; got {text!r}"
        ) from None
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"--block-sizes must all be >= 1, got {text!r}")
    return tuple(dict.fromkeys(sizes))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``simulate`` options to ``parser`` (see the module docstring for defaults).

    Parameters
    ----------
    parser : argparse.ArgumentParser
        The ``simulate`` subcommand's parser.
    """
    model = parser.add_argument_group("model and memory")
    model.add_argument(
        "--preset", default=DEFAULT_PRESET, choices=list(MODEL_PRESETS),
        help=f"model whose KV bytes per token set the budget in tokens (default {DEFAULT_PRESET})",
    )
    model.add_argument(
        "--kv-cache-dtype", default="bfloat16", choices=list(KV_CACHE_DTYPE_BYTES),
        help="K/V element type (default bfloat16: 2 bytes)",
    )
    budget = model.add_mutually_exclusive_group()
    budget.add_argument(
        "--kv-budget-gib", type=float, default=None, metavar="GIB",
        help=f"KV memory for all policies, GiB (default {DEFAULT_KV_BUDGET_GIB:g})",
    )
    budget.add_argument(
        "--kv-budget-blocks", type=int, default=None, metavar="BLOCKS",
        help=f"KV memory as blocks of {BUDGET_BLOCK_SIZE} tokens, the same memory for every "
        f"policy (a paged policy at block_size B gets BLOCKS*{BUDGET_BLOCK_SIZE}//B blocks)",
    )
    model.add_argument(
        "--max-context", type=int, default=DEFAULT_MAX_CONTEXT, metavar="TOKENS",
        help=f"longest prompt+output; Max reserves it per sequence (default {DEFAULT_MAX_CONTEXT})",
    )
    trace = parser.add_argument_group("request trace")
    trace.add_argument(
        "--trace", type=Path, default=None, metavar="FILE",
        help="CSV or JSONL with columns prompt_len, output_len and optional arrival (step), "
        "prefix_id, prefix_len, n; default: a generated trace",
    )
    trace.add_argument(
        "--trace-kind", default="mixed", choices=list(TRACE_KINDS),
        help="generated trace: mixed (independent requests, default), multi-turn (chat "
        "sessions), agent (tool-calling loops) or few-shot (batches over shared prompts)",
    )
    trace.add_argument(
        "--num-requests", type=int, default=DEFAULT_NUM_REQUESTS,
        help=f"requests in the generated trace (default {DEFAULT_NUM_REQUESTS})",
    )
    trace.add_argument(
        "--seed", type=int, default=0, help="seed of the generated trace (default 0)"
    )
    trace.add_argument(
        "--arrival-rate", type=float, default=None, metavar="REQ_PER_STEP",
        help="Poisson arrivals per step for the generated trace (default: all at step 0)",
    )
    trace.add_argument(
        "--parallel-samples", type=int, default=1, metavar="N",
        help="samples per request (n) in the generated trace (default 1)",
    )
    trace.add_argument(
        "--prefix-share", type=float, default=0.0, metavar="FRACTION",
        help="fraction of generated requests starting with one of 4 shared prefixes of "
        "max_context/8 tokens (default 0)",
    )
    out = parser.add_argument_group("policies and output")
    out.add_argument(
        "--block-sizes", type=block_sizes, default=PAGED_BLOCK_SIZES, metavar="LIST",
        help="paged block sizes, comma-separated (default "
        + ",".join(map(str, PAGED_BLOCK_SIZES)) + ")",
    )
    out.add_argument(
        "--radix-page-sizes", type=block_sizes, default=RADIX_PAGE_SIZES, metavar="LIST",
        help="page sizes of the Radix policy (SGLang's page_size), comma-separated (default "
        + ",".join(map(str, RADIX_PAGE_SIZES)) + ")",
    )
    out.add_argument(
        "--output-dir", type=Path, default=DEFAULT_OUTPUT_DIR, metavar="DIR",
        help=f"where the plot ({PLOT_NAME}) and table ({TABLE_NAME}) go "
        f"(default {DEFAULT_OUTPUT_DIR}/)",
    )
    out.add_argument(
        "--json", action="store_true",
        help="print the table as JSON records instead of text (the files are still written)",
    )
    out.add_argument(
        "--emit-batches", type=Path, default=None, metavar="FILE",
        help="also write the kernel batch of every decode step, paged at the first "
        "--block-sizes value, one JSON line each: pagedbench bench --trace FILE times them",
    )


def _budget_tokens(args: argparse.Namespace) -> tuple[int, int]:
    """``(kv_budget_tokens, kv_bytes_per_token)`` from the budget options."""
    preset = MODEL_PRESETS[args.preset]
    per_token = preset.kv_bytes_per_token(KV_CACHE_DTYPE_BYTES[args.kv_cache_dtype])
    if args.kv_budget_blocks is not None:
        if args.kv_budget_blocks < 1:
            raise ValueError(f"--kv-budget-blocks must be >= 1, got {args.kv_budget_blocks}")
        return args.kv_budget_blocks * BUDGET_BLOCK_SIZE, per_token
    gib = DEFAULT_KV_BUDGET_GIB if args.kv_budget_gib is None else args.kv_budget_gib
    if not (math.isfinite(gib) and gib > 0):
        raise ValueError(f"--kv-budget-gib must be a finite number > 0, got {gib}")
    return budget_tokens_from_bytes(int(gib * _GIB), per_token), per_token


def _load_trace(args: argparse.Namespace) -> list[Request]:
    mixed_only = {
        "--parallel-samples": args.parallel_samples != 1,
        "--prefix-share": args.prefix_share != 0.0,
        "--arrival-rate": args.arrival_rate is not None,
    }
    if args.trace is None and args.trace_kind != "mixed":
        given = [name for name, set_ in mixed_only.items() if set_]
        if given:
            raise ValueError(f"{', '.join(given)} shape(s) the mixed trace only, not "
                             f"--trace-kind {args.trace_kind}")
        return TRACE_KINDS[args.trace_kind](args.num_requests, args.max_context, args.seed)
    if args.trace is None:
        return generate_trace(
            args.num_requests,
            args.max_context,
            args.seed,
            arrival_rate=args.arrival_rate,
            prefix_share=args.prefix_share,
            parallel_samples=args.parallel_samples,
        )
    given = [name for name, set_ in mixed_only.items() if set_]
    given += ["--trace-kind"] if args.trace_kind != "mixed" else []
    if given:
        raise ValueError(
            f"{', '.join(given)} shape(s) the generated trace only; a --trace file sets "
            "n, prefix_id and arrival per row"
        )
    if not args.trace.exists():
        raise ValueError(f"--trace {args.trace}: no such file")
    return read_trace(args.trace, args.max_context)


def run(args: argparse.Namespace) -> int:
    """Run the simulator with parsed ``args``; print the table (or JSON) and write files.

    Returns
    -------
    int
        0 on success; 2 on bad input (malformed trace, budget too small for a request,
        out-of-range option), with the reason on stderr.
    """
    from pagedbench.harness.capacity.batches import decode_steps, write_steps
    from pagedbench.harness.capacity.simulate_output import (format_table, plot_capacity,
                                                             results_frame)

    try:
        kv_budget_tokens, per_token = _budget_tokens(args)
        trace = _load_trace(args)
        policies = default_policies(args.block_sizes, sharing=shares(trace),
                                    radix_page_sizes=args.radix_page_sizes)
        results = compare_policies(trace, policies, kv_budget_tokens, args.max_context, args.seed)
    except (TraceError, CapacityError, ValueError, OSError) as err:
        print(f"pagedbench simulate: error: {err}", file=sys.stderr)
        return 2
    if args.output_dir.exists() and not args.output_dir.is_dir():
        print(f"pagedbench simulate: error: --output-dir {args.output_dir} is a file, "
              "not a folder", file=sys.stderr)
        return 2

    frame = results_frame(results)
    budget_gib = kv_budget_tokens * per_token / _GIB
    source = (str(args.trace) if args.trace is not None
              else f"generated {args.trace_kind}, seed {args.seed}")
    title = (
        f"{args.preset} ({per_token // 1024} KiB/token), KV budget {budget_gib:.2f} GiB = "
        f"{kv_budget_tokens} tokens, max_context {args.max_context}, "
        f"{len(trace)} requests ({source})"
    )
    args.output_dir.mkdir(parents=True, exist_ok=True)
    plot_path = args.output_dir / PLOT_NAME
    table_path = args.output_dir / TABLE_NAME
    frame.to_csv(table_path, index=False)
    plot_capacity(frame, plot_path, title)
    if args.emit_batches is not None:
        steps = decode_steps(trace, args.block_sizes[0], kv_budget_tokens, args.max_context,
                             MODEL_PRESETS[args.preset], args.seed)
        write_steps(args.emit_batches, steps)
        print(f"wrote {len(steps)} decode batches (block_size {args.block_sizes[0]}) to "
              f"{args.emit_batches}", file=sys.stderr)
    if args.json:
        print(json.dumps([dataclasses.asdict(r) for r in results], indent=1))
        print(f"wrote {plot_path} and {table_path}", file=sys.stderr)
    else:
        print(title)
        print(format_table(frame))
        print(f"wrote {plot_path} and {table_path}")
    return 0
