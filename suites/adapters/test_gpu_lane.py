"""The GPU lane (``python -m pagedbench.harness.gpu_lane``): its CPU rehearsal writes every
file it promises, its budgets fit the 8 minutes it has on one H200, and a step past its
budget is stopped and recorded as such."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch

from pagedbench.harness import gpu_lane

LANE_MINUTES_ON_H200 = 8


def test_cuda_budgets_fit_eight_minutes() -> None:
    """The steps' budgets, and the lane's cap plus the last step's SIGINT grace, stay
    under 8 minutes."""
    limit_s = LANE_MINUTES_ON_H200 * 60
    assert sum(gpu_lane.BUDGETS_S["cuda"].values()) < limit_s
    assert gpu_lane.TOTAL_BUDGET_S["cuda"] + gpu_lane.GRACE_S < limit_s


def test_step_past_its_budget_is_stopped(tmp_path: Path) -> None:
    step = gpu_lane.Step("sleep", [sys.executable, "-c", "import time; time.sleep(60)"],
                         budget_s=1)
    gpu_lane.run_step(step, tmp_path)
    assert step.timed_out and not step.ok
    assert step.wall_s < 1 + gpu_lane.GRACE_S + 5
    assert (tmp_path / "sleep.log").read_text().startswith("$ ")


def test_unknown_device_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="device must be one of"):
        gpu_lane.run_lane(tmp_path, "tpu", gpu_lane.CPU_SELECTION, [])


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get(gpu_lane.IN_LANE_ENV) == "1",
                    reason="already inside a GPU lane run; not starting a nested one")
def test_cpu_lane_writes_its_files(tmp_path: Path) -> None:
    """A tiny CPU lane: the plain-torch baseline on one preset at block size 16, and one
    quick test module."""
    out = tmp_path / "lane"
    command = [sys.executable, "-m", "pagedbench.harness.gpu_lane", "--out", str(out),
               "--device", "cpu", "--impl", "torch-gather", "--preset", "llama3.1-70b-tp8",
               "--block-size", "16", "--tests", "suites/adapters/test_vllm_cuda_layout.py"]
    done = subprocess.run(command, cwd=gpu_lane.ROOT, capture_output=True, text=True,
                          timeout=gpu_lane.TOTAL_BUDGET_S["cpu"] + 60)
    assert done.returncode == 0, done.stdout + done.stderr

    lane = json.loads((out / "lane.json").read_text())
    assert lane["ok"] and lane["device"] == "cpu"
    assert [s["name"] for s in lane["steps"]] == ["env", "list", "run", "pytest"]
    assert all(s["returncode"] == 0 and not s["timed_out"] for s in lane["steps"])

    env = json.loads((out / "env.json").read_text())
    assert env["packages"]["torch"]["version"] == torch.__version__
    assert env["environment"]["torch"] == torch.__version__
    assert "git_sha" in env["environment"]
    assert env["selection"]["impls"] == ["torch-gather"]
    assert set(env["nvidia_smi"]) in ({"error"}, {"summary", "query"})

    listed = {row["name"]: row for row in json.loads((out / "list.json").read_text())}
    assert listed["torch-gather"]["available"]
    if not torch.cuda.is_available() and "flashinfer-nhd" in listed:
        assert not listed["flashinfer-nhd"]["available"] and listed["flashinfer-nhd"]["reason"]

    records = [record for path in (out / "results").glob("*.jsonl")
               for line in path.read_text().splitlines()
               if (record := json.loads(line))["kind"] == "result"]
    assert len(records) == 2  # the preset's full case and its reduced form
    assert {r["impl"] for r in records} == {"torch-gather"}
    assert {r["status"] for r in records} == {"pass"}
    assert all("-bs16-" in r["case_id"] for r in records)
    assert list((out / "results").glob("*.md"))

    suite = ET.parse(out / "junit.xml").getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    assert int(suite.get("tests")) > 0
    assert suite.get("failures") == "0" and suite.get("errors") == "0"
