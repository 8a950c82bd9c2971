"""Reports: the leaderboard table and per-implementation summary, from result records.

Rows are cases, columns are implementations (in the order they first appear), each cell
the verdict and, for a pass, the median time. The fastest ranked pass in a row is bold,
compared only among results of the same device (a CPU and a GPU time are never ranked
against each other). Interpreted timings (Triton's interpreter on the CPU) are shown as
``(interp.)`` and never ranked; speed is shown only for ``pass`` (STYLE.md, "Results").
The device and conditions are stated above the table; a run that has not recorded its
end is named as unfinished; failure and unsupported reasons are listed under it. Every
cell is escaped for Markdown (``|``, newlines), since case ids and reasons come from
user input and from implementations.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import pandas as pd

from .conformance import CASE_LOGITS_MARK, STALE_TAIL_MARK
from .record import ResultRecord, RunRecord
from .status import Status
from .store import results_of, run_states

STATUS_ORDER = [str(s) for s in Status]


def escape(text: Any) -> str:
    """``text`` safe inside a Markdown table cell or list item: ``|`` escaped, line
    breaks as ``<br>``."""
    text = str(text)
    return (text.replace("\\", "\\\\").replace("|", "\\|").replace("\r\n", "<br>")
            .replace("\n", "<br>").replace("\r", "<br>"))


def escape_frame(df: pd.DataFrame) -> pd.DataFrame:
    """``df`` with every cell, the index and the column names :func:`escape`-d."""
    out = df.map(escape)
    out.index = out.index.map(escape)
    out.index.name = None if df.index.name is None else escape(df.index.name)
    out.columns = [escape(c) for c in df.columns]
    return out


def cell_text(record: ResultRecord) -> str:
    """The leaderboard cell of one record: its status, then for a pass its median time."""
    status = record.status
    if status is not Status.PASS:
        return str(status)
    mark = "pass" + (STALE_TAIL_MARK if record.tail_poison == "stale" else "") + (
        CASE_LOGITS_MARK if record.logits_precision == "case" else "")
    if record.interpreted:
        return f"{mark} (interp.)"
    if record.time_ms_median is None:
        return mark
    return f"{mark} {record.time_ms_median:.3g} ms"


COLUMNS = ["case_id", "impl", "device", "status", "reason", "time_ms_median", "timing_method",
           "max_abs_err", "max_err_ulps", "mean_err_ulps", "err_ratio_vs_naive",
           "bandwidth_gbps", "cell"]


def frame(records: Iterable[ResultRecord]) -> pd.DataFrame:
    """One row per record with the columns reports need. The last record of each
    (impl, device, case_id) wins, so re-runs appended to a file replace earlier lines;
    when the records span several devices, implementations are labelled ``impl@device``
    so a CPU and a GPU result never replace each other."""
    records = list(records)
    several_devices = len({r.device for r in records}) > 1
    rows = [
        {
            "case_id": r.case_id,
            "impl": f"{r.impl}@{r.device}" if several_devices else r.impl,
            "device": r.device,
            "status": str(r.status),
            "reason": r.reason,
            "time_ms_median": r.time_ms_median,
            "timing_method": r.timing_method,
            "max_abs_err": r.max_abs_err,
            "max_err_ulps": r.max_err_ulps,
            "mean_err_ulps": r.mean_err_ulps,
            "err_ratio_vs_naive": r.err_ratio_vs_naive,
            "bandwidth_gbps": r.bandwidth_gbps,
            "cell": cell_text(r),
        }
        for r in records
    ]
    df = pd.DataFrame(rows, columns=COLUMNS)
    return df.drop_duplicates(["case_id", "impl"], keep="last").reset_index(drop=True)


def unavailable_everywhere(df: pd.DataFrame) -> list[str]:
    """Implementations whose every record is ``unavailable`` (not installed, no GPU)."""
    status_sets = df.groupby("impl", sort=False)["status"].agg(set)
    return [impl for impl, statuses in status_sets.items()
            if statuses == {str(Status.UNAVAILABLE)}]


def leaderboard(df: pd.DataFrame) -> pd.DataFrame:
    """Cases x implementations table of cells; in each row the fastest ranked pass of
    each device in bold (when that device has more than one). Implementations unavailable
    on every case get no column (the summary lists them). Not escaped: see
    :func:`escape_frame`."""
    df = df[~df["impl"].isin(unavailable_everywhere(df))]
    impls = list(dict.fromkeys(df["impl"]))
    cases = list(dict.fromkeys(df["case_id"]))
    table = df.pivot(index="case_id", columns="impl", values="cell")
    table = table.reindex(index=cases, columns=impls)
    ranked = df[(df["status"] == str(Status.PASS)) & df["time_ms_median"].notna()
                & (df["timing_method"] != "interpreted")]
    for _, group in ranked.groupby(["case_id", "device"], sort=False):
        if len(group) > 1:
            fastest = group.loc[group["time_ms_median"].idxmin()]
            table.loc[fastest["case_id"], fastest["impl"]] = f"**{fastest['cell']}**"
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
    reason, naming the cases it applies to (not escaped)."""
    cases_of = df.groupby("impl", sort=False)["case_id"].agg(set)
    notes = df[df["status"] != str(Status.PASS)]
    grouped = notes.groupby(["impl", "status", "reason"], sort=False)["case_id"].agg(list)
    return [f"{impl}: {status}: {reason} "
            f"({'every case' if set(cases) == cases_of[impl] else ', '.join(cases)})"
            for (impl, status, reason), cases in grouped.items()]


def _conditions(record: ResultRecord) -> str:
    env = record.env
    return (
        f"Device: {env.device} ({env.device_type}), threads {env.threads}; torch {env.torch}, "
        f"triton {env.triton or 'absent'}, vllm {env.vllm or 'absent'}; "
        f"commit {(env.git_sha or '?')[:12]}{' (dirty)' if env.dirty else ''}; "
        f"run {record.run_id}."
    )


def unfinished(lines: list[ResultRecord | RunRecord]) -> list[str]:
    """One line per run among ``lines`` that recorded its start but not its end."""
    notes = []
    for state in run_states(lines).values():
        if state.started is not None and state.finished is None:
            planned = f" of {state.planned}" if state.planned is not None else ""
            notes.append(f"Unfinished run {state.run_id}: {state.results}{planned} results, "
                         f"no end recorded (interrupted or still running); finish it with "
                         f"`pagedbench run --resume {state.run_id}`.")
    return notes


def markdown(lines: list[ResultRecord | RunRecord], title: str = "pagedbench leaderboard") -> str:
    """The full Markdown report of a results file's lines: the conditions of every
    environment the results come from, a warning per unfinished run, the leaderboard, the
    summary, the reasons."""
    records = results_of(lines)
    df = frame(records)
    head = [f"# {escape(title)}", ""]
    for note in unfinished(lines):
        head += [f"**{escape(note)}**", ""]
    if df.empty:
        return "\n".join([*head, "No results.", ""])
    environments = {r.env.model_dump_json(): r for r in records}
    for record in environments.values():
        head += [escape(_conditions(record)), ""]
    body = [
        "Cells: verdict against the float64 truth, then the median time per call. "
        "Bold: fastest passing implementation of the row on its device. `(interp.)`: ran "
        "under an interpreter, checked for correctness, never ranked. "
        f"`{STALE_TAIL_MARK}`: the implementation "
        "declares that it multiplies the unused slots of a partly filled last block by "
        "zero (NaN there would reach its output), so it was checked with finite stale V "
        "values in those slots instead of NaN (K there stays NaN). "
        f"`{CASE_LOGITS_MARK}`: the implementation declares that it computes its logits in "
        "the case dtype, and was judged against a naive yardstick that does the same "
        "(README, \"Tolerance\").", "",
        escape_frame(leaderboard(df)).to_markdown(), "", "## Summary", "",
        escape_frame(summary(df)).to_markdown(), "",
    ]
    notes = reasons(df)
    if notes:
        body += ["## Reasons", "", *[f"- {escape(n)}" for n in notes], ""]
    return "\n".join(head + body)
