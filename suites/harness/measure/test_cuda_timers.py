"""The CUDA timing rules, on the CPU: one method per point for every implementation, graph
replay rotating more than 5 L2s of inputs, at least the gate's minimum of samples, the
clock and temperature around each point, the cold timing kept when the graph attempt
raises anything, and the bytes a point moves (head_dim_v; a latent cache once).

There is no GPU here: :class:`SimulatedDevice` stands in for
:class:`~pagedbench.harness.measure.cuda_timers.CudaDevice` with a clock that each call,
flush and replay advances by a known number of milliseconds, so the samples the timers
return are checked against values computed here.
"""

from __future__ import annotations

import math

import pytest

from pagedbench.harness.lane.sweep import CUDA_SELECTION
from pagedbench.harness.measure import cuda_timers
from pagedbench.harness.measure.speed import Thresholds
from pagedbench.harness.measure.timing import (MAX_COPIES, ROTATE_PAST_L2, PointPlan, point_plan,
                                               time_cuda, time_cuda_point)
from pagedbench.harness.measure.roofline import bytes_moved, flops
from pagedbench.reference import PagedCase

#: An H200's L2 (``L2_cache_size``: 60 MiB).
H200_L2 = 60 * 2**20
FLUSH_MS = 0.07


class SimulatedDevice:
    """Events stamp a simulated clock (ms); a call advances it by its cost, a flush by
    :data:`FLUSH_MS`, a replay by the costs of the calls captured. Records what each
    graph captured and every flush."""

    def __init__(self, capture_error: BaseException | None = None) -> None:
        self.now = 0.0
        self.captured: list[list[object]] = []
        self.flushes = 0
        self.capture_error = capture_error
        self.reads = 0

    class _Event:
        def __init__(self, device: SimulatedDevice) -> None:
            self.device, self.at = device, None

        def record(self) -> None:
            self.at = self.device.now

        def elapsed_time(self, end: SimulatedDevice._Event) -> float:
            return end.at - self.at

    class _Buffer:
        def __init__(self, device: SimulatedDevice) -> None:
            self.device = device

        def zero_(self) -> None:
            self.device.flushes += 1
            self.device.now += FLUSH_MS

    def event(self) -> SimulatedDevice._Event:
        return self._Event(self)

    def synchronize(self) -> None:
        pass

    def flush_buffer(self, nbytes: int) -> SimulatedDevice._Buffer:
        assert nbytes >= 4 * H200_L2
        return self._Buffer(self)

    def capture(self, calls):
        if self.capture_error is not None:
            raise self.capture_error
        self.captured.append(list(calls))
        before = self.now
        for call in calls:
            call()
        cost = self.now - before
        self.now = before  # capture records, it does not run

        def replay() -> None:
            self.now += cost
        return replay

    def conditions(self):
        self.reads += 1
        return (1980.0, 44.0) if self.reads % 2 else (1755.0, 51.0)


class Implementation:
    """A stand-in implementation: ``calls(copies)`` gives one call per input copy, each
    advancing the device clock by ``ms`` and counting its runs."""

    def __init__(self, device: SimulatedDevice, ms: float) -> None:
        self.device, self.ms = device, ms
        self.runs: dict[int, int] = {}

    def calls(self, copies: int):
        def call(copy: int):
            def run() -> None:
                self.runs[copy] = self.runs.get(copy, 0) + 1
                self.device.now += self.ms
            return run
        return [call(i) for i in range(copies)]


def lane_points() -> list[PagedCase]:
    return CUDA_SELECTION.sweep.cases()


def test_the_method_depends_on_the_point_alone() -> None:
    """Below 5 L2s of bytes: graph replay over ceil(5 L2 / bytes) + 1 copies; at or above:
    cold events. Every implementation at a point gets the same plan, however fast."""
    small = PagedCase(kv_lens=(1024,), num_q_heads=32, num_kv_heads=8, head_dim=128,
                      block_size=16, dtype="bfloat16")
    moved = bytes_moved(small)
    plan = point_plan(small, H200_L2)
    assert plan == PointPlan("cuda_graph", math.ceil(5 * H200_L2 / moved) + 1, moved, H200_L2,
                             Thresholds.min_samples)
    big = small.with_(kv_lens=(1024,) * 80)
    assert bytes_moved(big) >= ROTATE_PAST_L2 * H200_L2
    assert point_plan(big, H200_L2).method == "cuda_events"
    assert point_plan(big, H200_L2).copies == 1
    for case in (small, big):
        methods = set()
        for ms in (0.004, 0.05, 3.0):  # three implementations of the point
            device = SimulatedDevice()
            impl = Implementation(device, ms)
            plan = point_plan(case, H200_L2)
            methods.add(time_cuda_point(impl.calls(plan.copies), plan, device).method)
        assert methods == {point_plan(case, H200_L2).method}
    with pytest.raises(ValueError, match="l2_bytes >= 1"):
        point_plan(small, 0)


def test_graph_mode_rotates_more_than_five_l2_of_inputs() -> None:
    """At every point of the GPU lane that an H200 times by graph replay, the graph holds
    one call on each of more than 5 L2s of distinct input copies, each captured once."""
    graphed = 0
    for case in lane_points():
        plan = point_plan(case, H200_L2)
        if plan.method != "cuda_graph":
            continue
        graphed += 1
        assert plan.copies <= MAX_COPIES
        assert plan.rotated_bytes > ROTATE_PAST_L2 * H200_L2, case.case_id
        device = SimulatedDevice()
        impl = Implementation(device, 0.01)
        calls = impl.calls(plan.copies)
        timing = time_cuda_point(calls, plan, device)
        assert timing.method == "cuda_graph" and timing.copies == plan.copies
        (captured,) = device.captured
        assert captured == calls  # every copy once, in turn
        assert len({id(c) for c in captured}) * plan.moved_bytes > 5 * H200_L2
    assert graphed >= 5  # the lane's small decode points


@pytest.mark.parametrize("ms", [2**-8, 0.75, 40.0, 400.0])  # exact in binary
def test_samples_reach_the_gates_minimum(ms: float) -> None:
    """However slow the call, cold events and graph replay take at least the gate's
    minimum of samples; a fast call fills about 100 ms, at most 500 samples; each cold
    call follows its own flush; a graph sample is one replay over its 7 copies, whose
    calls ran once eagerly and once while captured, never per replay."""
    minimum = Thresholds.min_samples

    def expected(per_sample_ms: float) -> int:
        return max(minimum, min(math.ceil(cuda_timers.REP_MS / per_sample_ms),
                                cuda_timers.MAX_SAMPLES))

    device = SimulatedDevice()
    impl = Implementation(device, ms)
    timing = time_cuda_point(impl.calls(1), PointPlan("cuda_events", 1, 10**9, H200_L2),
                             device)
    assert timing.method == "cuda_events" and timing.n == expected(ms) >= minimum
    assert device.flushes == timing.n
    assert timing.samples_ms == pytest.approx((ms,) * timing.n)
    device = SimulatedDevice()
    impl = Implementation(device, ms)
    timing = time_cuda_point(impl.calls(7), PointPlan("cuda_graph", 7, 10**6, H200_L2),
                             device)
    assert timing.method == "cuda_graph" and timing.n == expected(7 * ms) >= minimum
    assert timing.samples_ms == pytest.approx((ms,) * timing.n)
    assert {copy: impl.runs[copy] for copy in range(1, 7)} == dict.fromkeys(range(1, 7), 2)
    # time_cuda: the cold method alone, on the device torch sees.
    assert "min_samples" in time_cuda.__kwdefaults__
    assert time_cuda.__kwdefaults__["min_samples"] == minimum


def test_clock_and_temperature_around_each_point_after_a_preroll() -> None:
    """The pre-roll runs the call back to back for about 50 ms before the first read."""
    device = SimulatedDevice()
    impl = Implementation(device, 0.5)
    plan = PointPlan("cuda_events", 1, 10**9, H200_L2)
    timing = time_cuda_point(impl.calls(1), plan, device)
    # 1 first call, 1 timed, 100 back to back (50 ms / 0.5 ms), then the samples.
    assert impl.runs[0] == 1 + 1 + 100 + timing.n
    assert timing.sm_clock_mhz == (1980.0, 1755.0)
    assert timing.temperature_c == (44.0, 51.0)
    record = timing.to_dict()
    assert record["copies"] == 1 and record["sm_clock_mhz"] == [1980.0, 1755.0]


@pytest.mark.parametrize("error", [RuntimeError("operation not permitted when stream is "
                                                "capturing"),
                                   ValueError("an adapter's own error"),
                                   KeyError("anything")])
def test_any_exception_in_the_graph_attempt_keeps_the_cold_timing(error) -> None:
    device = SimulatedDevice(capture_error=error)
    impl = Implementation(device, 0.02)
    plan = PointPlan("cuda_graph", 4, 10**6, H200_L2)
    timing = time_cuda_point(impl.calls(4), plan, device)
    assert timing.method == "cuda_events" and timing.copies == 1
    assert timing.samples_ms == pytest.approx((0.02,) * timing.n)
    assert timing.fallback.startswith(f"graph replay raised {type(error).__name__}")
    assert timing.n >= Thresholds.min_samples


def test_calls_must_match_the_plans_copies() -> None:
    plan = PointPlan("cuda_graph", 3, 10**6, H200_L2)
    impl = Implementation(SimulatedDevice(), 0.1)
    with pytest.raises(ValueError, match="needs 3 calls"):
        time_cuda_point(impl.calls(2), plan, SimulatedDevice())


def test_mla_bytes_count_the_latent_cache_once() -> None:
    """DeepSeek-V3's MLA decode, bf16: Q 576 and O 512 channels per query head; the latent
    cache (576 channels per token, V its first 512) read once; the block tables."""
    case = PagedCase(kv_lens=(100, 300), num_q_heads=16, num_kv_heads=1, head_dim=576,
                     head_dim_v=512, latent_cache=True, block_size=64, dtype="bfloat16")
    q, o = 2 * 16 * 576 * 2, 2 * 16 * 512 * 2
    cache = (100 + 300) * 1 * 576 * 2
    tables = (2 + 5) * 4
    assert bytes_moved(case) == q + o + cache + tables
    # The same shapes with a separate V of 512 channels read K and V.
    separate = case.with_(latent_cache=False)
    assert bytes_moved(separate) == q + o + cache + (100 + 300) * 512 * 2 + tables
    # Two matmuls: 2 * 576 (Q K^T) + 2 * 512 (P V) FLOPs per head per key.
    assert flops(case) == (2 * 576 + 2 * 512) * 16 * 400


def test_new_inputs_come_before_the_first_call_and_each_cold_sample_outside_its_events() -> None:
    """``before(k)`` and ``after(k, out)`` wrap call 0 (the pre-roll's first) and each cold
    sample ``k = 1 + i``; what they queue (writing new inputs, 0.5 ms; copying an output,
    0.3 ms) is outside the samples, which stay the call's own 2 ms."""
    device = SimulatedDevice()
    events: list[tuple[str, int]] = []
    runs = [0]

    def call() -> int:
        runs[0] += 1
        device.now += 2.0
        return runs[0]

    def before(k: int) -> None:
        events.append(("before", k))
        device.now += 0.5

    def after(k: int, out: object) -> None:
        events.append(("after", k))
        assert out == runs[0]
        device.now += 0.3

    timing = time_cuda_point([call], PointPlan("cuda_events", 1, 10**9, H200_L2), device,
                             before=before, after=after)
    samples = len(timing.samples_ms)
    assert events == [("before", 0), ("after", 0)] + [
        (step, k) for k in range(1, samples + 1) for step in ("before", "after")]
    assert all(ms == pytest.approx(2.0) for ms in timing.samples_ms)
