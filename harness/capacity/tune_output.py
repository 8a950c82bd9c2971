"""What ``pagedbench tune`` prints and writes: the table, the conditions its
recommendations assume, ``tune.png`` and ``tune.json``."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from pagedbench.harness.capacity.prediction import KernelModel, TuneReport
from pagedbench.harness.results.record import Environment



def conditions(report_fields: dict, sharing: dict[str, bool],
               models: dict[int, KernelModel]) -> list[str]:
    """What the recommendations assume, one sentence each (printed and in the JSON).

    ``report_fields``: the :class:`TuneReport` fields but ``conditions``; ``sharing``:
    whether each workload shares prefixes or samples; ``models``: by block size.
    """
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
    if f["prefill_ms_per_token"]:
        lines.append(f"prefill: {f['prefill_ms_per_token']:g} ms per computed prefill token "
                     "(--prefill-ms-per-token); prefix hits are not computed")
    shared = [w for w, s in sharing.items() if s]
    if shared:
        lines.append(f"prefix caching of full blocks and forked samples (Paged+share) for "
                     f"{', '.join(shared)}; against SGLang's radix tree at page size 1 "
                     "(Radix) on the same trace and budget")
    lines += [f"measured at block_size {bs}: {m.range_text()}" for bs, m in models.items()]
    return lines



TABLE_COLUMNS = {
    "workload": "workload", "block_size": "block_size", "mean_concurrency": "mean conc.",
    "peak_concurrency": "peak conc.", "waste_pct": "waste %", "preempted": "preempted",
    "mean_sequences": "mean batch", "mean_kv_tokens": "mean KV tok",
    "prefix_hit_tokens": "prefix hit tok", "prefill_tokens": "prefill tok",
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
    from matplotlib.figure import Figure  # drawn only with --plot: the CLI starts without it

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


def write(report: TuneReport, json_path: Path, plot_path: Path) -> None:
    """Write the report as JSON to ``json_path`` and its plot to ``plot_path`` (``tune.json``
    and ``tune.png`` of ``--output-dir``: :data:`~.tune.JSON_NAME`,
    :data:`~.tune.PLOT_NAME`)."""
    from pagedbench.harness.results.store import write_output

    json_path.parent.mkdir(parents=True, exist_ok=True)
    write_output(json_path, report.model_dump_json(indent=1) + "\n")
    plot(report, plot_path)


def text(report: TuneReport) -> str:
    """What ``pagedbench tune`` prints: the table, the recommendations, the conditions."""
    lines = [f"pagedbench tune: {report.preset} with {report.impl} on {report.env.device} "
             f"({report.serving.upper()} serving)", "", table(report), "", "recommended:"]
    lines += [f"  {r.text}" for r in report.recommendations]
    if report.prefix_reuse:
        lines += ["", "prefix reuse, radix tree against blocks:"]
        lines += [f"  {r.text}" for r in report.prefix_reuse]
    lines += ["", "conditions:"] + [f"  - {c}" for c in report.conditions]
    lines += [f"  - dropped: {d}" for d in report.dropped_block_sizes]
    refused = sorted({r.refused for r in report.rows if r.refused})
    lines += [f"  - refused: {r}" for r in refused]
    return "\n".join(lines)


__all__ = ["conditions", "plot", "table", "text", "write"]
