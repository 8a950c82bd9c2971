"""Reports: the leaderboard table and per-implementation summary, from result records.

Rows are cases, columns are implementations (in registry order), each cell the verdict
and, for a pass, the median time. The fastest ranked pass in a row is bold. Interpreted
timings (Triton's interpreter on the CPU) are shown as ``(interp.)`` and never ranked;
speed is shown only for ``pass`` (STYLE.md, "Results"). The device and conditions are
stated above the table; failure and unsupported reasons are listed under it.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

import pandas as pd

from .store import Status

STATUS_ORDER = [str(s) for s in Status]


def cell_text(record: dict[str, Any]) -> str:
    """The leaderboard cell of one record: its status, then for a pass its median time."""
    status = record["status"]
    if status != str(Status.PASS):
        return status
    mark = "pass†" if record.get("tail_poison") == "stale" else "pass"
    if record.get("time_ms_median") is None and not record.get("interpreted"):
        return mark
    if record.get("interpreted"):
        return f"{mark} (interp.)"
    return f"{mark} {record['time_ms_median']:.3g} ms"


REQUIRED_FIELDS = ("impl", "case_id", "status")


def frame(records: Iterable[dict[str, Any]]) -> pd.DataFrame:
    """One row per record with the columns reports need. The last record of each
    (impl, device, case_id) wins, so re-runs appended to a file replace earlier lines;
    when the records span several devices, implementations are labelled ``impl@device``
    so a CPU and a GPU result never replace each other.

    Raises
    ------
    ValueError
        If a record is not an object with at least :data:`REQUIRED_FIELDS`.
    """
    records = list(records)
    for number, r in enumerate(records, 1):
        if not isinstance(r, dict) or any(k not in r for k in REQUIRED_FIELDS):
            raise ValueError(f"record {number} is not a result (needs fields {REQUIRED_FIELDS})")
    several_devices = len({r.get("device") for r in records}) > 1
    rows = [
        {
            "case_id": r["case_id"],
            "impl": f"{r['impl']}@{r.get('device')}" if several_devices else r["impl"],
            "status": r["status"],
            "reason": r.get("reason", ""),
            "time_ms_median": r.get("time_ms_median"),
            "timing_method": r.get("timing_method"),
            "max_abs_err": r.get("max_abs_err"),
            "max_err_ulps": r.get("max_err_ulps"),
            "mean_err_ulps": r.get("mean_err_ulps"),
            "err_ratio_vs_naive": r.get("err_ratio_vs_naive"),
            "bandwidth_gbps": r.get("bandwidth_gbps"),
            "cell": cell_text(r),
        }
        for r in records
    ]
    columns = ["case_id", "impl", "status", "reason", "time_ms_median", "timing_method",
               "max_abs_err", "max_err_ulps", "mean_err_ulps", "err_ratio_vs_naive",
               "bandwidth_gbps", "cell"]
    df = pd.DataFrame(rows, columns=columns)
    return df.drop_duplicates(["case_id", "impl"], keep="last").reset_index(drop=True)


def unavailable_everywhere(df: pd.DataFrame) -> list[str]:
    """Implementations whose every record is ``unavailable`` (not installed, no GPU)."""
    status_sets = df.groupby("impl", sort=False)["status"].agg(set)
    return [impl for impl, statuses in status_sets.items()
            if statuses == {str(Status.UNAVAILABLE)}]


def leaderboard(df: pd.DataFrame) -> pd.DataFrame:
    """Cases x implementations table of cells; the fastest ranked pass per row in bold.
    Implementations unavailable on every case get no column (the summary lists them)."""
    df = df[~df["impl"].isin(unavailable_everywhere(df))]
    impls = list(dict.fromkeys(df["impl"]))
    cases = list(dict.fromkeys(df["case_id"]))
    table = df.pivot(index="case_id", columns="impl", values="cell").reindex(index=cases, columns=impls)
    ranked = df[(df["status"] == str(Status.PASS)) & df["time_ms_median"].notna()
                & (df["timing_method"] != "interpreted")]
    if not ranked.empty:
        fastest = ranked.loc[ranked.groupby("case_id")["time_ms_median"].idxmin()]
        for _, row in fastest.iterrows():
            if (ranked["case_id"] == row["case_id"]).sum() > 1:
                table.loc[row["case_id"], row["impl"]] = f"**{row['cell']}**"
    table.index.name = "case"
    return table.fillna("")


def summary(df: pd.DataFrame) -> pd.DataFrame:
    """Implementations x statuses: how many cases ended in each status; then, over the
    passes, the largest error in ulps of the output dtype and the mean signed error in
    ulps (the bias: about -0.3 for an implementation that truncates, 0 for round to
    nearest; harness/tolerance.py)."""
    impls = list(dict.fromkeys(df["impl"]))
    counts = df.groupby(["impl", "status"]).size().unstack(fill_value=0)
    counts = counts.reindex(index=impls, columns=[s for s in STATUS_ORDER if s in counts.columns],
                            fill_value=0)
    passes = df[df["status"] == str(Status.PASS)].groupby("impl")
    counts["max err (ulps)"] = passes["max_err_ulps"].max().reindex(impls).round(2)
    counts["bias (ulps)"] = passes["mean_err_ulps"].mean().reindex(impls).round(3)
    counts.index.name = "implementation"
    return counts.astype(object).where(counts.notna(), "")


def reasons(df: pd.DataFrame) -> list[str]:
    """``impl: status: reason (cases)`` lines for every non-pass outcome, one per distinct
    reason, naming the cases it applies to."""
    cases_of = df.groupby("impl", sort=False)["case_id"].agg(set)
    notes = df[df["status"] != str(Status.PASS)]
    grouped = notes.groupby(["impl", "status", "reason"], sort=False)["case_id"].agg(list)
    return [f"{impl}: {status}: {reason} "
            f"({'every case' if set(cases) == cases_of[impl] else ', '.join(cases)})"
            for (impl, status, reason), cases in grouped.items()]


def _conditions(record: dict[str, Any]) -> str:
    env = record.get("env", {})
    return (
        f"Device: {env.get('device', '?')} ({env.get('device_type', '?')}), "
        f"threads {env.get('threads', '?')}; torch {env.get('torch', '?')}, "
        f"triton {env.get('triton') or 'absent'}, vllm {env.get('vllm') or 'absent'}; "
        f"commit {str(env.get('git_sha') or '?')[:12]}{' (dirty)' if env.get('dirty') else ''}; "
        f"run {record.get('run_id', '?')}."
    )


def markdown(records: list[dict[str, Any]], title: str = "pagedbench leaderboard") -> str:
    """The full Markdown report: the conditions of every environment the records come
    from, the leaderboard, the summary, the reasons."""
    df = frame(records)
    if df.empty:
        return f"# {title}\n\nNo results.\n"
    environments = {json.dumps(r.get("env", {}), sort_keys=True): r for r in records}
    lines = [f"# {title}", ""]
    for record in environments.values():
        lines += [_conditions(record), ""]
    lines += [
        "Cells: verdict against the float64 truth, then the median time per call. "
        "Bold: fastest passing implementation of the row. `(interp.)`: ran under an "
        "interpreter, checked for correctness, never ranked. `†`: the implementation "
        "declares that it multiplies the unused slots of a partly filled last block by "
        "zero (NaN there would reach its output), so it was checked with finite stale V "
        "values in those slots instead of NaN (K there stays NaN).", "",
        leaderboard(df).to_markdown(), "", "## Summary", "", summary(df).to_markdown(), "",
    ]
    notes = reasons(df)
    if notes:
        lines += ["## Reasons", "", *[f"- {n}" for n in notes], ""]
    return "\n".join(lines)
