"""``pagedbench tune``: choose ``block_size`` from measured kernel time and simulated capacity.

For each workload (a generated trace, :data:`WORKLOADS`, or ``--trace FILE``) and block
size, the capacity simulator (:func:`~pagedbench.reference.simulator.simulate`; prefix
caching of full blocks when the trace shares) replays the trace on the KV budget and
records every decode step's kernel batch: ``(sequences, kv_tokens)``. The kernel's time
at each step is interpolated between measured points (``pagedbench bench`` results of one
device, or points this command benches itself), linearly over the triangles of the
measured ``(sequences, kv_tokens)`` points (scipy ``LinearNDInterpolator``): exact where
the time is ``a + b * sequences + c * kv_tokens``, as a memory-bound decode nearly is. A
step outside the measured points' convex hull is never extrapolated: its row is refused
(:class:`OutOfMeasuredRange`). Predicted decode throughput, tokens per second::

    decode_tokens / sum over decode steps of (num_layers * t(step) + other_ms_per_step)

with ``t`` the median, p10 and p90 of the measured times carried through the same
interpolation (the throughput's spread). The recommendation per workload is the block
size of highest median throughput, with its margin over the runner-up; it ``holds`` when
its p90-time throughput still beats the runner-up's p10-time throughput. Prefill,
recomputation after preemption, the model's GEMMs and sampling are not timed
(``--other-ms-per-step`` adds a measured cost of the rest of a step). A recommendation is
for the device its timings come from: CPU timings make a CPU-serving recommendation, and
results of two devices are never mixed (:func:`kernel_models`).

The points benched when no results folder is given (:func:`bench_cases`): the corners of
the region every workload's decode steps span, and their median step, as ragged
decode batches with the preset's heads; docs/tune.md has the details.
"""

from __future__ import annotations

import argparse
import math
import sys
import zlib
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Optional

import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from pydantic import BaseModel, ConfigDict
from scipy.interpolate import LinearNDInterpolator

from pagedbench.reference import DTYPES, PagedCase, PagedValueError
from pagedbench.reference.kv_policies import LiveRequest, Policy
from pagedbench.reference.simulator import PolicyResult, budget_tokens_from_bytes, simulate
from pagedbench.reference.workload import Request

from pagedbench.harness.capacity.simulate import block_sizes as listed_block_sizes
from pagedbench.harness.capacity.traces import generate_trace, read_trace
from pagedbench.harness.cases.presets import MODEL_PRESETS, ModelPreset
from pagedbench.harness.results.record import Environment, ResultRecord
from pagedbench.harness.verdict.status import ExitCode, Status, exit_code

#: ``TuneReport.schema_version``: changes whenever a field is added, removed or changes meaning.
TUNE_SCHEMA_VERSION = 1
DEFAULT_PRESET = "llama3.1-8b"
DEFAULT_IMPL = "vllm-cpu"
#: KV memory (GiB; vLLM's CPU backend takes it from ``VLLM_CPU_KVCACHE_SPACE``): 1 GiB,
#: 8192 tokens of llama3.1-8b in bf16, keeps the largest batch tune benches near 22k KV
#: tokens (shared prefixes are read once per sequence), minutes on 2 cores.
DEFAULT_KV_BUDGET_GIB = 1.0
#: 128 is vLLM's CPU default (vllm/platforms/cpu.py), 16 its CUDA default.
DEFAULT_BLOCK_SIZES = (16, 32, 64, 128)
DEFAULT_NUM_REQUESTS = 100
DEFAULT_OUTPUT_DIR = Path("results/tune")
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
    """

    name: str
    description: str
    max_context: int
    prefix_share: float = 0.0
    shared_prefix_len: int | None = None
    parallel_samples: int = 1

    def trace(self, num_requests: int, seed: int) -> list[Request]:
        """``num_requests`` requests drawn with ``seed``."""
        return generate_trace(num_requests, self.max_context, seed,
                              prefix_share=self.prefix_share,
                              shared_prefix_len=self.shared_prefix_len,
                              parallel_samples=self.parallel_samples)


#: The generated workloads, after the vLLM paper's traces (Kwon et al., SOSP 2023, 6.1:
#: ShareGPT chat, Alpaca instructions; 6.3 parallel sampling; 6.4 a shared prefix).
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
    )
}


@dataclass(frozen=True)
class DecodeStep:
    """One decode step's kernel batch: ``sequences`` (samples decoding one token each)
    and ``kv_tokens`` (their KV lengths summed, the new tokens included)."""

    sequences: int
    kv_tokens: int


def simulate_decode(trace: Sequence[Request], block_size: int, kv_budget_tokens: int,
                    max_context: int, seed: int = 0) -> tuple[PolicyResult, list[DecodeStep]]:
    """Replay ``trace`` paged at ``block_size`` and record every decode step's batch.

    The policy is ``Paged+share`` (prefix caching of full blocks, forked samples) when a
    request has a ``prefix_id`` or ``n > 1``, else ``Paged`` (as ``pagedbench simulate``).

    Raises
    ------
    TraceError, CapacityError, PagedValueError
        As :func:`~pagedbench.reference.simulator.simulate`.
    """
    sharing = any(r.n > 1 or r.prefix_id is not None for r in trace)
    policy = Policy("Paged+share" if sharing else "Paged", block_size)
    steps: list[DecodeStep] = []

    def on_decode(running: Sequence[LiveRequest]) -> None:
        steps.append(DecodeStep(
            sum(live.request.n for live in running),
            sum(live.request.n * (live.request.prompt_len + live.generated) for live in running)))

    result = simulate(trace, policy, kv_budget_tokens, max_context, seed, on_decode=on_decode)
    return result, steps


class OutOfMeasuredRange(PagedValueError):
    """A decode step lies outside the convex hull of the measured points: its kernel time
    would be an extrapolation, which tune refuses (the message names the step, the block
    size and the measured range)."""


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, ser_json_inf_nan="null")


class KernelPoint(_Model):
    """One measured point: the kernel on a decode batch of ``sequences`` sequences holding
    ``kv_tokens`` KV tokens in all, at ``block_size``; ms per call (one layer)."""

    block_size: int
    sequences: int
    kv_tokens: int
    median_ms: float
    p10_ms: float
    p90_ms: float
    case_id: str


class KernelModel:
    """Kernel time per call at one block size, interpolated between measured points.

    Parameters
    ----------
    block_size : int
    points : Sequence[KernelPoint]
        At least three not on one line (points at two or more batch sizes and KV totals).

    Raises
    ------
    PagedValueError
        Naming ``block_size`` when the points span no area (fewer than three, or all on
        one line): nothing could be interpolated without extrapolating.
    """

    def __init__(self, block_size: int, points: Sequence[KernelPoint]) -> None:
        self.block_size = block_size
        self.points = list(points)
        xy = np.array([[p.sequences, p.kv_tokens] for p in self.points], dtype=np.float64)
        if len(xy) < 3 or np.linalg.matrix_rank(xy[1:] - xy[0]) < 2:
            raise PagedValueError(
                "block_size", block_size, "measured at three or more (sequences, kv_tokens) "
                "points not on one line",
                f"block_size {block_size}: {len(xy)} measured point(s) "
                f"{[(p.sequences, p.kv_tokens) for p in self.points]} span no area; "
                "interpolating needs points at two or more batch sizes and KV totals")
        values = np.array([[p.median_ms, p.p10_ms, p.p90_ms] for p in self.points])
        self._interpolate = LinearNDInterpolator(xy, values, rescale=True)

    def range_text(self) -> str:
        """The measured range, e.g. ``sequences 1..64, kv_tokens 10..32768 (7 points)``."""
        seqs = [p.sequences for p in self.points]
        toks = [p.kv_tokens for p in self.points]
        return (f"sequences {min(seqs)}..{max(seqs)}, kv_tokens {min(toks)}..{max(toks)} "
                f"({len(self.points)} points)")

    def times_ms(self, sequences: np.ndarray, kv_tokens: np.ndarray) -> np.ndarray:
        """Interpolated ``[n, 3]`` (median, p10, p90) ms per call at ``n`` batches.

        Raises
        ------
        OutOfMeasuredRange
            If a batch lies outside the measured points' convex hull, naming the first.
        """
        query = np.column_stack([np.asarray(sequences, float), np.asarray(kv_tokens, float)])
        times = self._interpolate(query)
        outside = np.isnan(times).any(axis=1)
        if outside.any():
            i = int(np.argmax(outside))
            raise OutOfMeasuredRange(
                "decode step", (int(query[i, 0]), int(query[i, 1])),
                "inside the measured points' convex hull",
                f"block_size {self.block_size}: {int(outside.sum())} of {len(query)} decode "
                f"batches lie outside the measured points (first: {int(query[i, 0])} "
                f"sequences, {int(query[i, 1])} KV tokens; measured: {self.range_text()}); "
                "tune interpolates and never extrapolates: bench those batches, or drop "
                "--results-dir to let tune bench what it needs")
        return times


def kernel_points(records: Sequence[ResultRecord], impl: str, preset: ModelPreset,
                  dtype: str) -> tuple[list[KernelPoint], Environment, str]:
    """The measured points among ``records`` that ``tune`` may use, with their environment
    and the implementation's version.

    Kept: ``pass`` results of ``impl`` with a timing, on plain decode cases (one query per
    sequence, no window, soft cap, ALiBi or sinks, K/V in ``dtype``) with the preset's
    ``num_q_heads``, ``num_kv_heads`` and ``head_dim``; the last result of a case id wins.

    Raises
    ------
    PagedValueError
        Naming ``--results-dir`` when no point is kept, or when the kept points come from
        more than one device (name and type), thread count or implementation version:
        a recommendation is for one device, and a GPU one never comes from CPU timings.
    """
    kept: dict[str, ResultRecord] = {}
    for record in records:
        case = record.paged_case()
        if (record.impl != impl or record.status is not Status.PASS or record.time_ms is None
                or case.mode != "decode" or case.dtype != dtype
                or (case.num_q_heads, case.num_kv_heads, case.head_dim)
                != (preset.num_q_heads, preset.num_kv_heads, preset.head_dim)
                or case.head_dim_v is not None or case.sliding_window is not None
                or case.logits_soft_cap is not None or case.alibi or case.sinks
                or case.kv_cache_dtype != "auto"):
            continue
        kept[record.case_id] = record
    if not kept:
        raise PagedValueError(
            "--results-dir", impl, f"passing, timed decode results of {impl} at {preset.name}'s "
            f"heads ({preset.num_q_heads}/{preset.num_kv_heads}, head_dim {preset.head_dim}) "
            f"in {dtype}",
            f"--results-dir holds no passing, timed decode result of {impl} with "
            f"{preset.name}'s heads ({preset.num_q_heads} q / {preset.num_kv_heads} kv, "
            f"head_dim {preset.head_dim}) in {dtype}")
    keys = {(r.env.device_type, r.env.device, r.env.threads, r.impl_version)
            for r in kept.values()}
    if len(keys) > 1:
        found = "; ".join(f"{t} {d!r}, {n} thread(s), {impl} {v}" for t, d, n, v in sorted(keys))
        raise PagedValueError(
            "--results-dir", sorted(keys), "results of one device, thread count and version",
            f"--results-dir mixes results of several devices or settings ({found}): a "
            "recommendation is for one device (a GPU's never comes from CPU timings); "
            "give a folder of one device's results")
    points = [KernelPoint(block_size=r.paged_case().block_size,
                          sequences=r.paged_case().batch_size,
                          kv_tokens=sum(r.paged_case().kv_lens), median_ms=r.time_ms.median,
                          p10_ms=r.time_ms.p10, p90_ms=r.time_ms.p90, case_id=r.case_id)
              for r in kept.values()]
    first = next(iter(kept.values()))
    return points, first.env, first.impl_version


def kernel_models(points: Sequence[KernelPoint]) -> tuple[dict[int, KernelModel], list[str]]:
    """One :class:`KernelModel` per block size of ``points``, and why each block size
    that could not have one was dropped."""
    models, dropped = {}, []
    for block_size in sorted({p.block_size for p in points}):
        try:
            models[block_size] = KernelModel(block_size,
                                             [p for p in points if p.block_size == block_size])
        except PagedValueError as exc:
            dropped.append(str(exc))
    return models, dropped


class TuneRow(_Model):
    """One workload at one block size: simulated capacity and predicted decode speed.

    ``throughput_tok_s`` (tokens/s) uses the median times, ``throughput_low_tok_s`` the
    p90 times and ``throughput_high_tok_s`` the p10 times; all three are null and
    ``refused`` says why when a decode step lies outside the measured range.
    ``attention_ms_per_step``: mean over decode steps of ``num_layers`` times the
    interpolated median kernel time (ms).
    """

    workload: str
    block_size: int
    policy: str
    mean_concurrency: float
    peak_concurrency: int
    waste_pct: float
    preempted: int
    steps: int
    decode_steps: int
    decode_tokens: int
    mean_sequences: float
    max_sequences: int
    mean_kv_tokens: float
    max_kv_tokens: int
    attention_ms_per_step: Optional[float]
    throughput_tok_s: Optional[float]
    throughput_low_tok_s: Optional[float]
    throughput_high_tok_s: Optional[float]
    refused: Optional[str]


class Recommendation(_Model):
    """The block size of one workload: highest median throughput, the runner-up, the
    margin (``100 * (best / runner_up - 1)``, %), and whether it ``holds`` under the
    measurement spread (best at p90 times >= runner-up at p10 times)."""

    workload: str
    block_size: Optional[int]
    throughput_tok_s: Optional[float]
    runner_up_block_size: Optional[int]
    margin_pct: Optional[float]
    holds: Optional[bool]
    serving: Literal["cpu", "gpu"]
    text: str


class TuneReport(_Model):
    """Everything ``pagedbench tune`` found (``tune.json``)."""

    kind: Literal["tune"]
    schema_version: Literal[1]
    preset: str
    num_layers: int
    kv_cache_dtype: str
    kv_bytes_per_token: int
    kv_budget_gib: float
    kv_budget_tokens: int
    impl: str
    impl_version: str
    serving: Literal["cpu", "gpu"]
    env: Environment
    other_ms_per_step: float
    block_sizes: list[int]
    dropped_block_sizes: list[str]
    workloads: dict[str, str]
    num_requests: int
    seed: int
    points: list[KernelPoint]
    results: list[str]
    rows: list[TuneRow]
    recommendations: list[Recommendation]
    conditions: list[str]


def predict(workload: str, result: PolicyResult, steps: Sequence[DecodeStep],
            model: KernelModel | None, num_layers: int, other_ms_per_step: float,
            refused: str | None = None) -> TuneRow:
    """The :class:`TuneRow` of one simulation: its decode steps timed by ``model``.

    Each step costs ``num_layers * t + other_ms_per_step`` ms with ``t`` interpolated;
    ``model`` None (no measured points at this block size) refuses the row with
    ``refused``, as does a step outside the measured range.
    """
    counts = Counter((s.sequences, s.kv_tokens) for s in steps)
    batches = np.array(list(counts), dtype=np.int64).reshape(-1, 2)  # [distinct, 2]
    weight = np.array(list(counts.values()), dtype=np.float64)  # steps per distinct batch
    tokens = int((batches[:, 0] * weight).sum())
    throughputs: list[float | None] = [None, None, None]
    per_step = None
    if model is not None and len(batches):
        try:
            times = model.times_ms(batches[:, 0], batches[:, 1])  # [distinct, 3]
        except OutOfMeasuredRange as exc:
            refused = str(exc)
        else:
            step_ms = num_layers * times + other_ms_per_step
            total_s = (step_ms * weight[:, None]).sum(axis=0) / 1000.0  # [3]
            throughputs = [float(tokens / s) for s in total_s]
            per_step = float((num_layers * times[:, 0] * weight).sum() / weight.sum())
    elif model is not None:
        refused = "no decode step"
    n = max(weight.sum(), 1.0)
    return TuneRow(
        workload=workload, block_size=result.block_size, policy=result.policy,
        mean_concurrency=result.mean_concurrency, peak_concurrency=result.peak_concurrency,
        waste_pct=result.waste_pct, preempted=result.preempted, steps=result.steps,
        decode_steps=int(weight.sum()), decode_tokens=tokens,
        mean_sequences=float((batches[:, 0] * weight).sum() / n),
        max_sequences=int(batches[:, 0].max(initial=0)),
        mean_kv_tokens=float((batches[:, 1] * weight).sum() / n),
        max_kv_tokens=int(batches[:, 1].max(initial=0)),
        attention_ms_per_step=per_step, throughput_tok_s=throughputs[0],
        throughput_low_tok_s=throughputs[2], throughput_high_tok_s=throughputs[1],
        refused=refused)


def recommend(rows: Sequence[TuneRow], serving: Literal["cpu", "gpu"]) -> Recommendation:
    """The :class:`Recommendation` from one workload's rows (those not refused)."""
    workload = rows[0].workload
    ranked = sorted((r for r in rows if r.throughput_tok_s is not None),
                    key=lambda r: (-r.throughput_tok_s, r.block_size))
    where = "CPU serving" if serving == "cpu" else "GPU serving"
    if not ranked:
        return Recommendation(workload=workload, block_size=None, throughput_tok_s=None,
                              runner_up_block_size=None, margin_pct=None, holds=None,
                              serving=serving, text=f"{workload}: no block size could be "
                              "predicted (every row refused)")
    best = ranked[0]
    text = (f"{workload}: block_size {best.block_size} for {where}, "
            f"{best.throughput_tok_s:.4g} tokens/s")
    if len(ranked) == 1:
        return Recommendation(workload=workload, block_size=best.block_size,
                              throughput_tok_s=best.throughput_tok_s, runner_up_block_size=None,
                              margin_pct=None, holds=None, serving=serving,
                              text=text + " (the only block size predicted)")
    second = ranked[1]
    margin = 100.0 * (best.throughput_tok_s / second.throughput_tok_s - 1.0)
    holds = best.throughput_low_tok_s >= second.throughput_high_tok_s
    text += (f", {margin:.1f}% over block_size {second.block_size}; "
             + ("holds across the timings' p10-p90 spread" if holds else
                "within the timings' p10-p90 spread (not a clear winner)"))
    return Recommendation(workload=workload, block_size=best.block_size,
                          throughput_tok_s=best.throughput_tok_s,
                          runner_up_block_size=second.block_size, margin_pct=margin,
                          holds=holds, serving=serving, text=text)


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


def conditions(report_fields: dict, workloads: dict[str, str], sharing: dict[str, bool],
               models: dict[int, KernelModel]) -> list[str]:
    """What the recommendations assume, one sentence each (printed and in the JSON)."""
    f = report_fields
    env: Environment = f["env"]
    where = ("CPU serving: timings of a CPU; they say nothing of a GPU"
             if f["serving"] == "cpu" else "GPU serving: timings of this GPU only")
    lines = [
        f"{where} ({f['impl']} {f['impl_version']} on {env.device}, {env.threads} "
        f"thread(s), torch {env.torch})",
        f"model {f['preset']}: {f['num_layers']} layers, KV {f['kv_cache_dtype']} "
        f"({f['kv_bytes_per_token'] // 1024} KiB per token); KV budget "
        f"{f['kv_budget_gib']:g} GiB = {f['kv_budget_tokens']} tokens",
        f"{f['num_requests']} requests per workload (seed {f['seed']}), all queued at step 0; "
        "continuous batching, preemption by recomputation (reference/simulator.py)",
        "decode attention only: each decode step costs num_layers x the kernel's time at "
        "its (sequences, KV tokens), interpolated between measured points, never "
        "extrapolated" + (f", plus {f['other_ms_per_step']:g} ms per step for the rest of "
                          "the model (--other-ms-per-step)" if f["other_ms_per_step"] else
                          "; prefill, the model's GEMMs and sampling are not counted"),
    ]
    shared = [w for w, s in sharing.items() if s]
    if shared:
        lines.append(f"prefix caching of full blocks and forked samples (Paged+share) for "
                     f"{', '.join(shared)}")
    lines += [f"measured at block_size {bs}: {m.range_text()}" for bs, m in models.items()]
    return lines


# Output -------------------------------------------------------------------------------
TABLE_COLUMNS = {
    "workload": "workload", "block_size": "block_size", "mean_concurrency": "mean conc.",
    "peak_concurrency": "peak conc.", "waste_pct": "waste %", "preempted": "preempted",
    "mean_sequences": "mean batch", "mean_kv_tokens": "mean KV tok",
    "attention_ms_per_step": "attn ms/step", "throughput_tok_s": "tok/s",
    "throughput_low_tok_s": "tok/s p90-time", "throughput_high_tok_s": "tok/s p10-time",
}


def table(report: TuneReport) -> str:
    """The rows as a Markdown table (a refused row shows ``refused`` in its figures)."""
    frame = pd.DataFrame([r.model_dump() for r in report.rows])
    shown = frame[list(TABLE_COLUMNS)].rename(columns=TABLE_COLUMNS).astype(object)
    for column in ("mean conc.", "waste %", "mean batch", "mean KV tok", "attn ms/step"):
        shown[column] = [("-" if v is None or pd.isna(v) else f"{v:.1f}") for v in shown[column]]
    for column in ("tok/s", "tok/s p90-time", "tok/s p10-time"):
        shown[column] = [("refused" if v is None or pd.isna(v) else f"{v:.4g}")
                         for v in shown[column]]
    return shown.to_markdown(index=False)


def plot(report: TuneReport, path: Path) -> None:
    """Write the PNG: predicted decode throughput (p10-p90 band) and mean concurrency
    against block size (log2 axis), one line per workload; the recommended block size of
    each workload ringed."""
    fig = Figure(figsize=(12, 4.8), layout="constrained")
    left, right = fig.subplots(1, 2)
    frame = pd.DataFrame([r.model_dump() for r in report.rows])
    best = {r.workload: r.block_size for r in report.recommendations}
    for workload, group in frame.groupby("workload", sort=False):
        timed = group[group["throughput_tok_s"].notna()]
        line, = left.plot(timed["block_size"], timed["throughput_tok_s"], marker="o",
                          label=workload)
        left.fill_between(timed["block_size"], timed["throughput_low_tok_s"].astype(float),
                          timed["throughput_high_tok_s"].astype(float), alpha=0.2,
                          color=line.get_color())
        chosen = timed[timed["block_size"] == best.get(workload)]
        left.scatter(chosen["block_size"], chosen["throughput_tok_s"], s=160,
                     facecolors="none", edgecolors=line.get_color(), linewidths=2)
        right.plot(group["block_size"], group["mean_concurrency"], marker="o", label=workload,
                   color=line.get_color())
    sizes = sorted(frame["block_size"].unique())
    for ax, label, title in (
            (left, "predicted decode tokens/s (attention only)",
             "Decode throughput vs block size (band: p10-p90 timings; ring: chosen)"),
            (right, "mean concurrent requests", "Concurrency vs block size")):
        ax.set_xscale("log", base=2)
        ax.set_xticks([int(b) for b in sizes], [str(int(b)) for b in sizes])
        ax.set_ylim(bottom=0)
        ax.set_xlabel("block_size (tokens)")
        ax.set_ylabel(label)
        ax.set_title(title, fontsize="medium")
        ax.legend(fontsize="small")
    fig.suptitle(f"pagedbench tune: {report.preset}, {report.impl} on {report.env.device} "
                 f"({report.serving.upper()} serving), KV budget {report.kv_budget_gib:g} GiB",
                 fontsize="medium")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)


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
                        help="generated workload (repeatable; default: all of "
                             f"{', '.join(WORKLOADS)})")
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
    names = args.workload or ([] if args.trace else list(WORKLOADS))
    for name in dict.fromkeys(names):
        w = WORKLOADS[name]
        chosen[name] = (w.description, w.trace(args.num_requests, args.seed), w.max_context)
    for path in args.trace:
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
    for name, (_, trace, max_context) in workloads.items():
        for bs in block_sizes:
            sims[name, bs] = simulate_decode(trace, bs, budget_tokens, max_context, args.seed)
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
                            refused=None if bs in models else f"block_size {bs}: not measured"))
    recommendations = [recommend([r for r in rows if r.workload == name], serving)
                       for name in workloads]
    fields = dict(kind="tune", schema_version=TUNE_SCHEMA_VERSION, preset=preset.name,
                  num_layers=preset.num_layers, kv_cache_dtype=args.dtype,
                  kv_bytes_per_token=per_token, kv_budget_gib=float(args.kv_budget_gib),
                  kv_budget_tokens=budget_tokens, impl=args.impl, impl_version=version,
                  serving=serving, env=env, other_ms_per_step=float(args.other_ms_per_step),
                  block_sizes=list(block_sizes), dropped_block_sizes=dropped,
                  workloads={n: d for n, (d, _, _) in workloads.items()},
                  num_requests=args.num_requests, seed=args.seed,
                  points=sorted(points, key=lambda p: (p.block_size, p.sequences, p.kv_tokens)),
                  results=sources, rows=rows, recommendations=recommendations)
    sharing = {n: any(r.n > 1 or r.prefix_id is not None for r in t)
               for n, (_, t, _) in workloads.items()}
    report = TuneReport(**fields, conditions=conditions(fields, fields["workloads"], sharing,
                                                        models))
    write(report, args.output_dir)
    if args.json:
        print(report.model_dump_json(indent=1))
    else:
        print(text(report))
    if any(r.block_size is None for r in recommendations):
        return int(ExitCode.USAGE_ERROR)
    return int(code)


def write(report: TuneReport, output_dir: Path) -> None:
    """Write ``tune.json`` and ``tune.png`` into ``output_dir``."""
    from pagedbench.harness.results.store import write_output

    output_dir.mkdir(parents=True, exist_ok=True)
    write_output(output_dir / JSON_NAME, report.model_dump_json(indent=1) + "\n")
    plot(report, output_dir / PLOT_NAME)


def text(report: TuneReport) -> str:
    """What ``pagedbench tune`` prints: the table, the recommendations, the conditions."""
    lines = [f"pagedbench tune: {report.preset} with {report.impl} on {report.env.device} "
             f"({report.serving.upper()} serving)", "", table(report), "", "recommended:"]
    lines += [f"  {r.text}" for r in report.recommendations]
    lines += ["", "conditions:"] + [f"  - {c}" for c in report.conditions]
    lines += [f"  - dropped: {d}" for d in report.dropped_block_sizes]
    refused = sorted({r.refused for r in report.rows if r.refused})
    lines += [f"  - refused: {r}" for r in refused]
    return "\n".join(lines)


__all__ = ["DEFAULT_BLOCK_SIZES", "WORKLOADS", "DecodeStep", "KernelModel", "KernelPoint",
           "OutOfMeasuredRange", "Recommendation", "TuneReport", "TuneRow", "TuneWorkload",
           "add_arguments", "batch_case", "bench_batches", "bench_cases", "kernel_models",
           "kernel_points", "predict", "recommend", "run", "simulate_decode", "table", "text"]
