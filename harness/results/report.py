"""Reports: leaderboards, summaries and bench tables from result records (md, csv; the
HTML pages are :mod:`.site`'s).

Results are grouped by environment: device name and library versions
(:func:`~.record.environment_key`); two devices, or two sets of versions, never share a
table, and the conditions (device, versions, threads, commit, measured peaks) stand above
every table. In the leaderboard rows are cases, columns implementations (in the order
they first appear), each cell the verdict and, for a pass, the median time with its
spread [p10-p90], sample count and noise flag; the fastest ranked pass of a row is bold.
Interpreted timings (Triton's interpreter on the CPU) are shown as ``(interp.)`` and never
ranked; speed is shown only for ``pass``. Bench results add paging
overhead and GB/s vs block size, latency vs batch size, workload-group scores and fast_p
(:mod:`.derived`). A run that has not
recorded its end is named as unfinished; failure and unsupported reasons are listed.
With several environments a table across them comes first: the cases every one ran
(:func:`across_devices`), one column per implementation and device.
Every Markdown cell is escaped (HTML, ``|``, newlines; :func:`escape`), since case ids
and reasons come from user input and from implementations.
"""

from __future__ import annotations

from collections.abc import Iterable
from html import escape as html_escape
from typing import Any

import pandas as pd

from pagedbench.harness.cases.workloads import DEFAULT_BASELINE
from pagedbench.harness.results.derived import bench_frame, fast_p, group_scores
from pagedbench.harness.results.record import (DevicePeaks, ResultRecord, RunRecord,
                                               environment_key, latest)
from pagedbench.harness.results.store import results_of, run_states
from pagedbench.harness.verdict.status import Status
from pagedbench.harness.verdict.fp8_interpreter import FP8_POISON_MARK, poison_reads_finite

STATUS_ORDER = [str(s) for s in Status]
#: Marks a pass judged with stale (finite) tails instead of NaN (docs/implementations.md).
STALE_TAIL_MARK = "†"
#: Marks a pass judged against the yardstick with logits in the case dtype, which the
#: implementation declares (``Capabilities.logits_precision = "case"``; docs/tolerance.md).
CASE_LOGITS_MARK = "‡"


def escape(text: Any) -> str:
    """``text`` safe inside a Markdown table cell or list item: HTML (``&``, ``<``, ``>``)
    as entities, since Markdown passes raw HTML through (CommonMark, "Raw HTML"), ``\\``
    and ``|`` backslash-escaped, line breaks as ``<br>``."""
    text = html_escape(str(text), quote=False)
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
    """The leaderboard cell of one record: its status, then for a pass its median time,
    its spread ``[p10-p90]``, the number of samples and ``noisy`` when flagged."""
    status = record.status
    if status is not Status.PASS:
        return str(status)
    mark = "pass" + (STALE_TAIL_MARK if record.tail_poison == "stale" else "") + (
        CASE_LOGITS_MARK if record.logits_precision == "case" else "") + (
        FP8_POISON_MARK if poison_reads_finite(record.paged_case(), record.interpreted) else "")
    if record.interpreted:
        return f"{mark} (interp.)"
    if record.time_ms_median is None or record.time_ms is None:
        return mark
    t = record.time_ms
    return (f"{mark} {t.median:.3g} ms [{t.p10:.3g}-{t.p90:.3g}] n={t.n}"
            + (" noisy" if t.noisy else ""))


#: The case's axes each row names beside its id (CSV readers filter on them).
CASE_COLUMNS = ["dtype", "num_q_heads", "num_kv_heads", "head_dim", "layout"]
COLUMNS = ["case_id", *CASE_COLUMNS, "impl", "device", "device_name", "versions", "status",
           "reason",
           "time_ms_median", "time_ms_p10", "time_ms_p90", "samples", "noisy",
           "timing_method", "max_abs_err", "max_err_ulps", "mean_err_ulps",
           "err_ratio_vs_naive", "bandwidth_gbps", "cell"]


def frame(records: Iterable[ResultRecord]) -> pd.DataFrame:
    """One row per result with the columns reports need. Of the records of one
    :func:`~.record.result_key` (implementation, device name, versions, case) the one
    measured last wins (:func:`~.record.latest`), so re-runs replace earlier results, and
    results of two devices (by name: two CPU models, an H100 and an H200) or two library
    versions never replace each other.
    Records read through :func:`~.store.results_of` come as the physical floor judges them."""
    rows = [
        {
            "case_id": r.case_id,
            **{axis: getattr(r.paged_case(), axis) for axis in CASE_COLUMNS},
            "impl": r.impl,
            "device": r.device,
            "device_name": environment_key(r)[0],
            "versions": environment_key(r)[1],
            "status": str(r.status),
            "reason": r.reason,
            "time_ms_median": r.time_ms_median,
            "time_ms_p10": r.time_ms.p10 if r.time_ms else None,
            "time_ms_p90": r.time_ms.p90 if r.time_ms else None,
            "samples": r.time_ms.n if r.time_ms else None,
            "noisy": r.time_ms.noisy if r.time_ms else None,
            "timing_method": r.timing_method,
            "max_abs_err": r.max_abs_err,
            "max_err_ulps": r.max_err_ulps,
            "mean_err_ulps": r.mean_err_ulps,
            "err_ratio_vs_naive": r.err_ratio_vs_naive,
            "bandwidth_gbps": r.bandwidth_gbps,
            "cell": cell_text(r),
        }
        for r in latest(records).values()
    ]
    return pd.DataFrame(rows, columns=COLUMNS)


def environments(df: pd.DataFrame) -> list[tuple[str, str]]:
    """The ``(device name, library versions)`` pairs of ``df``, in order of appearance."""
    return list(dict.fromkeys(zip(df["device_name"], df["versions"])))


def unavailable_everywhere(df: pd.DataFrame) -> list[str]:
    """Implementations whose every record is ``unavailable`` (not installed, no GPU)."""
    status_sets = df.groupby("impl", sort=False)["status"].agg(set)
    return [impl for impl, statuses in status_sets.items()
            if statuses == {str(Status.UNAVAILABLE)}]


def leaderboard(df: pd.DataFrame) -> pd.DataFrame:
    """Cases x implementations table of cells; in each row the fastest ranked pass of
    each environment in bold (when it has more than one). Implementations unavailable
    on every case get no column (the summary lists them). When ``df`` spans several
    environments (:func:`environments`), columns are ``impl@device name`` (plus ``#k``
    for the k-th set of versions of one device), so none merge. Not escaped: see
    :func:`escape_frame`."""
    df = df[~df["impl"].isin(unavailable_everywhere(df))].copy()
    envs = environments(df)
    if len(envs) > 1:
        names = [name for name, _ in envs]
        label = {env: env[0] if names.count(env[0]) == 1 else f"{env[0]}#{k}"
                 for k, env in enumerate(envs, 1)}
        df["impl"] = [f"{impl}@{label[env]}" for impl, env in
                      zip(df["impl"], zip(df["device_name"], df["versions"]))]
    impls = list(dict.fromkeys(df["impl"]))
    cases = list(dict.fromkeys(df["case_id"]))
    table = df.pivot(index="case_id", columns="impl", values="cell")
    table = table.reindex(index=cases, columns=impls)
    ranked = df[(df["status"] == str(Status.PASS)) & df["time_ms_median"].notna()
                & (df["timing_method"] != "interpreted")]
    for _, group in ranked.groupby(["case_id", "device_name", "versions"], sort=False):
        if len(group) > 1:
            fastest = group.loc[group["time_ms_median"].idxmin()]
            table.loc[fastest["case_id"], fastest["impl"]] = f"**{fastest['cell']}**"
    table.index.name = "case"
    return table.fillna("")


def across_devices(df: pd.DataFrame) -> pd.DataFrame:
    """The :func:`leaderboard` of the cases every environment of ``df`` has a result on,
    columns ``impl@device name``: one row compares the devices (the merged shards of a CI
    matrix, docs/ci.md). Empty with fewer than two environments or no case they share."""
    envs = environments(df)
    if len(envs) < 2:
        return pd.DataFrame()
    shared = set.intersection(*(set(df.loc[(df["device_name"] == name)
                                           & (df["versions"] == versions), "case_id"])
                                for name, versions in envs))
    return leaderboard(df[df["case_id"].isin(shared)]) if shared else pd.DataFrame()


def summary(df: pd.DataFrame) -> pd.DataFrame:
    """Implementations x statuses: how many cases ended in each status; then, over the
    passes, the largest error in ulps of the output dtype and the mean signed error in
    ulps (the bias: about -0.3 for an implementation that truncates, 0 for round to
    nearest; harness/verdict/tolerance.py)."""
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
                         f"`pagedbench run --resume {state.run_id} --results-dir DIR`, DIR "
                         "the folder of its file.")
    return notes


#: What the marks after a verdict mean (the Markdown and HTML boards' legends end with it).
MARKS = (
    f"`{STALE_TAIL_MARK}`: the implementation "
    "declares that it multiplies the unused slots of a partly filled last block by "
    "zero (NaN there would reach its output), so it was checked with finite stale V "
    "values in those slots instead of NaN (K there stays NaN). "
    f"`{CASE_LOGITS_MARK}`: the implementation declares that it computes its logits in "
    "the case dtype, and was judged against a naive yardstick that does the same "
    "(docs/tolerance.md). "
    f"`{FP8_POISON_MARK}`: ran under Triton's interpreter on an fp8 cache, whose fp8 "
    "decode reads the NaN/Inf poison of unused slots as a large finite number (0x7F: 480 "
    "in E4M3), so a read past kv_len showed as a large value, and one multiplied by a "
    "zero weight not at all (results/fp8-interpreter, docs/edges.md).")
LEGEND = (
    "Cells: verdict against the float64 truth, then the median time per call, its "
    "spread [p10-p90] and the number of samples; `noisy`: IQR above 10% of the median. "
    "Bold: fastest passing implementation of the row in its environment. `(interp.)`: ran "
    "under an interpreter, checked for correctness, never ranked. " + MARKS)


_ACROSS = ("The cases every device (and set of library versions) below has a result on, "
           "one column per implementation and device; each device's own section follows, "
           "with its conditions. Bold: fastest of the row on its device.")


def _spread(value: float, low: float, high: float, fmt: str) -> str:
    if pd.isna(value):
        return ""
    return f"{value:{fmt}} [{low:{fmt}}, {high:{fmt}}]"


def _by_block_size(bdf: pd.DataFrame, cell) -> pd.DataFrame:
    """Rows ``workload (dtype)``, columns ``impl bsN`` (paged points only), cells
    ``cell(row)`` of the timed points."""
    paged = bdf[bdf["timed"] & ~bdf["contiguous"]].sort_values("block_size", kind="stable")
    if paged.empty:
        return pd.DataFrame()
    paged = paged.assign(row=paged["workload"] + " (" + paged["dtype"] + ")",
                         column=paged["impl"] + " bs" + paged["block_size"].astype(str),
                         cell=[cell(r) for r in paged.itertuples()])
    table = paged.pivot_table(index="row", columns="column", values="cell", aggfunc="first",
                              sort=False)
    table.index.name = "workload (dtype)"
    return table.fillna("")


def bench_tables(bdf: pd.DataFrame, scores: pd.DataFrame, fastp: pd.DataFrame
                 ) -> list[tuple[str, str, pd.DataFrame]]:
    """The bench tables of one environment, ``(title, note, table)``: paging overhead and
    GB/s vs block size, latency vs batch size, workload-group scores and fast_p
    (:mod:`.derived`). Not escaped."""
    out: list[tuple[str, str, pd.DataFrame]] = []
    overhead = _by_block_size(bdf, lambda r: "" if pd.isna(r.paging_overhead) else (
        f"{r.paging_overhead:+.0%} [{r.overhead_low:+.0%}, {r.overhead_high:+.0%}]"
        + ("" if r.overhead_vs == r.impl else f" vs {r.overhead_vs}")))
    if not overhead.empty:
        out.append(("Paging overhead vs block size", "Median time over the contiguous run's "
                    "(same implementation, or the named one) minus 1; [p10/p90, p90/p10].",
                    overhead))
    gbps = _by_block_size(bdf, lambda r: _spread(
        r.bandwidth_gbps, r.bandwidth_gbps * r.median_ms / r.p90_ms,
        r.bandwidth_gbps * r.median_ms / r.p10_ms, ".3g"))
    if not gbps.empty:
        out.append(("GB/s vs block size", "Bytes a kernel must move (Q, attended K and V, "
                    "O, block tables) per median time; [at p90 time, at p10 time].", gbps))
    timed = bdf[bdf["timed"] & ~bdf["contiguous"]]
    for (mode, heads, context, dtype), group in timed.groupby(
            ["mode", "heads", "context", "dtype"], sort=False):
        smallest = group[group["block_size"] == group["block_size"].min()]
        if smallest["batch_size"].nunique() < 2 or not mode:
            continue
        smallest = smallest.sort_values("batch_size").assign(cell=[
            _spread(r.median_ms, r.p10_ms, r.p90_ms, ".3g") for r in smallest.itertuples()])
        table = smallest.pivot_table(index="batch_size", columns="impl", values="cell",
                                     aggfunc="first", sort=False).fillna("")
        table.index.name = "batch size"
        out.append((f"Latency (ms) vs batch size: {mode}, heads {heads}, context {context}, "
                    f"{dtype}, block size {smallest['block_size'].iloc[0]}",
                    "Median [p10, p90] per call.", table))
    if not scores.empty:
        cells = scores.assign(cell=[
            "0 (fails)" if not r.correct else "-" if pd.isna(r.score) else f"{r.score:.2f}x"
            for r in scores.itertuples()])
        table = cells.pivot_table(index="workload", columns="impl", values="cell",
                                  aggfunc="first", sort=False).fillna("-")
        out.append(("Workload groups", "Geometric-mean speedup over the baseline across the "
                    "group's points; an implementation failing any case of the group scores 0 "
                    "(flashinfer-bench's rule).", table))
    if not fastp.empty:
        table = fastp.drop(columns=["device_name", "versions"]).set_index("impl")
        table.columns = [f"p={p:g}" for p in table.columns]
        out.append(("fast_p", "Share of workload groups on which the implementation is "
                    "correct and more than p times as fast as the baseline (KernelBench).",
                    table.map(lambda v: f"{v:.0%}")))
    return out


def measured_peaks(records: list[ResultRecord]) -> DevicePeaks | None:
    """The device peaks shown beside ``records`` (one device's): the last run's to have
    measured them (a results file's runs follow each other), None when none did. The
    Markdown and the site show the same."""
    return next((r.peaks for r in reversed(records) if r.peaks is not None), None)


def _environment_note(env_records: list[ResultRecord], seen: DevicePeaks | None) -> str:
    first = env_records[0]
    runs = sorted({r.run_id for r in env_records})
    text = _conditions(first).removesuffix(f"run {first.run_id}.") + f"runs {', '.join(runs)}."
    if seen is not None:
        text += (f" Measured peaks: {seen.copy_gbps:.3g} GB/s copy, {seen.bf16_tflops:.3g} "
                 "TFLOP/s bf16 matmul.")
    return text


def sections(lines: list[ResultRecord | RunRecord], baseline: str = DEFAULT_BASELINE
             ) -> list[dict]:
    """One section per environment (device name + library versions) of ``lines``:
    ``{"title", "copy_gbps", "conditions", "tables": [(title, note, frame)], "reasons",
    "bench", "scores"}`` (``copy_gbps``: the measured copy bandwidth, None when not
    measured); tables not escaped."""
    records = results_of(lines)
    df = frame(records)
    bdf = bench_frame(records, baseline)
    out = []
    for device_name, versions in environments(df):
        mine = df[(df["device_name"] == device_name) & (df["versions"] == versions)]
        env_records = [r for r in records if environment_key(r) == (device_name, versions)]
        benv = bdf[(bdf["device_name"] == device_name) & (bdf["versions"] == versions)]
        scores = group_scores(benv)
        tables = [("Leaderboard", LEGEND, leaderboard(mine)),
                  ("Summary", "", summary(mine)),
                  *bench_tables(benv, scores, fast_p(scores))]
        seen = measured_peaks(env_records)
        out.append({"title": f"{device_name} ({versions})",
                    "copy_gbps": None if seen is None else seen.copy_gbps,
                    "conditions": _environment_note(env_records, seen),
                    "tables": tables, "reasons": reasons(mine), "bench": benv,
                    "scores": scores})
    return out


def markdown(lines: list[ResultRecord | RunRecord], title: str = "pagedbench leaderboard",
             baseline: str = DEFAULT_BASELINE) -> str:
    """The full Markdown report of results-file lines: a warning per unfinished run, then
    per environment (device name + library versions; never merged) its conditions above
    every table, the leaderboard, the summary, the bench tables and the reasons."""
    head = [f"# {escape(title)}", ""]
    for note in unfinished(lines):
        head += [f"**{escape(note)}**", ""]
    found = sections(lines, baseline)
    if not found:
        return "\n".join([*head, "No results.", ""])
    body: list[str] = []
    shared = across_devices(frame(results_of(lines)))
    if not shared.empty:
        body += ["## Across devices", "", escape(_ACROSS), "", escape_frame(shared).to_markdown(),
                 ""]
    for section in found:
        body += [f"## {escape(section['title'])}", ""]
        for table_title, note, table in section["tables"]:
            body += [f"### {escape(table_title)}", "", escape(section["conditions"]), ""]
            if note:
                body += [escape(note), ""]
            body += [escape_frame(table).to_markdown(), ""]
        if section["reasons"]:
            body += ["### Reasons", "", *[f"- {escape(n)}" for n in section["reasons"]], ""]
    return "\n".join(head + body)


def csv_text(lines: list[ResultRecord | RunRecord], baseline: str = DEFAULT_BASELINE) -> str:
    """One CSV row per result (the last of each result key), with the bench results'
    derived figures (paging overhead, speedup over ``baseline``) where they apply."""
    records = results_of(lines)
    df = frame(records).drop(columns=["cell"])
    bdf = bench_frame(records, baseline)
    if not bdf.empty:
        derived = bdf[["impl", "device_name", "versions", "case_id", "workload", "mode",
                       "block_size", "batch_size", "context", "paging_overhead",
                       "overhead_vs", "speedup"]]
        df = df.merge(derived, on=["impl", "device_name", "versions", "case_id"], how="left")
    return df.to_csv(index=False)
