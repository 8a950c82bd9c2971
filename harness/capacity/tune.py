"""``pagedbench tune``: choose ``block_size`` from measured kernel time and simulated capacity.

For each workload (a generated trace, :data:`WORKLOADS`, or ``--trace FILE``) and block
size, the capacity simulator replays the trace on the KV budget and records every decode
step's kernel batch; the kernel's time at each step is interpolated between measured
points (``pagedbench bench`` results of one device, or points this command benches
itself), never extrapolated, and turned into predicted decode throughput and a
recommended block size per workload (:mod:`~pagedbench.harness.capacity.prediction` has
the arithmetic). Prefill, recomputation after preemption, the model's GEMMs and sampling
are not timed (``--other-ms-per-step`` adds a measured cost of the rest of a step,
``--prefill-ms-per-token`` one of each computed prefill token, which prefix reuse saves).
For a workload that shares prefixes it also replays SGLang's radix tree (page size 1) and
says whether it reuses more prefix tokens than the blocks, and by how much. A
recommendation is for the device its timings come from: CPU timings make a CPU-serving
recommendation, and results of two devices are never mixed. What it prints and writes:
:mod:`~pagedbench.harness.capacity.tune_output`. The options and workloads are read
without numpy, pandas or torch: :func:`run` imports the prediction and the output.

The points benched when no results folder is given (:func:`bench_cases`): the corners of
the region every workload's decode steps span, and their median step, as ragged
decode batches with the preset's heads; docs/tune.md has the details.
"""

from __future__ import annotations

import argparse
import math
import sys
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pagedbench.reference import DTYPES, PagedCase, PagedValueError
from pagedbench.reference.kv_policies import Policy
from pagedbench.reference.simulator import PolicyResult, budget_tokens_from_bytes, simulate
from pagedbench.reference.workload import Request

from pagedbench.harness.capacity.prefix_traces import TRACE_KINDS
from pagedbench.harness.capacity.simulate import block_sizes as listed_block_sizes
from pagedbench.harness.capacity.traces import generate_trace, read_trace
from pagedbench.harness.cases.presets import MODEL_PRESETS, ModelPreset
from pagedbench.harness.verdict.status import ExitCode, Status, exit_code

if TYPE_CHECKING:
    from pagedbench.harness.capacity.prediction import DecodeStep
    from pagedbench.harness.results.record import ResultRecord

DEFAULT_PRESET = "llama3.1-8b"
DEFAULT_IMPL = "vllm-cpu"
#: KV memory (GiB; vLLM's CPU backend takes it from ``VLLM_CPU_KVCACHE_SPACE``): 1 GiB,
#: 8192 tokens of llama3.1-8b in bf16, keeps the largest batch tune benches near 22k KV
#: tokens (shared prefixes are read once per sequence), minutes on 2 cores.
DEFAULT_KV_BUDGET_GIB = 1.0
#: 128 is vLLM's CPU default (vllm/platforms/cpu.py), 16 its CUDA default.
DEFAULT_BLOCK_SIZES = (16, 32, 64, 128)
DEFAULT_NUM_REQUESTS = 100
DEFAULT_OUTPUT_DIR = Path("results/runs/tune")
#: What ``--output-dir`` gets (:func:`~.tune_output.write`).
PLOT_NAME = "tune.png"
JSON_NAME = "tune.json"
#: CPU timing of the points tune benches (``RunConfig`` fields): 7 samples over at least
#: 0.1 s, enough for a p10 and p90; one torch thread (a shared host's extra threads wait
#: on preempted ones, docs/gate.md).
TUNE_TIMING = {"repetitions": 7, "time_budget_s": 0.1, "time_limit_s": 3.0, "threads": 1}
KV_CACHE_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
_GIB = 2**30


@dataclass(frozen=True)
class TuneWorkload:
    """A generated workload: :func:`~.traces.generate_trace`'s distribution with these
    settings, every request queued at step 0 (the offline throughput setting).

    Attributes
    ----------
    name, description : str
    max_context : int
        Longest prompt + output (tokens); prompts and outputs are log-uniform up to half.
    prefix_share : float
        Fraction of requests starting with one of 4 shared prefixes.
    shared_prefix_len : int or None
        Tokens of each shared prefix.
    parallel_samples : int
        ``n`` of every request.
    kind : str
        ``"mixed"`` (the above), or a kind of :data:`~.prefix_traces.TRACE_KINDS` whose
        own distribution replaces them.
    """

    name: str
    description: str
    max_context: int
    prefix_share: float = 0.0
    shared_prefix_len: int | None = None
    parallel_samples: int = 1
    kind: str = "mixed"

    def trace(self, num_requests: int, seed: int) -> list[Request]:
        """``num_requests`` requests drawn with ``seed``."""
        if self.kind != "mixed":
            return TRACE_KINDS[self.kind](num_requests, self.max_context, seed)
        return generate_trace(num_requests, self.max_context, seed,
                              prefix_share=self.prefix_share,
                              shared_prefix_len=self.shared_prefix_len,
                              parallel_samples=self.parallel_samples)


#: The generated workloads, after the vLLM paper's traces (Kwon et al., SOSP 2023, 6.1:
#: ShareGPT chat, Alpaca instructions; 6.3 parallel sampling; 6.4 a shared prefix), and
#: the prefix-sharing kinds of harness/capacity/prefix_traces.py (SGLang's, Zheng et al.
#: 2024, section 6: multi-turn chat, agents, few-shot).
WORKLOADS = {
    w.name: w
    for w in (
        TuneWorkload("long-chat", "chat: prompts and outputs log-uniform in 1..1024 tokens",
                     2048),
        TuneWorkload("short-instructions",
                     "instructions: prompts and outputs log-uniform in 1..128 tokens", 256),
        TuneWorkload("system-prompt", "one of 4 shared 256-token system prompts, then "
                     "1..768 own tokens; outputs 1..1024", 2048, prefix_share=1.0,
                     shared_prefix_len=256),
        TuneWorkload("parallel-sampling", "4 samples per prompt (n=4), prompts and outputs "
                     "log-uniform in 1..512 tokens", 1024, parallel_samples=4),
        TuneWorkload("multi-turn", "chat sessions of 2-8 turns, each prompt the whole "
                     "conversation so far", 2048, kind="multi-turn"),
        TuneWorkload("agent", "tool-calling loops of 3-12 steps over a shared 512-token "
                     "tool prompt, growing scratchpads", 2048, kind="agent"),
        TuneWorkload("few-shot", "batches over 4 shared 512-768-token few-shot prompts",
                     2048, kind="few-shot"),
    )
}
#: The workloads tune runs without ``--workload`` or ``--trace`` (the prefix-sharing
#: kinds after them are asked for by name: each adds its simulations and bench points).
DEFAULT_WORKLOADS = ("long-chat", "short-instructions", "system-prompt", "parallel-sampling")


def batch_case(preset: ModelPreset, sequences: int, kv_tokens: int, block_size: int,
               dtype: str) -> PagedCase:
    """A ragged decode batch of ``sequences`` sequences holding ``kv_tokens`` KV tokens
    (lengths ``kv_tokens // sequences``, the first ``kv_tokens % sequences`` one more)
    with the preset's heads, seeded by its name (the same at every block size).

    Raises
    ------
    PagedValueError
        If ``kv_tokens < sequences`` (a sequence without a token) or a size is < 1.
    """
    if sequences < 1 or kv_tokens < sequences:
        raise PagedValueError("kv_tokens", kv_tokens, f">= sequences ({sequences}) >= 1")
    base, extra = divmod(kv_tokens, sequences)
    kv_lens = tuple(base + 1 if i < extra else base for i in range(sequences))
    name = f"tune-{preset.name}-b{sequences}-t{kv_tokens}"
    return PagedCase(kv_lens=kv_lens, num_q_heads=preset.num_q_heads,
                     num_kv_heads=preset.num_kv_heads, head_dim=preset.head_dim,
                     block_size=block_size, dtype=dtype, seed=zlib.crc32(name.encode()),
                     name=name)


def bench_batches(steps_by_workload: dict[str, Sequence[DecodeStep]]) -> list[tuple[int, int]]:
    """The ``(sequences, kv_tokens)`` batches to measure so that every step lies inside
    their convex hull: the corners of the region the steps span, rounded outwards,
    and the median step of them all (by KV tokens) for accuracy inside.

    The region: ``sequences`` in ``[b_min, b_max]``, ``kv_tokens`` between
    ``c_lo * sequences`` and ``min(c_hi * sequences, t_max)``, with ``c_lo`` and ``c_hi``
    the least and largest mean KV length of a step and ``t_max`` the most KV tokens of a
    step: a convex polygon holding every step. Its corners:
    ``(b_min, floor(c_lo b_min))``, ``(b_max, floor(c_lo b_max))``,
    ``(b_min, min(ceil(c_hi b_min), t_max))``, ``(floor(t_max / c_hi), t_max)`` when
    that lies right of ``b_min``, and ``(b_max, t_max)``.
    """
    import numpy as np

    every = [s for steps in steps_by_workload.values() for s in steps]
    if not every:
        return []
    b = np.array([s.sequences for s in every], dtype=np.int64)
    t = np.array([s.kv_tokens for s in every], dtype=np.int64)
    c = t / b
    b_min, b_max, t_max = int(b.min()), int(b.max()), int(t.max())
    c_lo, c_hi = float(c.min()), float(c.max())
    corners = [(b_min, math.floor(c_lo * b_min)), (b_max, math.floor(c_lo * b_max)),
               (b_min, min(math.ceil(c_hi * b_min), t_max)), (b_max, t_max)]
    knee = math.floor(t_max / c_hi)
    if knee > b_min:
        corners.append((knee, t_max))
    middle = sorted(every, key=lambda s: (s.kv_tokens, s.sequences))[len(every) // 2]
    corners.append((middle.sequences, middle.kv_tokens))
    if b_min == b_max:  # one batch size: a second one makes the region an area
        corners += [(b_min + 1, b_min + 1 + math.floor(c_lo * b_min)), (b_min + 1, t_max + 1)]
    found = sorted({(bb, max(tt, bb)) for bb, tt in corners})
    corner_array = np.array(found)  # [n, 2]
    if len(found) < 3 or np.linalg.matrix_rank(corner_array[1:] - corner_array[0]) < 2:
        found.append((b_max, t_max + b_max))  # steps on one line: one more token each
    return found


def bench_cases(preset: ModelPreset, batches: Sequence[tuple[int, int]],
                block_sizes: Sequence[int], dtype: str) -> list[PagedCase]:
    """Every batch of ``batches`` at every block size (:func:`batch_case`)."""
    return [batch_case(preset, b, t, bs, dtype) for bs in block_sizes for b, t in batches]


# Command line -------------------------------------------------------------------------
def _block_sizes(text: str) -> tuple[int, ...]:
    return tuple(sorted(listed_block_sizes(text)))


def _non_negative_ms(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"must be a finite number of ms >= 0, got {text!r}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``tune`` options to ``parser`` (defaults in the module docstring's terms)."""
    parser.add_argument("--preset", default=DEFAULT_PRESET, choices=list(MODEL_PRESETS),
                        help=f"model: heads, head_dim, layers (default {DEFAULT_PRESET})")
    parser.add_argument("--impl", default=DEFAULT_IMPL, metavar="NAME",
                        help=f"implementation whose kernel times count (default {DEFAULT_IMPL})")
    parser.add_argument("--device", default="cpu", metavar="DEVICE",
                        help="cpu (default), cuda or cuda:N: where tune benches, and the "
                             "device results of --results-dir must come from")
    parser.add_argument("--dtype", default="bfloat16", choices=list(KV_CACHE_DTYPE_BYTES),
                        help="Q/K/V element type (default bfloat16)")
    parser.add_argument("--kv-budget-gib", type=float, default=DEFAULT_KV_BUDGET_GIB,
                        metavar="GIB", help=f"KV memory, GiB (default {DEFAULT_KV_BUDGET_GIB:g})")
    parser.add_argument("--workload", action="append", default=[], choices=list(WORKLOADS),
                        help="generated workload (repeatable; default: "
                             f"{', '.join(DEFAULT_WORKLOADS)})")
    parser.add_argument("--trace", action="append", type=Path, default=[], metavar="FILE",
                        help="a trace file as pagedbench simulate reads (repeatable; named by "
                             "its file name; replaces the generated workloads unless "
                             "--workload is given too)")
    parser.add_argument("--max-context", type=int, default=2048, metavar="TOKENS",
                        help="longest prompt+output of a --trace file (default 2048)")
    parser.add_argument("--num-requests", type=int, default=DEFAULT_NUM_REQUESTS,
                        help=f"requests per generated workload (default {DEFAULT_NUM_REQUESTS})")
    parser.add_argument("--seed", type=int, default=0, help="seed of the generated traces")
    parser.add_argument("--block-sizes", type=_block_sizes, default=DEFAULT_BLOCK_SIZES,
                        metavar="LIST", help="block sizes to bench and simulate (default "
                        + ",".join(map(str, DEFAULT_BLOCK_SIZES)) + "); with --results-dir, "
                        "those it holds")
    parser.add_argument("--results-dir", dest="kernel_results", type=Path, default=None,
                        metavar="DIR",
                        help="measured kernel results (pagedbench bench or run .jsonl files "
                             "of one device); default: bench the needed points now")
    parser.add_argument("--other-ms-per-step", type=_non_negative_ms, default=0.0,
                        metavar="MS", help="measured time of the rest of the model per "
                        "decode step, added to every step (default 0: attention only)")
    parser.add_argument("--prefill-ms-per-token", type=_non_negative_ms, default=0.0,
                        metavar="MS", help="measured time of the whole model per computed "
                        "prefill token, charged to every prefill token a workload computes "
                        "(default 0: prefill not counted; prefix reuse saves it)")
    parser.add_argument("--output-dir", type=Path, default=DEFAULT_OUTPUT_DIR, metavar="DIR",
                        help=f"where {PLOT_NAME}, {JSON_NAME} and the benched points' "
                             f"bench/<run-id>.jsonl go (default {DEFAULT_OUTPUT_DIR}/)")
    parser.add_argument("--json", action="store_true",
                        help="print the report as JSON instead of the table")


def _workloads(args: argparse.Namespace) -> dict[str, tuple[str, list[Request], int]]:
    """``{name: (description, trace, max_context)}`` of the chosen workloads."""
    if args.num_requests < 1:
        raise PagedValueError("--num-requests", args.num_requests, "an integer >= 1")
    chosen: dict[str, tuple[str, list[Request], int]] = {}
    names = args.workload or ([] if args.trace else list(DEFAULT_WORKLOADS))
    for name in dict.fromkeys(names):
        w = WORKLOADS[name]
        chosen[name] = (w.description, w.trace(args.num_requests, args.seed), w.max_context)
    for path in args.trace:
        if not path.exists():
            raise PagedValueError("--trace", str(path), "a CSV file",
                                  f"--trace {path}: no such file")
        chosen[path.name] = (f"trace file {path}", read_trace(path, args.max_context),
                             args.max_context)
    return chosen


def _bench(args: argparse.Namespace, preset: ModelPreset, cases: list[PagedCase],
           target: str) -> tuple[list[ResultRecord], Path]:
    """Run ``cases`` on ``--impl`` (conformance-checked, then timed) into
    ``<output-dir>/bench/<run-id>.jsonl``."""
    from pagedbench.harness.run import runner
    from pagedbench.harness.results.store import ResultsFile, new_run_id, results_of

    config = runner.RunConfig(device=args.device, suite="tune", cache_dir=args.cache_dir,
                              **TUNE_TIMING)
    run_id = new_run_id()
    results = ResultsFile(args.output_dir / "bench" / f"{run_id}.jsonl")
    print(f"benching {len(cases)} points of {args.impl} on {args.device} -> {results.path}",
          file=sys.stderr)
    plan = runner.make_plan({args.impl: target}, cases)

    def progress(record: ResultRecord) -> None:
        ms = f"{record.time_ms.median:.3g} ms" if record.time_ms else record.reason[:80]
        print(f"  {record.status} {record.case_id}: {ms}", file=sys.stderr)

    runner.run(plan, config, results, run_id, on_record=progress)
    return [r for r in results_of(results.lines()) if r.run_id == run_id], results.path


def run(args: argparse.Namespace) -> int:
    """``pagedbench tune`` with parsed ``args``: print the table and recommendations (or
    the JSON report) and write ``tune.png`` and ``tune.json``.

    Returns
    -------
    int
        0 when every workload got a recommendation; 2 (bad input, results out of range
        or of several devices, no workload predicted); 3 when the implementation ran no
        point here (unavailable or unsupported); 1 or 4 when a benched point failed or
        pagedbench faulted (the other points still count).

    Raises
    ------
    PagedInputError
        Bad options or results (the CLI prints them, exit 2).
    """
    from pagedbench.adapters import entries

    from pagedbench.harness.capacity.prediction import (TUNE_SCHEMA_VERSION, TuneReport,
                                                        kernel_models, kernel_points, predict,
                                                        prefix_reuse, recommend, shares,
                                                        simulate_decode)
    from pagedbench.harness.capacity.tune_output import conditions, text, write
    from pagedbench.harness.results.store import read_lines, results_of

    preset = MODEL_PRESETS[args.preset]
    if args.dtype not in DTYPES:
        raise PagedValueError("--dtype", args.dtype, f"one of {list(DTYPES)}")
    if not (math.isfinite(args.kv_budget_gib) and args.kv_budget_gib > 0):
        raise PagedValueError("--kv-budget-gib", args.kv_budget_gib, "a finite number > 0")
    kind, colon, number = args.device.partition(":")
    if kind not in ("cpu", "cuda") or (colon and not (kind == "cuda" and number.isdigit())):
        raise PagedValueError("--device", args.device, "cpu, cuda or cuda:N")
    known = {e.name: e.target for e in entries()}
    if args.impl not in known:
        raise PagedValueError("--impl", args.impl, f"among {list(known)}")
    per_token = preset.kv_bytes_per_token(KV_CACHE_DTYPE_BYTES[args.dtype])
    budget_tokens = budget_tokens_from_bytes(int(args.kv_budget_gib * _GIB), per_token)
    workloads = _workloads(args)

    sims: dict[tuple[str, int], tuple[PolicyResult, list[DecodeStep]]] = {}
    block_sizes = args.block_sizes
    if args.kernel_results is not None:
        if not args.kernel_results.exists():
            raise PagedValueError("--results-dir", str(args.kernel_results), "an existing folder",
                                  f"--results-dir {args.kernel_results}: no such file or folder")
        records = results_of(read_lines([args.kernel_results]))
        points, env, version = kernel_points(records, args.impl, preset, args.dtype)
        if env.device_type != kind:
            wanted, measured = (("GPU" if t == "cuda" else "CPU") for t in (kind, env.device_type))
            raise PagedValueError(
                "--device", args.device, f"the device of the results ({env.device_type})",
                f"--device {args.device}, but the results were measured on "
                f"{env.device_type} ({env.device}): a {wanted} recommendation never comes "
                f"from {measured} timings")
        sources = [str(args.kernel_results)]
        code = ExitCode.CLEAN
        block_sizes = tuple(sorted({p.block_size for p in points}))
        if args.block_sizes != DEFAULT_BLOCK_SIZES:
            block_sizes = tuple(b for b in block_sizes if b in args.block_sizes)
    trees: dict[str, PolicyResult] = {}
    for name, (_, trace, max_context) in workloads.items():
        for bs in block_sizes:
            sims[name, bs] = simulate_decode(trace, bs, budget_tokens, max_context, args.seed)
        if shares(trace):
            trees[name] = simulate(trace, Policy("Radix", 1), budget_tokens, max_context,
                                   args.seed)
    if args.kernel_results is None:
        batches = bench_batches({name: [s for (w, _), (_, steps) in sims.items() if w == name
                                        for s in steps] for name in workloads})
        cases = bench_cases(preset, batches, block_sizes, args.dtype)
        records, path = _bench(args, preset, cases, known[args.impl])
        sources = [str(path)]
        code = exit_code(r.status for r in records)
        passed = [r for r in records if r.status is Status.PASS and r.time_ms is not None]
        if not passed:
            reasons = sorted({f"{r.status}: {r.reason}" for r in records})[:3]
            print(f"pagedbench tune: {args.impl} timed no point on {args.device} "
                  f"({'; '.join(reasons) or 'no result'})", file=sys.stderr)
            return int(code if code is not ExitCode.CLEAN else ExitCode.NOTHING_RAN)
        points, env, version = kernel_points(passed, args.impl, preset, args.dtype)
    serving: Literal["cpu", "gpu"] = "cpu" if env.device_type == "cpu" else "gpu"
    models, dropped = kernel_models(points)
    rows = []
    for (name, bs), (result, steps) in sims.items():
        rows.append(predict(name, result, steps, models.get(bs), preset.num_layers,
                            args.other_ms_per_step,
                            refused=None if bs in models else f"block_size {bs}: not measured",
                            prefill_ms_per_token=args.prefill_ms_per_token))
    recommendations = [recommend([r for r in rows if r.workload == name], serving)
                       for name in workloads]
    reuse = [prefix_reuse(name, tree, [r for r in rows if r.workload == name],
                          next(r.block_size for r in recommendations if r.workload == name))
             for name, tree in trees.items()]
    fields = dict(kind="tune", schema_version=TUNE_SCHEMA_VERSION, preset=preset.name,
                  num_layers=preset.num_layers, kv_cache_dtype=args.dtype,
                  kv_bytes_per_token=per_token, kv_budget_gib=float(args.kv_budget_gib),
                  kv_budget_tokens=budget_tokens, impl=args.impl, impl_version=version,
                  serving=serving, env=env, other_ms_per_step=float(args.other_ms_per_step),
                  prefill_ms_per_token=float(args.prefill_ms_per_token),
                  block_sizes=list(block_sizes), dropped_block_sizes=dropped,
                  workloads={n: d for n, (d, _, _) in workloads.items()},
                  num_requests=args.num_requests, seed=args.seed,
                  points=sorted(points, key=lambda p: (p.block_size, p.sequences, p.kv_tokens)),
                  results=sources, rows=rows, recommendations=recommendations,
                  prefix_reuse=reuse)
    sharing = {n: shares(t) for n, (_, t, _) in workloads.items()}
    report = TuneReport(**fields, conditions=conditions(fields, sharing, models))
    write(report, args.output_dir / JSON_NAME, args.output_dir / PLOT_NAME)
    if args.json:
        print(report.model_dump_json(indent=1))
    else:
        print(text(report))
    if any(r.block_size is None for r in recommendations):
        return int(ExitCode.USAGE_ERROR)
    return int(code)


__all__ = ["DEFAULT_BLOCK_SIZES", "DEFAULT_WORKLOADS", "WORKLOADS", "TuneWorkload",
           "add_arguments", "batch_case", "bench_batches", "bench_cases", "run"]
