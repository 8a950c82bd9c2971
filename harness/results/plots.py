"""Plots of results (matplotlib, no display): one figure per question.

- ``latency_vs_batch``: median time (p10-p90 error bars) against batch size per
  implementation, for each (mode, heads, context, dtype) swept over batch size, at its
  smallest block size;
- ``gbps_vs_block_size`` and ``overhead_vs_block_size``: GB/s and paging overhead
  (:mod:`.derived`) against block size per implementation, one panel per workload;
- ``fast_p``: the share of workload groups on which an implementation is correct and
  more than p times as fast as the baseline, against p;
- ``gbps_by_case`` (results without a sweep, ``pagedbench run``): GB/s of each timed
  pass per case.

Inputs are one environment's :func:`~.derived.bench_frame` and
:func:`~.derived.group_scores` (or its timed passes, :func:`case_frame`); a figure
without data is left out. Every GB/s axis draws the measured copy bandwidth as its roof
when the results recorded one (``peaks``, ``pagedbench bench``'s device peaks). An
implementation has one colour on every figure and page (:func:`colour_of`); log axes are
labelled at 1, 2 and 5 of each decade (block sizes and batch sizes at their own values).
"""

from __future__ import annotations

import base64
import io
import zlib
from pathlib import Path

import numpy as np
import pandas as pd

from pagedbench.adapters import BUILTIN
from pagedbench.harness.results.derived import RANKED_METHODS

TITLES = {
    "latency_vs_batch": "Latency vs batch size",
    "gbps_vs_block_size": "GB/s vs block size",
    "overhead_vs_block_size": "Paging overhead vs block size",
    "fast_p": "fast_p: correct and faster than the baseline by p",
    "gbps_by_case": "GB/s per case",
}
#: Implementation colours: matplotlib's tab20 dark shades, then its light ones, then
#: tab20b's; the built-ins take them in leaderboard order, others by a hash of the name.
PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
           "#7f7f7f", "#bcbd22", "#17becf", "#393b79", "#637939", "#8c6d31", "#843c39",
           "#7b4173", "#aec7e8", "#ffbb78", "#98df8a", "#ff9896", "#c5b0d5", "#c49c94",
           "#f7b6d2", "#dbdb8d", "#9edae5", "#5254a3", "#8ca252", "#bd9e39", "#ad494a")
ROOF_COLOUR = "#444444"
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


def colour_of(impl: str) -> str:
    """The colour of ``impl`` on every plot and page (a hex string of :data:`PALETTE`)."""
    order = list(BUILTIN)
    index = order.index(impl) if impl in order else len(order) + zlib.crc32(impl.encode())
    return PALETTE[index % len(PALETTE)]


def _log_axis(axis, values=None) -> None:
    """Label a log axis readably: at ``values`` when given (block sizes, batch sizes),
    else at 1, 2 and 5 of each decade, as plain numbers."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter, NullLocator

    plain = FuncFormatter(lambda v, _: f"{v:g}")
    if values is not None:
        axis.set_major_locator(NullLocator())
        axis.set_ticks(sorted(set(values)))
    else:
        axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    axis.set_major_formatter(plain)
    axis.set_minor_formatter(NullFormatter())


def _roof(ax, copy_gbps: float | None) -> None:
    """The measured copy bandwidth as a dashed line, the roof no GB/s point can pass."""
    if copy_gbps:
        ax.axhline(copy_gbps, color=ROOF_COLOUR, linestyle="--", linewidth=1,
                   label=f"copy bandwidth {copy_gbps:.3g} GB/s")


def latency_vs_batch(bdf: pd.DataFrame) -> Figure | None:
    timed = bdf[bdf["timed"] & ~bdf["contiguous"]]
    groups = []
    for key, group in timed.groupby(["mode", "heads", "context", "dtype"], sort=False):
        group = group[group["block_size"] == group["block_size"].min()]
        if group["batch_size"].nunique() >= 2:
            groups.append((key, group))
    if not groups:
        return None
    fig, axes = _panels(min(len(groups), MAX_PANELS), TITLES["latency_vs_batch"])
    for ax, ((mode, heads, context, dtype), group) in zip(axes, groups):
        for impl, line in group.groupby("impl", sort=False):
            line = line.sort_values("batch_size")
            ax.errorbar(line["batch_size"], line["median_ms"],
                        yerr=[line["median_ms"] - line["p10_ms"],
                              line["p90_ms"] - line["median_ms"]],
                        marker="o", capsize=3, label=impl, color=colour_of(impl))
        ax.set(xscale="log", yscale="log", xlabel="batch size", ylabel="ms per call",
               title=f"{mode} h{heads} kv{context} {dtype} bs{group['block_size'].iloc[0]}")
        _log_axis(ax.xaxis, group["batch_size"])
        _log_axis(ax.yaxis)
        ax.grid(True, which="major", alpha=0.3)
        ax.legend(fontsize=7)
    return fig


def _vs_block_size(bdf: pd.DataFrame, column: str, ylabel: str, name: str,
                   copy_gbps: float | None = None) -> Figure | None:
    paged = bdf[bdf["timed"] & ~bdf["contiguous"] & bdf[column].notna()]
    workloads = [w for w, g in paged.groupby(["workload", "dtype"], sort=False)
                 if g["block_size"].nunique() >= 2]
    if not workloads:
        return None
    fig, axes = _panels(min(len(workloads), MAX_PANELS), TITLES[name])
    for ax, (workload, dtype) in zip(axes, workloads):
        mine = paged[(paged["workload"] == workload) & (paged["dtype"] == dtype)]
        for impl, line in mine.groupby("impl", sort=False):
            line = line.sort_values("block_size")
            values = line[column] * (100 if column == "paging_overhead" else 1)
            ax.plot(line["block_size"], values, marker="o", label=impl, color=colour_of(impl))
        if column == "paging_overhead":
            ax.axhline(0, color="grey", linewidth=0.8)
        else:
            ax.set_yscale("log")
            _log_axis(ax.yaxis)
            _roof(ax, copy_gbps)
        ax.set_xscale("log", base=2)
        _log_axis(ax.xaxis, mine["block_size"])
        ax.grid(True, which="major", alpha=0.3)
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
        ax.step(ps, share, where="post", label=impl, color=colour_of(impl))
    ax.axvline(1.0, color="grey", linewidth=0.8, linestyle="--")
    ax.set(xlabel="p (speedup over the baseline)", ylabel="fast_p", ylim=(-0.02, 1.02))
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    return fig


def case_frame(records) -> pd.DataFrame:
    """The timed, ranked passes of ``records`` (one environment) with a GB/s figure:
    ``case_id``, ``label`` (preset or workload, dtype, block size, batch), ``impl``,
    ``bandwidth_gbps``, in order of appearance."""
    rows = []
    for r in records:
        if (str(r.status) == "pass" and r.time_ms is not None and not r.interpreted
                and r.time_ms.method in RANKED_METHODS and r.bandwidth_gbps):
            case = r.paged_case()
            rows.append({"case_id": r.case_id, "impl": r.impl,
                         "label": f"{r.workload or case.name} {case.dtype} "
                                  f"bs{case.block_size} b{case.batch_size}",
                         "bandwidth_gbps": r.bandwidth_gbps})
    return pd.DataFrame(rows, columns=["case_id", "label", "impl", "bandwidth_gbps"])


def gbps_by_case(cases: pd.DataFrame, copy_gbps: float | None = None) -> Figure | None:
    """GB/s of each implementation (a marker each) on each case (one column each), with
    the roof when measured."""
    if cases.empty:
        return None
    order = list(dict.fromkeys(cases["case_id"]))
    labels = dict(zip(cases["case_id"], cases["label"]))
    fig, (ax,) = _panels(1, TITLES["gbps_by_case"])
    fig.set_size_inches(max(6.0, 0.3 * len(order) + 2), 5.2)
    for impl, mine in cases.groupby("impl", sort=False):
        ax.plot([order.index(c) for c in mine["case_id"]], mine["bandwidth_gbps"], "o",
                label=impl, color=colour_of(impl), markersize=5)
    _roof(ax, copy_gbps)
    ax.set_yscale("log")
    _log_axis(ax.yaxis)
    ax.set_xticks(range(len(order)), [labels[c] for c in order], rotation=90, fontsize=7)
    ax.set(ylabel="GB/s", xlim=(-0.6, len(order) - 0.4))
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=7, ncols=2)
    return fig


def figures(bdf: pd.DataFrame, scores: pd.DataFrame, copy_gbps: float | None = None,
            cases: pd.DataFrame | None = None) -> dict[str, Figure]:
    """The figures of :data:`TITLES` that have data, by name: those of a sweep from
    ``bdf`` and ``scores``; ``gbps_by_case`` from ``cases`` (:func:`case_frame`) when
    there is no sweep. ``copy_gbps``: the measured copy bandwidth, the GB/s roof."""
    if bdf.empty and cases is not None:
        made = {"gbps_by_case": gbps_by_case(cases, copy_gbps)}
        return {name: fig for name, fig in made.items() if fig is not None}
    made = {
        "latency_vs_batch": latency_vs_batch(bdf),
        "gbps_vs_block_size": _vs_block_size(bdf, "bandwidth_gbps", "GB/s",
                                             "gbps_vs_block_size", copy_gbps),
        "overhead_vs_block_size": _vs_block_size(bdf, "paging_overhead", "overhead (%)",
                                                 "overhead_vs_block_size"),
        "fast_p": fast_p_curve(scores) if not scores.empty else None,
    }
    return {name: fig for name, fig in made.items() if fig is not None}


def png_base64(fig: Figure) -> str:
    """``fig`` as a PNG (110 dpi), base64 text for a ``data:`` URL."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110)
    return base64.b64encode(buffer.getvalue()).decode()


def save(bdf: pd.DataFrame, scores: pd.DataFrame, folder: Path, prefix: str = "",
         copy_gbps: float | None = None) -> list[Path]:
    """Write each figure of a sweep as ``<folder>/<prefix><name>.png``; the paths
    written."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, fig in figures(bdf, scores, copy_gbps).items():
        path = folder / f"{prefix}{name}.png"
        fig.savefig(path, dpi=100)
        paths.append(path)
    return paths


__all__ = ["MAX_PANELS", "PALETTE", "TITLES", "case_frame", "colour_of", "figures",
           "gbps_by_case", "png_base64", "save"]
