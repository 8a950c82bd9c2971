"""What the GPU lane says when it ends: ``lane.json``'s record (:func:`lane_record`) and
the summary line printed last (:func:`summary_line`)."""

from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from pagedbench.harness.lane.sweep import Selection, sweep_counts
from pagedbench.harness.results.store import GIT_DIRTY_ENV, GIT_SHA_ENV

SUMMARY_PREFIX = "gpu-lane:"


def junit_counts(junit: Path) -> dict[str, int]:
    import xml.etree.ElementTree as ET

    try:
        root = ET.parse(junit).getroot()
    except (OSError, ET.ParseError):
        return {}
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    return {key: sum(int(s.get(key, 0)) for s in suites)
            for key in ("tests", "failures", "errors", "skipped")}


def summary_line(record: dict[str, Any]) -> str:
    """The line printed last: verdict, device, commit, each step, the files."""
    parts = []
    for step in record["steps"]:
        name, text = step["name"], f"{step['name']} {step['state']}"
        counts = record["sweep_statuses"] if name == "sweep" else (
            record["conformance_statuses"] if name == "conformance" else {})
        if counts:
            text += " (" + ", ".join(f"{n} {k}" for k, n in counts.items())
            if name == "sweep" and record.get("sweep_not_run"):
                text += f", {len(record['sweep_not_run'])} not run"
            text += ")"
        parts.append(text)
    git = (record["git_sha"] or "unknown")[:12] + ("+dirty" if record["dirty"] else "")
    return (f"{SUMMARY_PREFIX} {'OK' if record['ok'] else 'FAILED'}"
            f"{' (CPU rehearsal)' if record['rehearsal'] else ''} | device {record['device_name']}"
            f" | git {git} | {'; '.join(parts)} | {len(record['files'])} files in {record['out']}")


def warmup_records(path: Path) -> list[dict[str, Any]]:
    records = []
    with contextlib.suppress(OSError):
        for line in path.read_text().splitlines():
            with contextlib.suppress(ValueError):
                records.append(json.loads(line))
    return records


def lane_record(out: Path, run_id: str, argv: list[str], device: str, selection: Selection,
                impls: tuple[str, ...], steps: list, lane_costs: dict[str, Any],
                models: dict[str, Any], total_budget_s: float, start: float, spent: float,
                coverage: dict[str, list[str]]) -> dict[str, Any]:
    """``lane.json``'s record (without its files and summary): the run, the commit, each
    step (:class:`~.steps.Step`), the time model before the lane and after ``list`` with
    the costs it took (``lane_costs``) beside what was ``measured`` (the launcher's setup,
    each step's seconds, seconds per result of the conformance pass and the sweep), the
    warm-up's records, the results' statuses and what the sweep did not reach.
    """
    env_record = {}
    with contextlib.suppress(OSError, ValueError):
        env_record = json.loads((out / "env.json").read_text())
    by_name = {s.name: s for s in steps}
    sweep = sweep_counts(out / "sweep.jsonl")
    conformance = sweep_counts(out / "conformance.jsonl")
    measured = {"setup_s": round(spent, 1),
                "steps_s": {s.name: s.wall_s for s in steps},
                "conformance_s_per_result": _per(by_name["conformance"].wall_s,
                                                 sum(conformance.values())),
                "sweep_s_per_result": _per(by_name["sweep"].wall_s, sum(sweep.values()))}
    return {
        "run_id": run_id, "argv": argv, "device": device, "rehearsal": device == "cpu",
        "device_name": (env_record.get("environment") or {}).get("device", "unknown"),
        "git_sha": os.environ.get(GIT_SHA_ENV), "dirty": os.environ.get(GIT_DIRTY_ENV) == "1",
        "total_budget_s": total_budget_s,
        "wall_s": round(time.monotonic() - start + spent, 1),
        "impls": list(impls), "selection": selection.to_dict(),
        "ok": all(s.ok for s in steps if s.name != "truths") and bool(impls),
        "steps": [{**asdict(s), "ok": s.ok, "state": s.state} for s in steps],
        "model": models, "costs": lane_costs, "measured": measured,
        "warmup": sorted(warmup_records(out / "work" / "warmup.jsonl"),
                         key=lambda r: impls.index(r["impl"]) if r.get("impl") in impls
                         else len(impls)),
        "tests": junit_counts(out / "junit.xml"),
        "conformance_statuses": conformance,
        "sweep_statuses": sweep,
        "sweep_not_run": coverage["not_run"],
        "sweep_left_out": coverage["left_out"],
        "out": str(out),
    }


def _per(seconds: float, count: int) -> float | None:
    return round(seconds / count, 2) if count else None




__all__ = ["SUMMARY_PREFIX", "junit_counts", "lane_record", "summary_line", "warmup_records"]
