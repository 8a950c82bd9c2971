"""``pagedbench bench --point-major`` and ``--points``: every implementation at a point
before the next point, the run's first call ``started`` and the others ``resumed``, device
memory freed between points; workloads in the order of the ``--workload`` patterns; the
first N points."""

from __future__ import annotations

import pytest

from pagedbench.harness import cli
from pagedbench.harness.measure import cuda_timers
from pagedbench.harness.run import bench, runner
from pagedbench.harness.run.bench import Sweep, point_order, run_point_major


def small_plan():
    cases = bench.QUICK_SWEEP.cases()[:3]
    return runner.make_plan({"a": "x:A", "b": "x:B"}, cases), cases


def test_point_order_is_every_implementation_at_each_point() -> None:
    plan, cases = small_plan()
    assert point_order(plan) == [[("a", c.case_id), ("b", c.case_id)] for c in cases]
    only = {("b", cases[0].case_id), ("a", cases[2].case_id)}
    assert point_order(plan, only) == [[("b", cases[0].case_id)], [],
                                       [("a", cases[2].case_id)]]


def test_run_point_major_runs_one_point_per_call(monkeypatch: pytest.MonkeyPatch) -> None:
    plan, cases = small_plan()
    calls, events = [], []

    def fake_run(plan_, config, results, run_id, on_record=None, *, resume, peaks,
                 left_out, shard, pairs):
        calls.append((resume, list(pairs), left_out, run_id))
        events.append("run")
        return [f"records after {len(calls)} points"]

    monkeypatch.setattr(runner, "run", fake_run)
    monkeypatch.setattr(cuda_timers, "release_device_memory", lambda: events.append("free"))
    records = run_point_major(plan, runner.RunConfig(), None, "r1", left_out=["x: big"])
    assert calls == [(index > 0, [("a", c.case_id), ("b", c.case_id)], ["x: big"], "r1")
                     for index, c in enumerate(cases)]
    assert events == ["run", "free"] * 3
    assert records == ["records after 3 points"]


def test_workloads_follow_the_order_of_the_patterns() -> None:
    sweep = Sweep(modes=("decode",), layouts=("llama3.1-8b",), batch_sizes=(1, 8, 32),
                  contexts=(1024, 4096), block_sizes=(16,), dtypes=("bfloat16",),
                  workload_patterns=("*-32q1s4k", "*-8q1s1k", "*-q1s*"))
    assert [w.name for w in sweep.workloads()] == [
        "decode-llama3.1-8b-32q1s4k", "decode-llama3.1-8b-8q1s1k",
        "decode-llama3.1-8b-q1s1k", "decode-llama3.1-8b-q1s4k"]
    again = sweep.with_(workload_patterns=tuple(w.name for w in sweep.workloads()))
    assert [c.case_id for c in again.cases()] == [c.case_id for c in sweep.cases()]


def test_points_keeps_the_first_n(capsys: pytest.CaptureFixture) -> None:
    assert cli.main(["bench", "--quick", "--dry-run", "--points", "2"]) == 0
    printed = [line for line in capsys.readouterr().out.splitlines()
               if not line.startswith(("left out", " ")) and "points x" not in line]
    assert printed == [c.case_id for c in bench.QUICK_SWEEP.cases()[:2]]
