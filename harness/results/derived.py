"""Figures derived from a benchmark sweep's results: paging overhead, speedup, scores.

:func:`bench_frame` has one row per bench result (``suite == "bench"``; of each
:func:`~.record.result_key` the one measured last, :func:`~.record.latest`), in the
environment it was measured in (device name and library versions,
:func:`~.record.environment_key`), with these derived columns:

- ``paging_overhead``: ``median / median_contiguous - 1`` against the same
  implementation's run of the same workload and dtype at the smallest block size holding
  every sequence in one block (a ``contig`` point of the sweep), or, when it has none that passed, the
  baseline's (``overhead_vs`` names which); the interval ``[p10 / ref p90 - 1,
  p90 / ref p10 - 1]`` is its spread.
- ``speedup``: the baseline's median on the same point over this one's (> 1: faster).

Only timed passes have figures (a fast wrong kernel is not on the board, nor a time the
physical floor refuses: :func:`~.floor.judged`); interpreted timings are never ranked. Scores follow flashinfer-bench's rule: an implementation that
fails any case of a workload group (``fail``, ``error``, ``crash``, ``timeout``) scores 0
for that group; otherwise the group's score is the geometric mean of its speedups.
``fast_p`` (KernelBench, arXiv:2502.10517) is the share of workload groups on which an
implementation is correct and its score exceeds ``p``. :func:`trace_times` gives a batch
trace's time per step and in total (``pagedbench bench --trace``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import pandas as pd

from pagedbench.harness.cases.workloads import BENCH_SUITE, DEFAULT_BASELINE
from pagedbench.harness.results.record import ResultRecord, environment_key, latest
from pagedbench.harness.verdict.status import Status

#: Thresholds of the fast_p table (speedup over the baseline).
FAST_P = (0.0, 0.5, 0.8, 1.0, 1.25, 1.5, 2.0)
#: Timing methods that rank (an interpreter's wall clock never does).
RANKED_METHODS = ("torch_timer", "cuda_events", "cuda_graph", "perf_counter")

COLUMNS = ["device_name", "versions", "impl", "impl_version", "workload", "mode", "dtype",
           "block_size", "contiguous", "batch_size", "context", "heads", "case_id", "status",
           "failing", "timed", "median_ms", "p10_ms", "p90_ms", "iqr_ms", "n", "noisy",
           "method", "bandwidth_gbps", "tflops", "frac_of_roofline"]


def _row(r: ResultRecord) -> dict[str, object]:
    case = r.paged_case()
    t = r.time_ms
    timed = (r.status is Status.PASS and t is not None and t.method in RANKED_METHODS
             and not r.interpreted)
    device_name, versions = environment_key(r)
    return {
        "device_name": device_name, "versions": versions, "impl": r.impl,
        "impl_version": r.impl_version, "workload": r.workload, "mode": r.bench_mode,
        "dtype": case.dtype, "block_size": case.block_size,
        "contiguous": case.max_blocks_per_seq == 1, "batch_size": case.batch_size,
        "context": max(case.kv_lens), "heads": f"{case.num_q_heads}/{case.num_kv_heads}",
        "case_id": r.case_id, "status": str(r.status), "failing": r.status.failing,
        "timed": timed,
        "median_ms": t.median if timed else np.nan, "p10_ms": t.p10 if timed else np.nan,
        "p90_ms": t.p90 if timed else np.nan,
        "iqr_ms": t.iqr if timed and t.iqr is not None else np.nan,
        "n": t.n if timed else 0, "noisy": bool(t.noisy) if timed else False,
        "method": t.method if t is not None else None,
        "bandwidth_gbps": r.bandwidth_gbps if timed else np.nan,
        "tflops": r.tflops if timed else np.nan,
        "frac_of_roofline": r.frac_of_roofline if timed else np.nan,
    }


def bench_frame(records: Iterable[ResultRecord], baseline: str = DEFAULT_BASELINE
                ) -> pd.DataFrame:
    """One row per bench result, with :data:`COLUMNS` plus ``paging_overhead``,
    ``overhead_low``, ``overhead_high``, ``overhead_vs`` and ``speedup`` (see the module
    docstring); empty (with those columns) when no record is a bench result."""
    bench = latest(r for r in records if r.suite == BENCH_SUITE)
    df = pd.DataFrame([_row(r) for r in bench.values()], columns=COLUMNS)
    group = ["device_name", "versions", "workload", "dtype"]
    contiguous = df[df["contiguous"] & df["timed"]].sort_values("block_size").drop_duplicates(
        [*group, "impl"])
    ref = contiguous[[*group, "impl", "median_ms", "p10_ms", "p90_ms"]].rename(columns={
        "median_ms": "ref_median", "p10_ms": "ref_p10", "p90_ms": "ref_p90"})
    own = df.merge(ref, on=[*group, "impl"], how="left")
    base_ref = ref[ref["impl"] == baseline].drop(columns="impl")
    fallback = df.merge(base_ref, on=group, how="left")
    use_own = own["ref_median"].notna()
    for col in ("ref_median", "ref_p10", "ref_p90"):
        df[col] = own[col].where(use_own, fallback[col]).to_numpy()
    df["overhead_vs"] = np.where(use_own, df["impl"], np.where(
        fallback["ref_median"].notna(), baseline, None))
    df["paging_overhead"] = df["median_ms"] / df["ref_median"] - 1
    df["overhead_low"] = df["p10_ms"] / df["ref_p90"] - 1
    df["overhead_high"] = df["p90_ms"] / df["ref_p10"] - 1
    base = df[(df["impl"] == baseline) & df["timed"]][
        ["device_name", "versions", "case_id", "median_ms"]].rename(
        columns={"median_ms": "baseline_ms"})
    df = df.merge(base, on=["device_name", "versions", "case_id"], how="left")
    df["speedup"] = df["baseline_ms"] / df["median_ms"]
    return df.drop(columns=["ref_median", "ref_p10", "ref_p90", "baseline_ms"])


def group_scores(df: pd.DataFrame) -> pd.DataFrame:
    """Per (device_name, versions, workload, impl): ``correct`` (no failing case in the
    group), ``score`` (0 when not correct, else the geometric mean of the group's
    speedups; NaN when none was timed against the baseline) and ``points`` (timed)."""
    keys = ["device_name", "versions", "workload", "impl"]

    def score(group: pd.DataFrame) -> pd.Series:
        correct = not group["failing"].any()
        speedups = group["speedup"].dropna()
        value = (0.0 if not correct else float(np.exp(np.log(speedups).mean()))
                 if len(speedups) else np.nan)
        return pd.Series({"correct": correct, "score": value, "points": len(speedups)})

    if df.empty:
        return pd.DataFrame(columns=[*keys, "correct", "score", "points"])
    return df.groupby(keys, sort=False)[["failing", "speedup"]].apply(score).reset_index()


def fast_p(scores: pd.DataFrame, thresholds: Sequence[float] = FAST_P) -> pd.DataFrame:
    """Rows (device_name, versions, impl) x columns ``p``: the share of the environment's
    scored workload groups (those with a baseline timing) where the implementation is
    correct and its score exceeds ``p``; a group it has no score on counts as not fast."""
    rows = []
    for (device, versions), env in scores.groupby(["device_name", "versions"], sort=False):
        groups = env[env["points"] > 0]["workload"].unique()
        if len(groups) == 0:
            continue
        for impl, mine in env.groupby("impl", sort=False):
            by_group = mine.set_index("workload")["score"].reindex(groups)
            correct = mine.set_index("workload")["correct"].reindex(groups).fillna(False)
            rows.append({"device_name": device, "versions": versions, "impl": impl,
                         **{p: float(((by_group > p) & correct.astype(bool)).mean())
                            for p in thresholds}})
    return pd.DataFrame(rows, columns=["device_name", "versions", "impl", *thresholds])


def trace_times(records: Iterable[ResultRecord], steps: Sequence[str]) -> pd.DataFrame:
    """The times of a batch trace: for each block size and dtype the trace's workloads
    were paged at, one row per step (``steps``: the workload names, in trace order) with
    each implementation's median ms (NaN where it is not a timed pass), then a ``total``
    row: the sum of the steps' medians, NaN for an implementation with a step not timed.

    Returns
    -------
    pandas.DataFrame
        Columns ``block_size``, ``dtype``, ``step`` and one per implementation (in the
        order they appear); empty when no record is of a step.
    """
    df = bench_frame(records)
    df = df[df["workload"].isin(steps)]
    if df.empty:
        return pd.DataFrame(columns=["block_size", "dtype", "step"])
    impls = list(dict.fromkeys(df["impl"]))
    tables = []
    for (block_size, dtype), group in df.groupby(["block_size", "dtype"], sort=False):
        table = group.pivot_table(index="workload", columns="impl", values="median_ms",
                                  aggfunc="first", dropna=False).reindex(index=list(steps),
                                                                         columns=impls)
        table.loc["total"] = table.sum(skipna=False)
        tables.append(table.rename_axis("step").reset_index().assign(
            block_size=block_size, dtype=dtype))
    out = pd.concat(tables, ignore_index=True)
    return out[["block_size", "dtype", "step", *impls]]


__all__ = ["FAST_P", "RANKED_METHODS", "bench_frame", "fast_p", "group_scores", "trace_times"]
