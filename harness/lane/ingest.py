"""Ingest what a GPU lane call returned (``make gpu-ingest FROM=dir``).

::

    python -m pagedbench.harness.lane.ingest FROM [--results-root results] [--allow-rehearsal]

``FROM`` holds the lane's files (``lane.json``, ``env.json``, ``sweep.jsonl``, ...,
:data:`~.steps.KEPT_FILES`). They are checked (``lane.json`` and ``env.json`` must
parse, every ``sweep.jsonl`` and ``conformance.jsonl`` line must pass the results schema) and copied to
``<results-root>/gpu/<device>/<run-id>/`` with ``environment.md`` (the machine as
measured: driver, SMs, L2, clocks, copy bandwidth, bf16 peak; the commit; each step).
Then ``<results-root>/leaderboards/gpu-<device>.md`` is generated afresh from every run
of that device: the conditions, a bandwidth table (GB/s and the fraction of the copy
bandwidth measured in the same run, passes only) and the leaderboard of
:func:`~pagedbench.harness.results.report.markdown`.

A CPU rehearsal (``lane.json`` ``rehearsal: true``) is refused unless
``--allow-rehearsal``, and then goes to ``gpu/rehearsal-<device>/`` of a results root
that is not this checkout's ``results/``: a CPU run never fills a GPU column.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
from pathlib import Path
from typing import Any

import pandas as pd

from pagedbench.reference import PagedValueError

from pagedbench.harness.lane.steps import KEPT_FILES, ROOT
from pagedbench.harness.results import report
from pagedbench.harness.results.record import ResultRecord
from pagedbench.harness.results.store import read_lines, results_of
from pagedbench.harness.verdict.status import Status

DEFAULT_RESULTS_ROOT = ROOT / "results"
REHEARSAL_PREFIX = "rehearsal-"


def device_slug(name: str) -> str:
    """A folder name for a device name: ``"NVIDIA H200"`` -> ``"nvidia-h200"``."""
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    return slug or "unknown-device"


def _json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise PagedValueError("FROM", str(path.parent), "a folder a GPU lane call returned",
                              f"{path}: not readable JSON ({exc})") from None
    if not isinstance(data, dict):
        raise PagedValueError("FROM", str(path.parent), "a folder a GPU lane call returned",
                              f"{path}: not a JSON object")
    return data


def environment_markdown(lane: dict[str, Any], env: dict[str, Any]) -> str:
    """``environment.md``: the machine, the software, the commit and the lane's steps."""
    base = env.get("environment") or {}
    gpu = env.get("gpu") or {}
    smi = env.get("nvidia_smi") or {}
    measured = env.get("measured") or {}
    rows = [
        ("device", base.get("device")), ("compute capability", base.get("cc")),
        ("driver (nvidia-smi)", smi.get("driver_version", base.get("driver"))),
        ("torch / CUDA build", f"{base.get('torch')} / {env.get('torch_cuda_build')}"),
        ("triton", base.get("triton")), ("python", base.get("python")),
        ("SMs", gpu.get("sm_count")), ("L2 (bytes)", gpu.get("l2_cache_bytes")),
        ("memory (bytes)", gpu.get("total_memory_bytes")),
        ("clocks SM / memory, max (MHz)",
         f"{smi.get('clocks.max.sm')} / {smi.get('clocks.max.mem')}"),
        ("power limit", smi.get("power.limit")),
        ("copy bandwidth, measured (GB/s)", measured.get("copy_bandwidth_gbps",
                                                         measured.get("skipped"))),
        ("bf16 matmul, measured (TFLOP/s)", measured.get("bf16_tflops", measured.get("skipped"))),
        ("git commit", f"{lane.get('git_sha')}{' (dirty)' if lane.get('dirty') else ''}"),
        ("lane run", lane.get("run_id")),
    ]
    table = pd.DataFrame(rows, columns=["", "value"]).astype(str)
    steps = pd.DataFrame([{"step": s["name"], "state": s["state"], "wall (s)": s["wall_s"],
                           "budget (s)": s["budget_s"], "notes": " ".join(s["notes"])}
                          for s in lane.get("steps", [])])
    title = "GPU lane environment" + (" (CPU REHEARSAL, not a GPU result)"
                                      if lane.get("rehearsal") else "")
    return "\n".join([f"# {title}", "", report.escape_frame(table).to_markdown(index=False),
                      "", "## Steps", "", report.escape_frame(steps.astype(str)).to_markdown(
                          index=False) if not steps.empty else "none", "",
                      report.escape(lane.get("summary", "")), ""])


def bandwidth_table(records: list[ResultRecord], copy_gbps: dict[str, float | None]) -> str:
    """Timed passes on CUDA: implementation, case, median ms, GB/s, and % of the copy
    bandwidth measured in the same lane run (``copy_gbps`` by the sweep's run id)."""
    rows = []
    for r in records:
        if (r.status is not Status.PASS or r.bandwidth_gbps is None or r.interpreted
                or r.env.device_type != "cuda"):
            continue
        peak = copy_gbps.get(r.run_id)
        rows.append({"impl": r.impl, "case": r.case_id, "median (ms)": r.time_ms_median,
                     "GB/s": round(r.bandwidth_gbps, 1),
                     "% of copy": None if not peak else round(100 * r.bandwidth_gbps / peak, 1)})
    if not rows:
        return "No timed passes on a GPU (CPU timings are never shown here)."
    return report.escape_frame(pd.DataFrame(rows).astype(str)).to_markdown(index=False)


def leaderboard(device_dir: Path, title: str) -> str:
    """The GPU leaderboard of every run under ``device_dir``."""
    lines, copy_gbps, conditions = [], {}, []
    for run in sorted(p for p in device_dir.iterdir() if (p / "lane.json").is_file()):
        env = _json(run / "env.json")
        measured = env.get("measured") or {}
        sweep = run / "sweep.jsonl"
        run_lines = list(read_lines([sweep])) if sweep.is_file() else []
        for line in run_lines:
            copy_gbps[line.run_id] = measured.get("copy_bandwidth_gbps")
        lines += run_lines
        smi = env.get("nvidia_smi") or {}
        conditions.append(f"- run {run.name}: driver {smi.get('driver_version')}, "
                          f"{(env.get('gpu') or {}).get('sm_count')} SMs, copy "
                          f"{measured.get('copy_bandwidth_gbps', measured.get('skipped'))} "
                          f"GB/s, bf16 {measured.get('bf16_tflops', '-')} TFLOP/s, commit "
                          f"{(env.get('environment') or {}).get('git_sha')}")
    body = report.markdown(lines, title=title)
    return "\n".join([body.split("\n", 1)[0], "", "Measured in each run (environment.md "
                      "beside its files):", "", *map(report.escape, conditions), "",
                      "## Bandwidth", "", bandwidth_table(results_of(lines), copy_gbps), "",
                      body.split("\n", 1)[1]])


def ingest(source: Path, results_root: Path = DEFAULT_RESULTS_ROOT,
           allow_rehearsal: bool = False) -> tuple[Path, Path]:
    """Copy a returned lane folder into ``results_root`` and regenerate its device's
    leaderboard; returns (the run's folder, the leaderboard).

    Raises
    ------
    PagedValueError
        If ``source`` is not a lane's folder, a result line fails the schema, the run
        was ingested already, or it is a rehearsal (unless ``allow_rehearsal``, and
        never into this checkout's ``results/``).
    """
    lane, env = _json(source / "lane.json"), _json(source / "env.json")
    for key in ("run_id", "rehearsal", "steps"):
        if key not in lane:
            raise PagedValueError("FROM", str(source), "a folder a GPU lane call returned",
                                  f"{source / 'lane.json'}: no {key!r}")
    for results in (source / "sweep.jsonl", source / "conformance.jsonl"):
        if results.is_file():
            list(read_lines([results]))  # validates every line; raises ResultsFileError
    device = device_slug((env.get("environment") or {}).get("device") or "unknown")
    if lane["rehearsal"]:
        if not allow_rehearsal:
            raise PagedValueError("FROM", str(source), "a GPU run",
                                  f"{source} is a CPU rehearsal, not a GPU run: not ingested "
                                  "(--allow-rehearsal, into another --results-root)")
        if results_root.resolve() == DEFAULT_RESULTS_ROOT.resolve():
            raise PagedValueError("--results-root", str(results_root),
                                  "a folder other than this checkout's results/",
                                  "a rehearsal never goes into results/")
        device = REHEARSAL_PREFIX + device
    target = results_root / "gpu" / device / lane["run_id"]
    if target.exists():
        raise PagedValueError("FROM", str(source), "a run not ingested yet",
                              f"{target} exists: run {lane['run_id']} was ingested already")
    target.mkdir(parents=True)
    for name in KEPT_FILES:
        if (source / name).is_file():
            shutil.copyfile(source / name, target / name)
    (target / "environment.md").write_text(environment_markdown(lane, env))
    name = (env.get("environment") or {}).get("device", device)
    title = (f"pagedbench GPU leaderboard ({name})" if not lane["rehearsal"] else
             f"CPU REHEARSAL of the GPU lane ({name}): not a GPU result")
    board = results_root / "leaderboards" / f"gpu-{device}.md"
    board.parent.mkdir(parents=True, exist_ok=True)
    board.write_text(leaderboard(target.parent, title))
    return target, board


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pagedbench.harness.lane.ingest",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("source", type=Path, metavar="FROM",
                        help="the folder the GPU lane wrote (its --out), brought back")
    parser.add_argument("--results-root", type=Path, default=DEFAULT_RESULTS_ROOT,
                        help=f"where gpu/ and leaderboards/ are (default {DEFAULT_RESULTS_ROOT})")
    parser.add_argument("--allow-rehearsal", action="store_true",
                        help="ingest a CPU rehearsal (marked so, never into results/)")
    args = parser.parse_args(argv)
    try:
        target, board = ingest(args.source, args.results_root, args.allow_rehearsal)
    except PagedValueError as exc:
        print(f"gpu_ingest: {exc}", file=sys.stderr)
        return 2
    print(f"ingested: {target}\nleaderboard: {board}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
