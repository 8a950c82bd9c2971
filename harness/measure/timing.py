"""Timing: how long one ``run()`` takes, what it moves, and what the device can do.

- CPU: blocks of calls with the thread count fixed after warm-up calls; each sample is the
  mean time per call of one block, blocks sized so that ``min_samples`` of them fit in the
  run, which lasts at least ``min_run_time_s`` (longer for ``min_samples`` samples of a
  slow call) and never much longer than ``max_run_time_s``. A block is
  ``torch.utils.benchmark.Timer.timeit`` (as its ``blocked_autorange`` does), or, where
  new inputs are written before every call (an implementation's timing), calls timed one
  by one with ``time.perf_counter``, the writes outside the timed interval.
- CUDA: one method per point for every implementation (:func:`point_plan`, from the
  point's bytes and the device's L2 alone): cold CUDA events, an L2 flush before each
  call, for a point that moves at least :data:`ROTATE_PAST_L2` times the L2; below that,
  replay of a CUDA graph of calls on input copies rotated past that much (launch gaps
  gone, every call's inputs cold), the cold timing kept when the graph cannot be made.
  Each point starts with a pre-roll and records the SM clock and temperature before and
  after its samples; it takes at least the gate's minimum of samples (the loops are in
  :mod:`.cuda_timers`).

Every :class:`Timing` keeps its raw samples (ms, in order: the regression gate tests on
them), and derives median, p10/p90 and the IQR (numpy's linear percentiles); it is
``noisy`` when IQR / median exceeds :data:`NOISE_THRESHOLD`, the threshold of
``Timer.adaptive_autorange``. On the CPU each block is followed by a block of the
:class:`DriftProbe` (plain dense attention of the case's shapes): what another process's
load does to both is near the same at that moment, so the gate can judge sample / drift
probe and cancel a shared machine's drift between and within runs
(:mod:`pagedbench.harness.gate.compare`).

:func:`measure_peaks` measures the device's copy bandwidth, bf16 matmul throughput and
copy rate in cache with the same timers (:class:`~.roofline.DevicePeaks`: with a point's
bytes and FLOPs, its roofline floor; ``harness/results/floor.py`` bounds a point whose
data stays cached by the copy rate in cache).
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from time import perf_counter  # bound before any implementation loads (docs/trust.md)

import torch

from pagedbench.reference import PagedCase, resolve_device

from pagedbench.harness.measure import cuda_timers
from pagedbench.harness.measure.samples import METHODS, NOISE_THRESHOLD, Timing, time_once
from pagedbench.harness.measure.roofline import DevicePeaks, bytes_moved
from pagedbench.harness.measure.speed import Thresholds

#: A CUDA point that moves fewer bytes than this many times the L2 is timed by graph
#: replay of input copies rotated past as many bytes (FlashInfer's
#: ``calculate_rotation_count``: no rotation only when the inputs are at least 5x the L2).
ROTATE_PAST_L2 = 5
#: Most input copies a graph rotates (smaller points rotate less than ROTATE_PAST_L2 L2s:
#: on a 60 MB L2, points under 2.4 MB; the record says how many copies).
MAX_COPIES = 128


#: The probe's attention, bound when pagedbench loads, before any implementation does: one
#: that replaces ``torch.nn.functional.scaled_dot_product_attention`` (to slow the probe
#: as much as itself, so that the gate sees no change) does not reach it.
_SDPA = torch.nn.functional.scaled_dot_product_attention


class DriftProbe:
    """The fixed work timed after every block of a CPU timing: plain dense attention of
    the case's shapes, ``torch.nn.functional.scaled_dot_product_attention`` over
    contiguous random tensors made once (per sequence with a key: query ``(1,
    num_q_heads, q_len, head_dim)``, K ``(1, num_kv_heads, kv_len, head_dim)``, V with
    ``v_head_dim``; the case dtype, whatever the cache's; no mask, no feature).

    It moves and computes about what the case does, so another process's load or a clock
    change slows it about as it slows the implementation measured (a small in-cache
    matmul does not: docs/gate.md); it does not depend on the
    implementation's code. ``enabled`` is False for a case with no query
    or no key to attend (nothing to probe).
    """

    def __init__(self, case: PagedCase, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        dtype = case.torch_dtype

        def draw(heads: int, length: int, dim: int) -> torch.Tensor:
            return torch.randn(1, heads, length, dim, generator=generator).to(dtype)

        self._sequences = [
            (draw(case.num_q_heads, q, case.head_dim), draw(case.num_kv_heads, kv, case.head_dim),
             draw(case.num_kv_heads, kv, case.v_head_dim))
            for q, kv in zip(case.q_lens_or_decode, case.kv_lens) if q > 0 and kv > 0]

    @property
    def enabled(self) -> bool:
        return bool(self._sequences)

    def __call__(self) -> None:
        for q, k, v in self._sequences:
            _SDPA(q, k, v, enable_gqa=True)


#: A drift probe block lasts about this share of the block of calls it follows (at
#: least one probe call).
PROBE_SHARE = 0.5
#: A block that lasts more than this many times its planned length re-sizes the blocks
#: after it (the one-call estimate was too short).
RESIZE_FACTOR = 2.0


def oversubscribed(threads: int, load: float | None = None,
                   cores: int | None = None, workers: int = 1) -> str:
    """A warning when ``threads`` torch threads (in all, over ``workers`` CPU workers
    at once) plus the host's 1-minute load average (``os.getloadavg``, or ``load``)
    exceed its cores (``os.cpu_count``, or ``cores``): such timings wait for preempted
    threads (:data:`~pagedbench.harness.run.config.CPU_THREADS`); "" otherwise, and
    always for one thread."""
    load = os.getloadavg()[0] if load is None else load
    cores = (os.cpu_count() or 1) if cores is None else cores
    if threads <= 1 or load + threads <= cores:
        return ""
    if workers > 1:
        return (f"--devices cpu:{workers} with --threads {threads // workers} on a host with "
                f"load average {load:.1f} on {cores} cores: the workers' timings wait for "
                "each other's threads; fewer workers time without them")
    return (f"--threads {threads} on a host with load average {load:.1f} on {cores} cores: "
            "a multi-threaded call waits for preempted threads, so its times snap to "
            "scheduler slices (about 4 ms); --threads 1 times it without them")


def time_cpu(
    fn: Callable[[], object],
    *,
    threads: int,
    warmup: int = 1,
    min_samples: int = 10,
    min_run_time_s: float = 0.2,
    max_run_time_s: float = 2.0,
    probe: Callable[[], object] | None = None,
    before: Callable[[int], None] | None = None,
    after: Callable[[int, object], None] | None = None,
) -> Timing:
    """Time ``fn()`` on the CPU in blocks of calls.

    The run lasts ``run_time = clamp(max(min_run_time_s, min_samples * one call),
    max_run_time_s)``; each block runs ``max(1, run_time / min_samples / one call)`` calls,
    so that ``min_samples`` blocks fit in it, and blocks repeat until there are
    ``min_samples`` of them and ``min_run_time_s`` has passed, or ``max_run_time_s`` has.
    Each sample is one block's mean time per call; a block that lasts over
    :data:`RESIZE_FACTOR` times its planned length (a call slower than its estimate, or a
    preemption) re-sizes the blocks after it from its own time per call, so that
    ``min_samples`` still fit. With a ``probe``, each block is
    followed by a block of probe calls lasting about :data:`PROBE_SHARE` of it (its call
    count fixed after warm-up; ``time.perf_counter``, without the Timer's own warm-up
    calls), recorded as ``probe_ms``; its time counts towards neither limit.

    Without ``before``, a block is ``torch.utils.benchmark.Timer.timeit``. With it, every
    call ``k`` (warm-up included, 0 the first) is preceded by ``before(k)`` and followed by
    ``after(k, output)``, both untimed, and timed alone with ``time.perf_counter`` (the
    Timer would make warm-up calls of its own on unchanged inputs); "one call" is then a
    call with its ``before`` and ``after``, and the limits count their time too.

    Parameters
    ----------
    fn : callable
        One complete call of the implementation (no arguments; returns its output).
    threads : int
        torch threads while timing (``torch.set_num_threads``; the Timer's
        ``num_threads``).
    warmup : int
        Untimed calls first (caches, lazy initialisation); one more call, also untimed,
        estimates the call's duration.
    min_samples, min_run_time_s, max_run_time_s : int, float
        As above (samples; seconds).
    probe : callable, optional
        Fixed work timed after every block (:class:`DriftProbe`).
    before, after : callable, optional
        ``before(k)`` and ``after(k, output)`` around call ``k`` (new inputs written in
        place; the output of a judged call kept).

    Raises
    ------
    ValueError
        If ``warmup`` < 0, ``min_samples`` < 1, ``threads`` < 1 or the times are not
        positive and ordered.
    """
    if warmup < 0 or min_samples < 1 or threads < 1:
        raise ValueError(f"need warmup >= 0, min_samples >= 1 and threads >= 1, got "
                         f"{warmup}, {min_samples}, {threads}")
    if not 0 < min_run_time_s <= max_run_time_s:
        raise ValueError(f"need 0 < min_run_time_s <= max_run_time_s, got {min_run_time_s}, "
                         f"{max_run_time_s}")
    from torch.utils.benchmark import Timer

    made = itertools.count()

    def one_call() -> float:
        """Seconds of one call, between its ``before`` and ``after``."""
        k = next(made)
        before(k)
        start = perf_counter()
        out = fn()
        took = perf_counter() - start
        if after is not None:
            after(k, out)
        return took

    def block(calls: int) -> tuple[float, float]:
        """Seconds per call of ``calls`` calls, and the block's seconds in all."""
        if before is None:
            per_call_s = timer.timeit(calls).mean
            return per_call_s, per_call_s * calls
        start = perf_counter()
        timed_s = sum(one_call() for _ in range(calls))
        return timed_s / calls, perf_counter() - start

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for _ in range(warmup):
            fn() if before is None else one_call()
        if before is None:
            one_s = time_once(fn, "perf_counter").median_ms / 1e3
        else:
            start = perf_counter()
            one_call()
            one_s = perf_counter() - start
        if probe is not None:
            probe()
            probe_one_s = time_once(probe, "perf_counter").median_ms / 1e3
        run_time_s = min(max(min_run_time_s, min_samples * one_s), max_run_time_s)
        block_s = run_time_s / min_samples
        calls = max(1, int(block_s / one_s))
        timer = Timer(stmt="fn()", globals={"fn": fn}, num_threads=threads)
        if probe is not None:
            probe_calls = max(1, round(PROBE_SHARE * calls * one_s / probe_one_s))
        samples_ms: list[float] = []
        probe_ms: list[float] = []
        block_calls: list[int] = []
        spent_s = 0.0
        while True:
            per_call_s, block_wall_s = block(calls)
            samples_ms.append(per_call_s * 1e3)
            block_calls.append(calls)
            if probe is not None:
                probe_ms.append(_probe_block(probe, probe_calls))
            spent_s += block_wall_s
            if block_wall_s > RESIZE_FACTOR * block_s and calls > 1:
                resized = max(1, int(block_s * calls / block_wall_s))
                if probe is not None:
                    probe_calls = max(1, round(probe_calls * resized / calls))
                calls = resized
            if spent_s >= max_run_time_s or (len(samples_ms) >= min_samples
                                             and spent_s >= min_run_time_s):
                break
    finally:
        torch.set_num_threads(previous)
    return Timing(tuple(samples_ms), "torch_timer", tuple(probe_ms),
                  calls=tuple(block_calls))


def _probe_block(probe: Callable[[], object], calls: int) -> float:
    """Milliseconds per call of ``calls`` probe calls (with the caller's torch threads)."""
    start = perf_counter()
    for _ in range(calls):
        probe()
    return (perf_counter() - start) * 1e3 / calls


@dataclass(frozen=True)
class PointPlan:
    """How every implementation is timed at one point on one CUDA device
    (:func:`point_plan`).

    Attributes
    ----------
    method : str
        ``"cuda_events"`` or ``"cuda_graph"``.
    copies : int
        Input copies a graph rotates over (1 with ``cuda_events``).
    moved_bytes, l2_bytes : int
        The point's :func:`bytes_moved` and the device's L2 size (bytes).
    min_samples : int
        Fewest samples taken (the gate's ``Thresholds.min_samples``).
    """

    method: str
    copies: int
    moved_bytes: int
    l2_bytes: int
    min_samples: int = Thresholds.min_samples

    @property
    def rotated_bytes(self) -> int:
        """Bytes the rotation passes between two uses of one copy's inputs, at least."""
        return self.copies * self.moved_bytes


def point_plan(case: PagedCase, l2_bytes: int,
               min_samples: int = Thresholds.min_samples) -> PointPlan:
    """The timing method of ``case`` on a device with ``l2_bytes`` of L2, the same for
    every implementation: ``cuda_events`` when :func:`bytes_moved` is at least
    :data:`ROTATE_PAST_L2` L2s, else ``cuda_graph`` over ``ceil(ROTATE_PAST_L2 * l2 /
    moved) + 1`` copies (FlashInfer's count), at most :data:`MAX_COPIES`.

    Raises
    ------
    ValueError
        If ``l2_bytes`` < 1 or ``min_samples`` < 1.
    """
    if l2_bytes < 1 or min_samples < 1:
        raise ValueError(f"need l2_bytes >= 1 and min_samples >= 1, got {l2_bytes}, "
                         f"{min_samples}")
    moved = bytes_moved(case)
    if moved >= ROTATE_PAST_L2 * l2_bytes:
        return PointPlan("cuda_events", 1, moved, l2_bytes, min_samples)
    copies = min(math.ceil(ROTATE_PAST_L2 * l2_bytes / moved) + 1, MAX_COPIES)
    return PointPlan("cuda_graph", copies, moved, l2_bytes, min_samples)


def device_l2_bytes(device: str | torch.device | None = None) -> int:
    """The L2 cache size of a CUDA device (bytes; ``L2_cache_size`` of its properties)."""
    return int(torch.cuda.get_device_properties(device).L2_cache_size)


def time_cuda_point(calls: Sequence[Callable[[], object]], plan: PointPlan,
                    device: cuda_timers.CudaDevice | None = None,
                    before: Callable[[int], None] | None = None,
                    after: Callable[[int, object], None] | None = None) -> Timing:
    """Time one implementation at one point as ``plan`` says: a pre-roll of ``calls[0]``,
    the SM clock and temperature, ``calls[0]`` cold (:func:`~.cuda_timers.cold_events`,
    at least ``plan.min_samples``); with ``cuda_graph``, then a graph of every call in
    turn (:func:`~.cuda_timers.graph_replay`), whose timing replaces the cold one unless
    its attempt raises anything (then ``fallback`` says what); the clock and temperature
    again.

    Parameters
    ----------
    calls : sequence of callables
        One complete call of the implementation per input copy (``plan.copies`` of
        them), each on its own inputs and output; ``calls[0]`` alone with
        ``cuda_events``.
    plan : PointPlan
        The point's :func:`point_plan`.
    device : CudaDevice, optional
        The current CUDA device when None.
    before, after : callable, optional
        ``before(k)`` and ``after(k, output)`` around call ``k`` of ``calls[0]``: 0 the
        pre-roll's first, ``1 + i`` cold sample ``i`` (outside its events); the pre-roll's
        other calls and a graph's take none.

    Raises
    ------
    ValueError
        If ``len(calls)`` is not ``plan.copies``.
    RuntimeError
        If CUDA is not available (and no ``device`` is given).
    """
    if len(calls) != plan.copies:
        raise ValueError(f"{plan.method} at this point needs {plan.copies} calls (one per "
                         f"input copy), got {len(calls)}")
    if device is None:
        if not torch.cuda.is_available():
            raise RuntimeError("time_cuda_point needs a CUDA device; none is visible to torch")
        device = cuda_timers.CudaDevice()
    if before is not None:
        before(0)
    per_call_ms = cuda_timers.preroll(device, calls[0], after_first=None if after is None
                                      else lambda out: after(0, out))
    clock_before, temperature_before = device.conditions()
    count = cuda_timers.sample_count(per_call_ms, plan.min_samples)
    samples = cuda_timers.cold_events(
        device, calls[0], count, before=None if before is None else lambda i: before(i + 1),
        after=None if after is None else lambda i, out: after(i + 1, out))
    method, copies, fallback = "cuda_events", 1, None
    if plan.method == "cuda_graph":
        try:
            samples = cuda_timers.graph_replay(device, calls, per_call_ms, plan.min_samples)
            method, copies = "cuda_graph", plan.copies
        except Exception as exc:  # noqa: BLE001 (whatever the implementation raises)
            fallback = f"graph replay raised {type(exc).__name__}: {str(exc)[:300]}"
            with contextlib.suppress(Exception):
                device.synchronize()
    clock_after, temperature_after = device.conditions()
    return Timing(tuple(samples), method, copies=copies,
                  sm_clock_mhz=(clock_before, clock_after),
                  temperature_c=(temperature_before, temperature_after), fallback=fallback)


def time_cuda(fn: Callable[[], object], *,
              min_samples: int = Thresholds.min_samples) -> Timing:
    """Time ``fn()`` on the current CUDA device with cold CUDA events (an L2 flush
    before each call, at least ``min_samples``): :func:`time_cuda_point` with one copy.

    Raises
    ------
    RuntimeError
        If CUDA is not available.
    """
    return time_cuda_point([fn], PointPlan("cuda_events", 1, 0, 1, min_samples))


#: Bytes of the copy that measures bandwidth (far beyond any cache: 256 MiB on the CPU,
#: 1 GiB on a GPU), and the matmul size that measures bf16 throughput.
COPY_BYTES = {"cpu": 256 * 2**20, "cuda": 2**30}
MATMUL_N = {"cpu": 512, "cuda": 8192}
#: Footprints (source plus destination, bytes) of the in-cache copies: from a CPU core's
#: L1 to its L2 and a slice of L3; within a GPU's L2 (4 MiB on a T4, 40-126 MiB on
#: A100 to B200), replayed as a CUDA graph so that the L2 stays warm.
CACHE_COPY_BYTES = {"cpu": (64 * 2**10, 256 * 2**10, 2**20, 4 * 2**20),
                    "cuda": (2 * 2**20, 8 * 2**20)}


def cache_copy_gbps(device: str, threads: int) -> float:
    """The fastest copy rate of ``device`` at the :data:`CACHE_COPY_BYTES` footprints,
    each timed over calls that leave source and destination in the cache (GB/s, bytes
    read plus written): what a point whose data stays cached between timed calls can move
    at most, beside the copy bandwidth of :data:`COPY_BYTES` (far past any cache).

    Raises
    ------
    PagedValueError
        If ``device`` is not a device of this machine.
    """
    resolved = resolve_device(device)
    best = 0.0
    for footprint in CACHE_COPY_BYTES[resolved.type]:
        src = torch.ones(footprint // 4, dtype=torch.bfloat16, device=resolved)  # half of it
        dst = torch.empty_like(src)
        copy = lambda: dst.copy_(src)  # noqa: E731
        if resolved.type == "cuda":
            with torch.cuda.device(resolved):
                # Graph replay of the one copy: its bytes stay in L2 between calls.
                timed = time_cuda_point([copy], PointPlan(
                    "cuda_graph", 1, 2 * src.nbytes, device_l2_bytes(resolved)))
        else:
            timed = time_cpu(copy, threads=threads, min_samples=5, min_run_time_s=0.05)
        best = max(best, 2 * src.nbytes / (timed.median_ms / 1e3) / 1e9)
    return best


def measure_peaks(device: str, threads: int) -> DevicePeaks:
    """Measure ``device``'s copy bandwidth, bf16 matmul throughput and in-cache copy rate
    (:func:`cache_copy_gbps`; medians).

    Raises
    ------
    PagedValueError
        If ``device`` is not a device of this machine.
    """
    resolved = resolve_device(device)
    kind = resolved.type
    src = torch.ones(COPY_BYTES[kind] // 2, dtype=torch.bfloat16, device=resolved)
    dst = torch.empty_like(src)
    n = MATMUL_N[kind]
    a = torch.randn(n, n, device=resolved).to(torch.bfloat16)
    b = torch.randn(n, n, device=resolved).to(torch.bfloat16)
    c = torch.empty(n, n, dtype=torch.bfloat16, device=resolved)
    copy = lambda: dst.copy_(src)  # noqa: E731
    matmul = lambda: torch.mm(a, b, out=c)  # noqa: E731
    if kind == "cuda":
        with torch.cuda.device(resolved):
            copy_t, mm_t = time_cuda(copy), time_cuda(matmul)
    else:
        copy_t = time_cpu(copy, threads=threads, min_samples=5, min_run_time_s=0.2)
        mm_t = time_cpu(matmul, threads=threads, min_samples=5, min_run_time_s=0.2)
    return DevicePeaks(copy_gbps=2 * src.nbytes / (copy_t.median_ms / 1e3) / 1e9,
                       bf16_tflops=2 * n**3 / (mm_t.median_ms / 1e3) / 1e12,
                       method=copy_t.method, cache_copy_gbps=cache_copy_gbps(device, threads))


__all__ = ["MAX_COPIES", "METHODS", "NOISE_THRESHOLD", "PROBE_SHARE",
           "ROTATE_PAST_L2", "DriftProbe", "PointPlan", "Timing", "cache_copy_gbps",
           "device_l2_bytes", "measure_peaks", "oversubscribed", "point_plan", "time_cpu",
           "time_cuda", "time_cuda_point", "time_once"]
