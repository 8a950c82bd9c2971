"""The physical floor (harness/results/floor.py): a pass whose time implies more bytes or
FLOPs per second than its device can reach is a ``fail`` of step ``floor``, never ranked,
in the runner's records, in reports and in the gate; a possible time is left alone."""

from __future__ import annotations

import json

import numpy as np
import pytest

from pagedbench.harness.cli import main
from pagedbench.harness.gate import compare as gate
from pagedbench.harness.measure.speed import Outcome
from pagedbench.harness.results import derived, floor, report, site
from pagedbench.harness.results.record import DevicePeaks, TimingStats
from pagedbench.harness.results.store import read_lines, results_of
from pagedbench.harness.verdict.status import ExitCode, Status
from pagedbench.reference import PagedCase

from ..conftest import ENV, result

CPU = DevicePeaks(copy_gbps=10.0, bf16_tflops=0.5, method="torch_timer", cache_copy_gbps=40.0)
GPU = DevicePeaks(copy_gbps=3000.0, bf16_tflops=700.0, method="cuda_events",
                  cache_copy_gbps=7000.0)
OLD = DevicePeaks(copy_gbps=10.0, bf16_tflops=0.5, method="torch_timer")
#: 8 decodes over 2048 keys, one KV head of 128 in bf16: K and V are 2 x 16384 x 256
#: bytes = 8 MiB, Q and O 2 x 8 x 8 x 256 bytes, the tables 8 x 128 x 4 bytes.
CASE = PagedCase(kv_lens=(2048,) * 8, num_q_heads=8, num_kv_heads=1, head_dim=128,
                 block_size=16, dtype="bfloat16", name="floor")
MOVED = 2 * 16384 * 256 + 2 * 8 * 8 * 256 + 8 * 128 * 4
GIGA = 10**9


def ms_at(gbps: float, moved: int = GIGA) -> float:
    """The median time (ms) at which ``moved`` bytes go at ``gbps``."""
    return moved / (gbps * 1e9) * 1e3


@pytest.mark.parametrize("method, peaks, ceiling", [
    ("cuda_events", GPU, 2 * 3000.0),   # the cache cleared: twice the copy bandwidth
    ("cuda_graph", GPU, 4 * 7000.0),    # a warm L2: four times its copy
    ("torch_timer", CPU, 4 * 40.0),     # blocks of calls on the CPU: the same
    ("torch_timer", OLD, 4 * 8 * 10.0),  # no in-cache copy recorded: 8x the copy assumed
    ("perf_counter", CPU, 4 * 40.0),
])
def test_bandwidth_ceilings(method, peaks, ceiling) -> None:
    assert floor.refusal(GIGA, 0, ms_at(0.95 * ceiling), method, peaks) == ""
    reason = floor.refusal(GIGA, 0, ms_at(1.05 * ceiling), method, peaks)
    assert reason.startswith("physical floor: ") and f"{ceiling:.4g} GB/s" in reason


def test_flops_ceiling_only_against_gpu_peaks() -> None:
    seconds = 1e-3
    work = int(4.2 * 700.0 * 1e12 * seconds)  # 4.2x the bf16 rate: past fp8's headroom
    assert "TFLOP/s" in floor.refusal(1, work, seconds * 1e3, "cuda_events", GPU)
    assert floor.refusal(1, int(3.8 * 700.0 * 1e12 * seconds), seconds * 1e3,
                         "cuda_events", GPU) == ""
    # A CPU's bf16 matmul is no ceiling: a thousand times it is not refused.
    assert floor.refusal(1, int(1000 * 0.5e12 * seconds), seconds * 1e3, "torch_timer",
                         CPU) == ""


@pytest.mark.parametrize("method, peaks", [("interpreted", CPU), ("torch_timer", None)])
def test_unranked_or_unmeasured_points_are_not_judged(method, peaks) -> None:
    assert floor.refusal(GIGA, GIGA, 1e-9, method, peaks) == ""


def timed(impl: str, ms: float, *, peaks=CPU, case=CASE, suite="run", **changes):
    """A pass of ``impl`` on ``case`` with 9 samples at ``ms`` and ``peaks`` recorded."""
    record = result(impl, case, "pass", ms, peaks=peaks, suite=suite, **changes)
    stats = TimingStats(median=ms, p10=ms, p90=ms, iqr=0.0, n=9, method="torch_timer",
                        samples=[ms] * 9, noisy=False, probe=[])
    return record.model_copy(update={"time_ms": stats, "time_ms_median": ms})


def test_judged_refuses_an_impossible_pass_and_keeps_its_time() -> None:
    assert timed("x", 1.0).bytes_moved == MOVED
    fast = timed("x", ms_at(4 * 40.0 * 1.5, MOVED))  # 240 GB/s against 160
    refused = floor.judged(fast)
    assert (refused.status, refused.step) == (Status.FAIL, floor.STEP)
    assert refused.time_ms == fast.time_ms and refused.reason.startswith("physical floor: ")
    assert f"{MOVED / 1e6:.4g} MB" in refused.reason and "240 GB/s" in refused.reason
    honest = timed("x", ms_at(4 * 40.0 * 0.5, MOVED))
    assert floor.judged(honest) is honest
    failed = fast.model_copy(update={"status": Status.FAIL, "reason": "wrong"})
    assert floor.judged(failed) is failed


def test_a_line_whose_peaks_have_no_in_cache_copy_is_read_and_judged(tmp_path) -> None:
    """Lines written before the in-cache copy was measured keep reading; their warm
    timings are judged against the assumed factor."""
    line = json.loads(timed("x", ms_at(300.0, MOVED), peaks=OLD).model_dump_json())
    del line["peaks"]["cache_copy_gbps"]
    path = tmp_path / "old.jsonl"
    path.write_text(json.dumps(line) + "\n")
    (record,) = read_lines([path])
    assert record.peaks.cache_copy_gbps is None and record.status is Status.PASS
    assert floor.judged(record).status is Status.PASS  # 300 GB/s under 4 x 8 x 10
    faster = record.model_copy(update={"time_ms": record.time_ms.model_copy(
        update={"median": ms_at(330.0, MOVED)})})
    assert floor.judged(faster).step == floor.STEP


def test_report_never_ranks_a_refused_time() -> None:
    records = [timed("slow", ms_at(20.0, MOVED)), timed("honest", ms_at(50.0, MOVED)),
               timed("memo", ms_at(5000.0, MOVED))]
    table = report.leaderboard(report.frame(results_of(records)))
    assert table.loc[CASE.case_id, "honest"].startswith("**pass")
    assert table.loc[CASE.case_id, "memo"] == "fail"
    text = report.markdown(records)
    assert "memo: fail: physical floor: 5000 GB/s" in text
    (environment,) = site.environments(records)  # the site's board reads them the same way
    assert {r.impl: r.status for r in environment["records"]} == {
        "slow": Status.PASS, "honest": Status.PASS, "memo": Status.FAIL}


def test_bench_scores_never_count_a_refused_time() -> None:
    records = [timed(name, ms_at(gbps, MOVED), suite="bench", workload="floor")
               for name, gbps in (("sdpa-contiguous", 20.0), ("memo", 5000.0))]
    frame = derived.bench_frame(results_of(records)).set_index("impl")
    assert not frame.loc["memo", "timed"] and np.isnan(frame.loc["memo", "speedup"])
    assert frame.loc["memo", "failing"] and frame.loc["sdpa-contiguous", "timed"]


def test_gate_breaks_on_a_refused_time(tmp_path, capsys) -> None:
    baseline = [timed("x", ms_at(20.0, MOVED))]
    current = [timed("x", ms_at(5000.0, MOVED))]
    (point,) = gate.compare(results_of(baseline), results_of(current)).points
    assert point.outcome is Outcome.BROKEN and "physical floor" in point.reason
    paths = []
    for name, records in (("base", baseline), ("now", current)):
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(r.model_dump_json() + "\n" for r in records))
        paths.append(str(path))
    code = main(["gate", "--baseline", paths[0], "--current", paths[1]])
    assert code == ExitCode.REGRESSION, capsys.readouterr().out


def test_run_refuses_a_time_past_the_peaks_it_was_given(tmp_path, capsys) -> None:
    """``pagedbench run --peaks``: torch-gather's real timings against peaks a thousand
    times below any device's are refused, exit 1, with the reason in the report."""
    peaks = tmp_path / "peaks.json"
    peaks.write_text(json.dumps({"peaks": {"copy_gbps": 1e-3, "bf16_tflops": 1e-6,
                                           "method": "torch_timer", "cache_copy_gbps": 1e-3}}))
    code = main(["run", "--impl", "torch-gather", "--preset", "llama3.1-70b-tp8",
                 "--block-size", "16", "--dtype", "float32", "--repetitions", "2",
                 "--peaks", str(peaks), "--results-dir", str(tmp_path / "out")])
    out = capsys.readouterr().out
    assert code == ExitCode.CONFORMANCE_FAILURE, out
    (path,) = (tmp_path / "out").glob("*.jsonl")
    records = [line for line in read_lines([path]) if line.kind == "result"]
    assert records and all((r.status, r.step) == (Status.FAIL, floor.STEP)
                           and r.time_ms is not None and r.max_err_ulps is not None
                           for r in records)
    assert "physical floor" in path.with_suffix(".md").read_text()
