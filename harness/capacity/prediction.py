"""What ``pagedbench tune`` predicts: decode throughput from simulated batches and kernel
times interpolated between measured points, and its typed records.

:func:`simulate_decode` replays a trace paged at one block size on the KV budget
(:func:`~pagedbench.reference.simulator.simulate`; prefix caching of full blocks when the
trace shares) and records every decode step's kernel batch: ``(sequences, kv_tokens)``.
:class:`KernelModel` interpolates the kernel's time at each step between measured points
(``pagedbench bench`` results of one device, :func:`kernel_points`), linearly over the
triangles of the measured ``(sequences, kv_tokens)`` points (scipy
``LinearNDInterpolator``): exact where the time is ``a + b * sequences + c * kv_tokens``,
as a memory-bound decode nearly is. A step outside the measured points' convex hull is
never extrapolated: its row is refused (:class:`OutOfMeasuredRange`). Predicted decode
throughput (:func:`predict`), tokens per second::

    decode_tokens / sum over decode steps of (num_layers * t(step) + other_ms_per_step)

with ``t`` the median, p10 and p90 of the measured times carried through the same
interpolation (the throughput's spread). The recommendation per workload
(:func:`recommend`) is the block size of highest median throughput, with its margin over
the runner-up; it ``holds`` when its p90-time throughput still beats the runner-up's
p10-time throughput. A recommendation is for the device its timings come from: results of
two devices are never mixed (:func:`kernel_points`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Optional

import numpy as np
from pydantic import BaseModel, ConfigDict

from pagedbench.reference import PagedValueError
from pagedbench.reference.kv_policies import LiveRequest, Policy
from pagedbench.reference.simulator import PolicyResult, simulate
from pagedbench.reference.workload import Request, shares

from pagedbench.harness.cases.presets import ModelPreset
from pagedbench.harness.results.record import Environment, ResultRecord
from pagedbench.harness.verdict.status import Status

#: ``TuneReport.schema_version``: changes whenever a field is added, removed or changes meaning.
TUNE_SCHEMA_VERSION = 2


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
    request has a ``prefix_id``, a ``parent`` or ``n > 1`` (:func:`shares`), else
    ``Paged`` (as ``pagedbench simulate``).

    Raises
    ------
    TraceError, CapacityError, PagedValueError
        As :func:`~pagedbench.reference.simulator.simulate`.
    """
    policy = Policy("Paged+share" if shares(trace) else "Paged", block_size)
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
        from scipy.interpolate import LinearNDInterpolator  # 0.6 s: not at the CLI's start

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
    interpolated median kernel time (ms). ``prefix_hit_tokens`` and ``prefill_tokens``:
    the simulation's (:class:`~pagedbench.reference.simulator.PolicyResult`); with a
    ``prefill_ms_per_token``, the prefill tokens' time counts in the throughput.
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
    prefix_hit_tokens: int
    prefill_tokens: int
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


class PrefixReuse(_Model):
    """Prefix reuse of one sharing workload: SGLang's radix tree (page size 1,
    ``Radix``) against block-hash prefix caching at the recommended block size (or the
    smallest simulated when none is recommended), on the same trace and budget.

    ``hit_gain_pct`` is ``100 * (tree / blocks - 1)`` of the prefix-hit tokens (null when
    the blocks hit none); ``prefill_saved_tokens`` the prefill tokens the tree computes
    fewer (negative: more); ``text`` says which wins and by how much.
    """

    workload: str
    block_size: int
    tree_prefix_hit_tokens: int
    block_prefix_hit_tokens: int
    tree_prefill_tokens: int
    block_prefill_tokens: int
    hit_gain_pct: Optional[float]
    prefill_saved_tokens: int
    tree_mean_concurrency: float
    text: str


class TuneReport(_Model):
    """Everything ``pagedbench tune`` found (``tune.json``)."""

    kind: Literal["tune"]
    schema_version: Literal[2]
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
    prefill_ms_per_token: float
    block_sizes: list[int]
    dropped_block_sizes: list[str]
    workloads: dict[str, str]
    num_requests: int
    seed: int
    points: list[KernelPoint]
    results: list[str]
    rows: list[TuneRow]
    recommendations: list[Recommendation]
    prefix_reuse: list[PrefixReuse]
    conditions: list[str]


def predict(workload: str, result: PolicyResult, steps: Sequence[DecodeStep],
            model: KernelModel | None, num_layers: int, other_ms_per_step: float,
            refused: str | None = None, prefill_ms_per_token: float = 0.0) -> TuneRow:
    """The :class:`TuneRow` of one simulation: its decode steps timed by ``model``.

    Each step costs ``num_layers * t + other_ms_per_step`` ms with ``t`` interpolated,
    and the run's prefill ``result.prefill_tokens * prefill_ms_per_token`` ms (so that
    prefix reuse counts); ``model`` None (no measured points at this block size) refuses
    the row with ``refused``, as does a step outside the measured range.
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
            prefill_ms = result.prefill_tokens * prefill_ms_per_token
            total_s = ((step_ms * weight[:, None]).sum(axis=0) + prefill_ms) / 1000.0  # [3]
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
        prefix_hit_tokens=result.prefix_hit_tokens, prefill_tokens=result.prefill_tokens,
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


def prefix_reuse(workload: str, tree: PolicyResult, rows: Sequence[TuneRow],
                 recommended: int | None) -> PrefixReuse:
    """The :class:`PrefixReuse` of ``workload``: the ``Radix`` page-1 simulation ``tree``
    against its row at ``recommended`` (else its smallest block size)."""
    row = next((r for r in rows if r.block_size == recommended),
               min(rows, key=lambda r: r.block_size))
    gain = (100.0 * (tree.prefix_hit_tokens / row.prefix_hit_tokens - 1.0)
            if row.prefix_hit_tokens else None)
    saved = row.prefill_tokens - tree.prefill_tokens
    if tree.prefix_hit_tokens > row.prefix_hit_tokens:
        verdict = (f"the radix tree (page 1) beats block_size {row.block_size}: "
                   f"{tree.prefix_hit_tokens} prefix-hit tokens against "
                   f"{row.prefix_hit_tokens}" + (f" (+{gain:.1f}%)" if gain is not None else ""))
    elif tree.prefix_hit_tokens == row.prefix_hit_tokens:
        verdict = (f"the radix tree (page 1) and block_size {row.block_size} hit the same "
                   f"{row.prefix_hit_tokens} prefix tokens")
    else:
        verdict = (f"block_size {row.block_size} beats the radix tree (page 1): "
                   f"{row.prefix_hit_tokens} prefix-hit tokens against "
                   f"{tree.prefix_hit_tokens} ({gain:.1f}%)")
    text = (f"{workload}: {verdict}; the tree computes {abs(saved)} "
            f"{'fewer' if saved >= 0 else 'more'} prefill tokens ({tree.prefill_tokens} "
            f"against {row.prefill_tokens})")
    return PrefixReuse(workload=workload, block_size=row.block_size,
                       tree_prefix_hit_tokens=tree.prefix_hit_tokens,
                       block_prefix_hit_tokens=row.prefix_hit_tokens,
                       tree_prefill_tokens=tree.prefill_tokens,
                       block_prefill_tokens=row.prefill_tokens, hit_gain_pct=gain,
                       prefill_saved_tokens=saved,
                       tree_mean_concurrency=tree.mean_concurrency, text=text)


__all__ = ["TUNE_SCHEMA_VERSION", "DecodeStep", "KernelModel", "KernelPoint",
           "OutOfMeasuredRange", "PrefixReuse", "Recommendation", "TuneReport", "TuneRow",
           "kernel_models", "kernel_points", "predict", "prefix_reuse", "recommend",
           "shares", "simulate_decode"]
