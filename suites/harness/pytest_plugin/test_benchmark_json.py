"""One timing per point in pytest-benchmark's JSON: a sweep point's ``stats`` are the
harness timer's samples, so ``stats.median`` is the board's median
(``extra_info.timing.median``) and ``--benchmark-compare-fail`` judges that number."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
POINTS = "test_sweep_point and decode and bs16 and (torch-gather or sdpa-contiguous)"


def _bench(tmp_path: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    # Without pytest-xdist's variables: pytest-benchmark turns itself off in a process that
    # has PYTEST_XDIST_WORKER (this session's, under pytest -n N).
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST_")}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "suites/benchmarks/test_bench_sweep_points.py",
         "-q", "-k", POINTS, f"--benchmark-storage=file://{tmp_path / 'storage'}", *extra],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.bench
def test_stats_are_the_harness_samples_and_compare_fail_judges_them(tmp_path) -> None:
    first = _bench(tmp_path, "--benchmark-save=first")
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    (saved,) = (tmp_path / "storage").glob("*/0001_first.json")
    record = json.loads(saved.read_text())
    benchmarks = record["benchmarks"]
    assert {b["extra_info"]["impl"] for b in benchmarks} == {"torch-gather",
                                                             "sdpa-contiguous"}
    for bench in benchmarks:
        timing, stats = bench["extra_info"]["timing"], bench["stats"]
        samples_s = [ms / 1e3 for ms in timing["samples"]]
        assert stats["rounds"] == timing["n"] == len(samples_s)
        assert stats["iterations"] == 1
        assert stats["median"] == pytest.approx(timing["median"] / 1e3, rel=1e-12)
        assert stats["min"] == pytest.approx(min(samples_s), rel=1e-12)
        assert stats["max"] == pytest.approx(max(samples_s), rel=1e-12)
    # A baseline 1000x faster than this run's harness medians is a regression on the
    # median; one 1000x slower is not.
    for factor, expected in ((1e-3, 1), (1e3, 0)):
        for bench in benchmarks:
            bench["stats"]["median"] = bench["extra_info"]["timing"]["median"] / 1e3 * factor
        saved.write_text(json.dumps(record))
        run = _bench(tmp_path, "--benchmark-compare=0001",
                     "--benchmark-compare-fail=median:50%")
        assert run.returncode == expected, run.stdout[-3000:] + run.stderr[-3000:]
        if expected:
            assert "Performance has regressed" in run.stdout + run.stderr
