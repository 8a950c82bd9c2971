"""What ``pagedbench simulate`` prints and writes (:mod:`~.simulate`): the policy table
(pandas), and the plot (matplotlib, PNG) of the share of reserved KV memory holding
tokens per policy and of concurrency against block size."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

import pandas as pd

from pagedbench.reference.kv_policies import CONTIGUOUS_POLICIES
from pagedbench.reference.simulator import PolicyResult

#: Table columns, in order, with the headers printed to the terminal.
TABLE_COLUMNS = {
    "policy": "policy",
    "block_size": "block_size",
    "utilization_pct": "tokens % reserved",
    "waste_pct": "waste %",
    "reservation_waste_pct": "reservation %",
    "fragmentation_pct": "fragmentation %",
    "peak_concurrency": "peak conc.",
    "mean_concurrency": "mean conc.",
    "concurrency_ratio": "conc. / Max",
    "throughput_ratio": "req/step / Max",
    "waited": "waited",
    "preempted": "preempted",
    "recomputed_tokens": "recomputed tok",
    "prefix_hit_tokens": "prefix hit tok",
    "prefill_tokens": "prefill tok",
    "cow_copies": "CoW copies",
    "steps": "steps",
}



def results_frame(results: Sequence[PolicyResult]) -> pd.DataFrame:
    """The policy table: one row per result, columns :data:`TABLE_COLUMNS` (raw names).

    Parameters
    ----------
    results : Sequence[PolicyResult]
        From :func:`~pagedbench.reference.simulator.compare_policies`.

    Returns
    -------
    pandas.DataFrame
        ``block_size`` is a nullable integer (``<NA>`` for contiguous policies).
    """
    frame = pd.DataFrame([dataclasses.asdict(r) for r in results])
    frame["block_size"] = frame["block_size"].astype("Int64")
    return frame


def format_table(frame: pd.DataFrame) -> str:
    """The policy table as aligned text, percentages and ratios to one or two decimals."""
    shown = frame[list(TABLE_COLUMNS)].rename(columns=TABLE_COLUMNS)
    shown["block_size"] = [("-" if pd.isna(v) else str(v)) for v in shown["block_size"]]
    return shown.to_string(
        index=False,
        formatters={
            TABLE_COLUMNS[c]: (lambda v: "-" if pd.isna(v) else f"{v:.1f}")
            for c in ("utilization_pct", "waste_pct", "reservation_waste_pct",
                      "fragmentation_pct", "mean_concurrency")
        }
        | {
            TABLE_COLUMNS[c]: (lambda v: "-" if pd.isna(v) else f"{v:.2f}")
            for c in ("concurrency_ratio", "throughput_ratio")
        },
    )


def plot_capacity(frame: pd.DataFrame, path: Path, title: str) -> None:
    """Write the PNG: stacked utilization per policy, and concurrency vs block size.

    Left: for each policy, the reserved KV memory split into slots holding tokens,
    reservation waste and internal fragmentation (% of reserved). Right: mean concurrent
    requests of each paged policy against block size (log2 axis), with the contiguous
    policies as horizontal lines.

    Parameters
    ----------
    frame : pandas.DataFrame
        From :func:`results_frame`.
    path : Path
        PNG file to write (its folder is created).
    title : str
        Figure title (model, budget, trace).
    """
    from matplotlib.figure import Figure  # drawn only with --plot: the CLI starts without it

    fig = Figure(figsize=(13, 5.5), layout="constrained")
    left, right = fig.subplots(1, 2, width_ratios=(1.1, 1))
    labels = [
        p if pd.isna(bs) else f"{p} bs{bs}" for p, bs in zip(frame["policy"], frame["block_size"])
    ]
    y = range(len(frame))
    parts = (
        ("utilization_pct", "holding tokens", "tab:green"),
        ("reservation_waste_pct", "reservation waste", "tab:orange"),
        ("fragmentation_pct", "internal fragmentation", "tab:red"),
    )
    start = pd.Series(0.0, index=frame.index)
    for column, label, color in parts:
        left.barh(y, frame[column], left=start, color=color, label=label)
        start = start + frame[column]
    left.set_yticks(list(y), labels)
    left.invert_yaxis()
    left.set_xlim(0, 100)
    left.set_xlabel("% of reserved KV memory (summed over steps)")
    left.set_title("Where reserved KV memory goes")
    left.legend(loc="upper center", bbox_to_anchor=(0.5, -0.1), ncols=3, fontsize="small")

    for name, group in frame[frame["block_size"].notna()].groupby("policy", sort=False):
        right.plot(group["block_size"], group["mean_concurrency"], marker="o", label=name)
    contiguous = frame[frame["policy"].isin(CONTIGUOUS_POLICIES)]
    for (_, row), style in zip(contiguous.iterrows(), ("--", "-.", ":")):
        right.axhline(row["mean_concurrency"], linestyle=style, color="gray", label=row["policy"])
    right.set_xscale("log", base=2)
    sizes = sorted(frame["block_size"].dropna().unique())
    right.set_xticks([int(b) for b in sizes], [str(int(b)) for b in sizes])
    right.set_ylim(bottom=0)
    right.set_xlabel("block_size (tokens)")
    right.set_ylabel("mean concurrent requests")
    right.set_title("Concurrency vs block size")
    right.legend(fontsize="small")
    fig.suptitle(title)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


__all__ = ["TABLE_COLUMNS", "format_table", "plot_capacity", "results_frame"]
