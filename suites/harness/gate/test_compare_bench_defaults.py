"""The gate as a user meets it: ``pagedbench bench`` with its default timing, three times (a
baseline, the same code again, one implementation slowed 1.5x), then ``pagedbench gate``
with its defaults: the unchanged run never fails (exit 0, or 7 where a point was too noisy
to judge: never a silent pass) and the slowed one exits 1. ``mykernel`` is a user's
implementation installed as a plug-in: ``sdpa-contiguous``'s code, then the same code
followed by a busy wait of half its own time (``plugins/slowed.py``)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pagedbench.harness.calibration import gate as calibration
from pagedbench.harness.cli import main
from pagedbench.harness.measure.speed import Thresholds
from pagedbench.harness.run.bench import CPU_TIMING
from pagedbench.harness.verdict.status import ExitCode

PLUGIN = "pagedbench.suites.harness.plugins.slowed"


def test_bench_takes_at_least_the_samples_the_gate_judges_by_default() -> None:
    for timing in CPU_TIMING.values():
        assert timing["repetitions"] >= Thresholds().min_samples


def _bench(tmp_path, name: str, target: str) -> str:
    env = calibration.plugin_environment(tmp_path / f"site-{name}", {"mykernel": target})
    results = tmp_path / name
    proc = subprocess.run(
        [sys.executable, "-m", "pagedbench.harness.cli", "bench", "--batch-spec", "4q1s512",
         "--layout", "gqa4", "--block-size", "16", "--no-contiguous", "--no-peaks",
         "--impl", "mykernel", "--results-dir", str(results),
         "--cache-dir", str(tmp_path / "build")],
        env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == ExitCode.CLEAN, proc.stdout[-2000:] + proc.stderr[-2000:]
    return str(results)


@pytest.mark.nightly  # the gate end to end: calibration/test_gate
def test_bench_defaults_then_gate_pass_the_same_code_and_fail_a_1_5x_slowdown(
        tmp_path, capsys) -> None:
    baseline = _bench(tmp_path, "baseline", f"{PLUGIN}:Rerun")
    unchanged = _bench(tmp_path, "unchanged", f"{PLUGIN}:Rerun")
    slowed = _bench(tmp_path, "slowed", f"{PLUGIN}:SlowedHalf")
    code = main(["gate", "--baseline", baseline, "--current", unchanged])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert code in (ExitCode.CLEAN, ExitCode.UNJUDGED), last
    assert ("not judged (exit 7" in last) is (code == ExitCode.UNJUDGED), last
    assert main(["gate", "--baseline", baseline, "--current", slowed]) == ExitCode.REGRESSION
    out = capsys.readouterr().out
    assert any(line.split()[:2] == ["slower", "mykernel"] for line in out.splitlines()), out
