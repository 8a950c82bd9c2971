"""Plots of a benchmark sweep (matplotlib, no display): one figure per question.

- ``latency_vs_batch``: median time (p10-p90 error bars) against batch size per
  implementation, for each (mode, heads, context, dtype) swept over batch size, at its
  smallest block size;
- ``gbps_vs_block_size`` and ``overhead_vs_block_size``: GB/s and paging overhead
  (:mod:`.derived`) against block size per implementation, one panel per workload;
- ``fast_p``: the share of workload groups on which an implementation is correct and
  more than p times as fast as the baseline, against p.

Inputs are one environment's :func:`~.derived.bench_frame` and
:func:`~.derived.group_scores`; a figure without data is left out.
"""

from __future__ import annotations

import base64
import io
from pathlib import Path

import numpy as np
import pandas as pd

TITLES = {
    "latency_vs_batch": "Latency vs batch size",
    "gbps_vs_block_size": "GB/s vs block size",
    "overhead_vs_block_size": "Paging overhead vs block size",
    "fast_p": "fast_p: correct and faster than the baseline by p",
}
#: Most panels of one figure (workloads beyond it are in the tables only).
MAX_PANELS = 12


def _panels(count: int, title: str) -> tuple[Figure, list]:
    columns = min(count, 3)
    rows = -(-count // columns)
    from matplotlib.figure import Figure  # drawn only by report: the CLI starts without it

    fig = Figure(figsize=(4.2 * columns, 3.2 * rows), layout="constrained")
    axes = fig.subplots(rows, columns, squeeze=False).ravel()
    for ax in axes[count:]:
        ax.set_visible(False)
    fig.suptitle(title)
    return fig, list(axes[:count])


def _colours(impls: list[str]) -> dict[str, str]:
    return {impl: f"C{i % 10}" for i, impl in enumerate(impls)}


def latency_vs_batch(bdf: pd.DataFrame) -> Figure | None:
    timed = bdf[bdf["timed"] & ~bdf["contiguous"]]
    groups = []
    for key, group in timed.groupby(["mode", "heads", "context", "dtype"], sort=False):
        group = group[group["block_size"] == group["block_size"].min()]
        if group["batch_size"].nunique() >= 2:
            groups.append((key, group))
    if not groups:
        return None
    colour = _colours(list(dict.fromkeys(timed["impl"])))
    fig, axes = _panels(min(len(groups), MAX_PANELS), TITLES["latency_vs_batch"])
    for ax, ((mode, heads, context, dtype), group) in zip(axes, groups):
        for impl, line in group.groupby("impl", sort=False):
            line = line.sort_values("batch_size")
            ax.errorbar(line["batch_size"], line["median_ms"],
                        yerr=[line["median_ms"] - line["p10_ms"],
                              line["p90_ms"] - line["median_ms"]],
                        marker="o", capsize=3, label=impl, color=colour[impl])
        ax.set(xscale="log", yscale="log", xlabel="batch size", ylabel="ms per call",
               title=f"{mode} h{heads} kv{context} {dtype} bs{group['block_size'].iloc[0]}")
        ax.legend(fontsize=7)
    return fig


def _vs_block_size(bdf: pd.DataFrame, column: str, ylabel: str, name: str) -> Figure | None:
    paged = bdf[bdf["timed"] & ~bdf["contiguous"] & bdf[column].notna()]
    workloads = [w for w, g in paged.groupby(["workload", "dtype"], sort=False)
                 if g["block_size"].nunique() >= 2]
    if not workloads:
        return None
    colour = _colours(list(dict.fromkeys(paged["impl"])))
    fig, axes = _panels(min(len(workloads), MAX_PANELS), TITLES[name])
    for ax, (workload, dtype) in zip(axes, workloads):
        mine = paged[(paged["workload"] == workload) & (paged["dtype"] == dtype)]
        for impl, line in mine.groupby("impl", sort=False):
            line = line.sort_values("block_size")
            values = line[column] * (100 if column == "paging_overhead" else 1)
            ax.plot(line["block_size"], values, marker="o", label=impl, color=colour[impl])
        if column == "paging_overhead":
            ax.axhline(0, color="grey", linewidth=0.8)
        ax.set_xscale("log", base=2)
        ax.set(xlabel="block size (tokens)", ylabel=ylabel, title=f"{workload} {dtype}")
        ax.title.set_fontsize(8)
        ax.legend(fontsize=7)
    return fig


def fast_p_curve(scores: pd.DataFrame) -> Figure | None:
    scored = scores[scores["points"] > 0]
    if scored.empty:
        return None
    groups = scored["workload"].unique()
    top = max(2.0, float(np.nanmax(scored["score"].to_numpy(dtype=float))) * 1.1)
    ps = np.linspace(0, top, 400)
    fig, (ax,) = _panels(1, TITLES["fast_p"])
    for impl, mine in scores.groupby("impl", sort=False):
        by_group = mine.set_index("workload").reindex(groups)
        ok = by_group["correct"].fillna(False).astype(bool).to_numpy()
        values = by_group["score"].to_numpy(dtype=float)
        share = [float(np.mean(ok & (np.nan_to_num(values, nan=-1.0) > p))) for p in ps]
        ax.step(ps, share, where="post", label=impl)
    ax.axvline(1.0, color="grey", linewidth=0.8, linestyle="--")
    ax.set(xlabel="p (speedup over the baseline)", ylabel="fast_p", ylim=(-0.02, 1.02))
    ax.legend(fontsize=7)
    return fig


def figures(bdf: pd.DataFrame, scores: pd.DataFrame) -> dict[str, Figure]:
    """The figures of :data:`TITLES` that have data, by name."""
    made = {
        "latency_vs_batch": latency_vs_batch(bdf),
        "gbps_vs_block_size": _vs_block_size(bdf, "bandwidth_gbps", "GB/s",
                                             "gbps_vs_block_size"),
        "overhead_vs_block_size": _vs_block_size(bdf, "paging_overhead", "overhead (%)",
                                                 "overhead_vs_block_size"),
        "fast_p": fast_p_curve(scores) if not scores.empty else None,
    }
    return {name: fig for name, fig in made.items() if fig is not None}


def png_base64(fig: Figure) -> str:
    """``fig`` as a PNG (100 dpi), base64 text for a ``data:`` URL."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100)
    return base64.b64encode(buffer.getvalue()).decode()


def save(bdf: pd.DataFrame, scores: pd.DataFrame, folder: Path, prefix: str = "") -> list[Path]:
    """Write each figure as ``<folder>/<prefix><name>.png``; the paths written."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, fig in figures(bdf, scores).items():
        path = folder / f"{prefix}{name}.png"
        fig.savefig(path, dpi=100)
        paths.append(path)
    return paths


__all__ = ["MAX_PANELS", "TITLES", "figures", "png_base64", "save"]
