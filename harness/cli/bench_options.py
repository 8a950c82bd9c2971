"""``pagedbench bench``'s options (its body: :mod:`.bench`; the sweep they change:
:mod:`pagedbench.harness.run.bench`). Nothing heavy is imported here: ``pagedbench bench
--help`` and its usage errors answer without torch."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from pagedbench.reference import DTYPES, PagedInputError

from pagedbench.harness.cases.presets import MODEL_PRESETS
from pagedbench.harness.cases.workloads import (DEFAULT_BASELINE, LAYOUT_RATIOS, MODES,
                                                parse_batch_spec)
from pagedbench.harness.cli.options import (device_arg, int_in, positive_int, positive_seconds,
                                            run_and_bench_arguments)
from pagedbench.harness.run import bench
from pagedbench.harness.verdict.status import exit_codes_help
from pagedbench.harness.verdict.truth_sites import HOST_TRUTH_FRACTION


def add_parser(sub: argparse._SubParsersAction) -> None:
    """``pagedbench bench`` and its options."""
    _bench_arguments(sub.add_parser(
        "bench", description=bench.__doc__.split("\n\n")[0], epilog=exit_codes_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter))


def _batch_spec(text: str) -> str:
    try:
        parse_batch_spec(text)
    except PagedInputError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


#: The sweep's repeatable options and the :class:`~pagedbench.harness.run.bench.Sweep`
#: field each sets.
AXES = {"--mode": "modes", "--layout": "layouts", "--batch-size": "batch_sizes",
        "--context": "contexts", "--block-size": "block_sizes", "--dtype": "dtypes",
        "--batch-spec": "batch_specs", "--preset": "presets", "--workload": "workload_patterns"}


def _bench_arguments(p: argparse.ArgumentParser) -> None:
    cpu, gpu = bench.CPU_SWEEP, bench.GPU_SWEEP

    def axis(flag: str, help: str, **kw: Any) -> None:
        p.add_argument(flag, dest=AXES[flag], action="append", default=[], help=help, **kw)

    def show(values: tuple) -> str:
        return " ".join(map(str, values))

    p.add_argument("--impl", action="append", default=[], metavar="NAME",
                   help="implementation to time (repeatable; default on the CPU: "
                        f"{', '.join(bench.CPU_IMPLS)}; on a GPU: all)")
    p.add_argument("--baseline", default=DEFAULT_BASELINE, metavar="NAME",
                   help=f"speedups are against it; run too if not chosen (default: "
                        f"{DEFAULT_BASELINE})")
    p.add_argument("--device", type=device_arg, default="cpu", help="cpu (default), cuda or cuda:N")
    p.add_argument("--quick", action="store_true",
                   help="a seconds-long sweep (2 workloads, 2 block sizes, float32) with short "
                        "timings, for smoke tests; the axis options still apply")
    axis("--mode", f"grid mode (repeatable; default CPU: {show(cpu.modes)})",
         choices=list(MODES))
    axis("--layout", "GQA layout or preset heads (repeatable; default CPU: "
         f"{show(cpu.layouts)})", choices=[*LAYOUT_RATIOS, *MODEL_PRESETS], metavar="LAYOUT")
    axis("--batch-size", f"sequences per batch (repeatable; default CPU: "
         f"{show(cpu.batch_sizes)}, GPU: {show(gpu.batch_sizes)})", type=positive_int)
    axis("--context", f"KV tokens per sequence (repeatable; default CPU: "
         f"{show(cpu.contexts)}, GPU: {show(gpu.contexts)})", type=positive_int)
    axis("--block-size", f"block size (repeatable; default CPU: "
         f"{show(cpu.block_sizes)}, GPU: {show(gpu.block_sizes)})", type=positive_int)
    axis("--dtype", f"dtype (repeatable; default CPU: {show(cpu.dtypes)}, GPU: "
         f"{show(gpu.dtypes)})", choices=list(DTYPES))
    axis("--batch-spec", "a vLLM batch-spec workload such as 8q1s1k, "
         "2q2k_32q1s1k or the production mix q257_7q1s1057_3q4s2051_2q129s4093, with every "
         "--layout (repeatable); alone (no --mode, --batch-size or --context) it replaces "
         "the grid", type=_batch_spec, metavar="SPEC")
    p.add_argument("--trace", type=Path, default=None, metavar="FILE",
                   help="a batch trace: one step of a serving engine a JSON line (kv_lens, "
                        "q_lens, shapes; pagedbench simulate --emit-batches writes one; "
                        "docs/benchmarks.md), each step a workload, with the heads of the "
                        "first --layout where a line gives none; prints each step's time and "
                        "their total; alone it replaces the grid and its contiguous points")
    axis("--preset", "a ragged decode batch with a model preset's heads "
         "(repeatable); alone it replaces the grid", choices=list(MODEL_PRESETS),
         metavar="NAME")
    axis("--workload", "keep workloads whose name matches this shell "
         "pattern, e.g. 'decode-*' or '*-mqa-*' (repeatable)", metavar="PATTERN")
    p.add_argument("--grid", choices=list(bench.GRIDS), default=None,
                   help="full: every combination of the grid axes; axes: one axis at a time "
                        "around the first values (CPU default); none: no grid workloads")
    p.add_argument("--no-contiguous", action="store_true",
                   help="skip each workload's contiguous point (no paging overhead then)")
    p.add_argument("--host-truth-bytes", type=int_in(0), default=None,
                   metavar="BYTES",
                   help="largest truth (inputs plus one sequence's float64 work) computed on "
                        "the host; larger points get their truth on the device (default: "
                        f"{HOST_TRUTH_FRACTION:g} of the host's memory)"),
    p.add_argument("--dry-run", action="store_true", help="print the points and exit")
    p.add_argument("--points", type=positive_int, default=None, metavar="N",
                   help="only the first N points of the sweep, in its order (workloads in "
                        "the order of the --workload patterns they match)")
    p.add_argument("--point-major", action="store_true",
                   help="every implementation at a point before the next point (default: "
                        "one implementation's points after another's); a run stopped early "
                        "leaves whole points")
    p.add_argument("--repetitions", type=int_in(1, 100_000), default=None, metavar="N",
                   help="CPU timing samples per point, as the time limit allows (default: "
                        f"{bench.CPU_TIMING['default']['repetitions']}; pagedbench gate "
                        "judges points with at least --min-samples of them)")
    p.add_argument("--min-time", type=positive_seconds, default=None, metavar="SECONDS",
                   help="CPU: measure each point for at least this long (default: "
                        f"{bench.CPU_TIMING['default']['time_budget_s']:g})")
    run_and_bench_arguments(p, "point")
