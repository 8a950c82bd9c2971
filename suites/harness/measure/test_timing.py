"""Timing statistics, CPU timers and the drift probe, derived bytes, FLOPs and roofline floor."""

from __future__ import annotations

import itertools

import pytest
import torch

from pagedbench.harness.measure.timing import DriftProbe, Timing, oversubscribed, time_cpu
from pagedbench.harness.measure.roofline import bytes_moved, flops
from pagedbench.reference import PagedCase


def test_time_cpu_measures_a_known_sleep() -> None:
    import time

    timing = time_cpu(lambda: time.sleep(0.01), threads=1, warmup=1, min_samples=5,
                      min_run_time_s=0.05, max_run_time_s=1.0)
    assert timing.method == "torch_timer" and timing.n >= 5
    assert len(timing.samples_ms) == timing.n
    assert 10.0 <= timing.median_ms < 30.0
    assert timing.p10_ms <= timing.median_ms <= timing.p90_ms
    assert timing.to_dict()["samples"] == list(timing.samples_ms)


def test_time_cpu_times_the_drift_probe_after_every_block(monkeypatch) -> None:
    import time

    from pagedbench.harness.measure import timing as timing_module

    calls = []
    fn = lambda: (calls.append("fn"), time.sleep(0.01))  # noqa: E731
    probe = lambda: (calls.append("probe"), time.sleep(0.002))  # noqa: E731
    # The one-call estimates fixed (10 and 2 ms), so the block sizes do not depend on
    # this host's load: blocks of 1 call, probe blocks of round(0.5 * 10 / 2) = 2 calls.
    estimates = {fn: 10.0, probe: 2.0}
    monkeypatch.setattr(timing_module, "time_once",
                        lambda f, method="interpreted": Timing((estimates[f],), method))
    timing = time_cpu(fn, threads=1, warmup=1, min_samples=5, min_run_time_s=0.05,
                      max_run_time_s=1.0, probe=probe)
    assert len(timing.probe_ms) == timing.n >= 5
    assert all(2.0 <= y < 10.0 for y in timing.probe_ms)  # ms per drift probe call
    assert 10.0 <= timing.median_ms < 30.0  # the drift probe's time is not the sample's
    # After the warm-up call of each, every block of calls (Timer.timeit: 2 warm-up calls,
    # then 1 timed) is followed by a probe block of 2 calls.
    assert calls[:2] == ["fn", "probe"]
    runs = [(name, len(list(group))) for name, group in itertools.groupby(calls[2:])]
    assert runs == [("fn", 3), ("probe", 2)] * timing.n
    assert timing.to_dict()["probe"] == list(timing.probe_ms)


def test_time_cpu_resizes_its_blocks_when_the_one_call_estimate_was_short(monkeypatch) -> None:
    import time

    from pagedbench.harness.measure import timing as timing_module

    # Estimated at 1 ms, each call takes 10 ms: blocks planned at 0.2 s / 10 = 20 ms hold
    # 20 calls (200 ms, over 2 x 20 ms), so the next blocks hold int(20 / 10) = 2 calls
    # and 10 samples fit in the 1 s limit (without re-sizing: 5 blocks of 200 ms).
    calls = []
    fn = lambda: (calls.append(1), time.sleep(0.01))  # noqa: E731
    monkeypatch.setattr(timing_module, "time_once",
                        lambda f, method="interpreted": Timing((1.0,), method))
    timing = time_cpu(fn, threads=1, warmup=0, min_samples=10, min_run_time_s=0.2,
                      max_run_time_s=1.0)
    assert timing.n >= 10
    assert 10.0 <= timing.median_ms < 30.0


@pytest.mark.parametrize("threads, load, cores, warned", [
    (1, 8.0, 2, False), (2, 0.0, 2, False), (2, 0.5, 2, True), (4, 3.0, 8, False),
    (8, 1.0, 8, True)])
def test_a_thread_count_that_oversubscribes_the_host_is_warned_of(threads, load, cores,
                                                                   warned) -> None:
    warning = oversubscribed(threads, load, cores)
    assert bool(warning) is warned
    assert not warned or f"--threads {threads} on a host with load average {load:.1f}" in warning


def test_the_drift_probe_is_dense_attention_of_the_cases_shapes() -> None:
    case = PagedCase(kv_lens=(0, 37, 5), q_lens=(1, 4, 0), num_q_heads=4, num_kv_heads=2,
                     head_dim=16, block_size=8, dtype="bfloat16")
    probe = DriftProbe(case)
    assert probe.enabled
    # The one sequence with a query and a key: its tensors, then SDPA on them.
    ((q, k, v),) = probe._sequences
    assert q.shape == (1, 4, 4, 16) and k.shape == v.shape == (1, 2, 37, 16)
    assert q.dtype == k.dtype == torch.bfloat16
    probe()
    empty = PagedCase(kv_lens=(0,), num_q_heads=2, num_kv_heads=1, head_dim=8, block_size=4,
                      dtype="float32")
    assert not DriftProbe(empty).enabled


def test_an_implementation_that_replaces_the_clock_or_the_probes_attention_reaches_neither(
        monkeypatch) -> None:
    """A plug-in that replaced ``time.perf_counter`` by a clock at half speed timed 2.03x
    faster than its honest copy, and one that wrapped torch's SDPA to slow the drift probe
    as much as itself hid a 40% slowdown from the gate: both functions are bound when
    pagedbench loads, before any implementation."""
    import time

    real = time.perf_counter
    monkeypatch.setattr(time, "perf_counter", lambda: real() * 0.5)
    timing = time_cpu(lambda: time.sleep(0.01), threads=1, warmup=1, min_samples=3,
                      min_run_time_s=0.03, max_run_time_s=1.0,
                      before=lambda k: None, after=lambda k, out: None)
    assert timing.median_ms >= 10.0, timing.samples_ms  # 5 ms on the replaced clock
    wrapped = []
    sdpa = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda *a, **k: (wrapped.append(1), sdpa(*a, **k))[1])
    DriftProbe(PagedCase(kv_lens=(9,), num_q_heads=2, num_kv_heads=1, head_dim=8,
                         block_size=4, dtype="float32"))()
    assert wrapped == []


def test_time_cpu_stops_at_its_limit() -> None:
    import time

    start = time.perf_counter()
    timing = time_cpu(lambda: time.sleep(0.02), threads=1, warmup=0, min_samples=1000,
                      min_run_time_s=0.1, max_run_time_s=0.3)
    # 1000 samples of 20 ms would take 20 s; the limit cuts it to about 0.3 s of blocks.
    assert time.perf_counter() - start < 3.0
    assert 1 <= timing.n <= 20


def test_timing_statistics_match_numpy_percentiles() -> None:
    samples = (5.0, 1.0, 2.0, 4.0, 3.0, 10.0)
    timing = Timing(samples, "torch_timer")
    # numpy's linear percentiles by hand: sorted 1 2 3 4 5 10, position q/100 * 5.
    assert timing.median_ms == pytest.approx(3.5)
    assert timing.p10_ms == pytest.approx(1.5)
    assert timing.p90_ms == pytest.approx(7.5)
    assert timing.iqr_ms == pytest.approx(4.75 - 2.25)
    assert timing.noisy  # 2.5 / 3.5 > 0.1
    assert not Timing((1.0, 1.01, 0.99, 1.0), "torch_timer").noisy
    assert timing.samples_ms == samples  # kept in order
    with pytest.raises(ValueError, match="finite and > 0"):
        Timing((1.0, float("nan")), "torch_timer")
    with pytest.raises(ValueError, match="method"):
        Timing((1.0,), "stopwatch")
    with pytest.raises(ValueError, match="one drift probe block per sample"):
        Timing((1.0, 2.0), "torch_timer", (1.0,))
    with pytest.raises(ValueError, match="timing probe must be finite"):
        Timing((1.0,), "torch_timer", (0.0,))


def test_bytes_and_flops_from_actual_lengths() -> None:
    # bf16 (2 bytes): Q and O 2 tokens x 8 heads x 64; K and V (3 + 17) tokens x 2 heads x 64;
    # tables: 1 + 2 blocks of int32.
    case = PagedCase(kv_lens=(3, 17), num_q_heads=8, num_kv_heads=2, head_dim=64,
                     block_size=16, dtype="bfloat16")
    assert bytes_moved(case) == 2 * 2 * 8 * 64 * 2 + 2 * 20 * 2 * 64 * 2 + 3 * 4
    assert flops(case) == 4 * 64 * 8 * (3 + 17)
    # Prefill: query j of a 4-query sequence over 6 keys sees 3, 4, 5, 6 keys; window 2
    # cuts that to 2, 2, 2, 2.
    prefill = PagedCase(kv_lens=(6,), q_lens=(4,), num_q_heads=1, num_kv_heads=1,
                        head_dim=64, block_size=4, dtype="float32")
    assert flops(prefill) == 4 * 64 * (3 + 4 + 5 + 6)
    assert flops(prefill.with_(sliding_window=2)) == 4 * 64 * 8
    fp8 = case.with_(kv_cache_dtype="fp8_e4m3")  # K and V at 1 byte per element
    assert bytes_moved(fp8) == 2 * 2 * 8 * 64 * 2 + 2 * 20 * 2 * 64 * 1 + 3 * 4














def test_roofline_floor_is_the_slower_of_bytes_and_flops() -> None:
    from pagedbench.harness.measure.roofline import DevicePeaks, roofline_floor_ms

    peaks = DevicePeaks(copy_gbps=100.0, bf16_tflops=2.0, method="torch_timer")
    # 1e9 bytes at 100 GB/s: 10 ms; 1e12 FLOPs at 2 TFLOP/s: 500 ms.
    assert roofline_floor_ms(10**9, 10**12, peaks) == pytest.approx(500.0)
    assert roofline_floor_ms(10**9, 10**9, peaks) == pytest.approx(10.0)


def test_time_cpu_writes_new_inputs_before_every_call_outside_its_time() -> None:
    """With ``before`` and ``after``, every call (warm-up included) comes after
    ``before(k)``, its output goes to ``after(k, ...)``, in call order, and neither's
    time is in the samples: 5 ms of writing around a 1 ms call gives 1 ms samples."""
    import time

    events: list[tuple[str, int]] = []
    count = itertools.count()

    def fn() -> int:
        k = next(count)
        events.append(("call", k))
        time.sleep(0.001)
        return k

    def before(k: int) -> None:
        events.append(("before", k))
        time.sleep(0.005)

    def after(k: int, out: object) -> None:
        assert out == k
        events.append(("after", k))

    timing = time_cpu(fn, threads=1, warmup=2, min_samples=5, min_run_time_s=0.05,
                      max_run_time_s=1.0, before=before, after=after)
    made = len(events) // 3
    assert events == [(step, k) for k in range(made) for step in ("before", "call", "after")]
    assert sum(timing.calls) == made - 3  # 2 warm-up calls and the estimate untimed
    assert timing.n >= 5 and 1.0 <= timing.median_ms < 3.0
