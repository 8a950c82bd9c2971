"""Timing: how long one ``run()`` takes, what it moves, and what the device can do.

- CPU: ``torch.utils.benchmark.Timer`` (``timeit`` of blocks of calls, as its
  ``blocked_autorange`` does) with the thread count fixed (``num_threads``) after warm-up
  calls; each sample is the mean time per call of one block, blocks sized so that
  ``min_samples`` of them fit in the run, which lasts at least ``min_run_time_s`` (longer
  for ``min_samples`` samples of a slow call) and never much longer than ``max_run_time_s``.
- CUDA: ``triton.testing.do_bench``, CUDA events with the L2 cache cleared before every
  call (cold-L2 timing, as FlashInfer's ``bench_gpu_time`` defaults to); a call faster
  than :data:`CUDA_GRAPH_BELOW_MS` is timed again by replaying a CUDA graph of many calls
  (``triton.testing.do_bench_cudagraph``: launch overhead amortised, warm L2).

Every :class:`Timing` keeps its raw samples (ms, in order: the regression gate tests on
them), and derives median, p10/p90 and the IQR (numpy's linear percentiles); it is
``noisy`` when IQR / median exceeds :data:`NOISE_THRESHOLD`, the threshold of
``Timer.adaptive_autorange``. On the CPU each block is followed by a block of the
:class:`DriftProbe` (plain dense attention of the case's shapes): what another process's
load does to both is near the same at that moment, so the gate can judge sample / drift probe and cancel a shared
machine's drift between and within runs (:mod:`pagedbench.harness.gate.compare`).

Derived bandwidth counts the bytes a case must move at least once (FlashInfer's
``attention_tb_per_sec_with_actual_seq_lens`` and tritonbench's ``decoding_attention``
count from the actual sequence lengths): Q, the K and V of every attended token, O, and
the block tables; FLOPs count the two matmuls. :func:`measure_peaks` measures the
device's copy bandwidth and bf16 matmul throughput with the same timers, so each point
has a roofline position: the floor ``max(bytes / bandwidth, flops / throughput)``; and
the copy rate in cache, which bounds what a point whose data stays cached can move
(``harness/results/floor.py``).
GB = 1e9 bytes, TFLOP = 1e12 FLOPs.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from pagedbench.reference import PagedCase, resolve_device

#: IQR / median above which a timing is flagged noisy (``Timer.adaptive_autorange``'s
#: default ``threshold``).
NOISE_THRESHOLD = 0.1
#: A CUDA call with a cold-L2 median below this (ms) is timed again by CUDA-graph replay.
CUDA_GRAPH_BELOW_MS = 0.1
#: Methods a timing may carry; only the first three are ever ranked.
METHODS = ("torch_timer", "cuda_events", "cuda_graph", "interpreted", "perf_counter")


@dataclass(frozen=True)
class Timing:
    """Latency samples of one implementation on one case, with their statistics.

    Attributes
    ----------
    samples_ms : tuple[float, ...]
        Milliseconds per call, one per repetition (a block of calls on the CPU, one call
        with ``cuda_events``, one graph replay with ``cuda_graph``), in order.
    probe_ms : tuple[float, ...]
        Milliseconds per :class:`DriftProbe` call of the block timed right after each
        sample (CPU only; empty otherwise).
    calls : tuple[int, ...]
        Calls each sample averaged (one per sample when empty).
    method : str
        One of :data:`METHODS`: ``torch_timer`` (CPU), ``cuda_events`` (``do_bench``,
        cold L2), ``cuda_graph`` (``do_bench_cudagraph``, warm L2), ``interpreted``
        (one wall-clock call of an interpreter: never ranked) or ``perf_counter``
        (records written before schema 3).

    Raises
    ------
    ValueError
        If there is no sample, a sample is not finite and > 0, the drift probe has not one
        block per sample, or the method is unknown.
    """

    samples_ms: tuple[float, ...]
    method: str
    probe_ms: tuple[float, ...] = ()
    calls: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        samples = tuple(float(s) for s in self.samples_ms)
        probe = tuple(float(s) for s in self.probe_ms)
        for name, values in (("samples", samples), ("probe", probe)):
            if not all(math.isfinite(s) and s > 0 for s in values):
                raise ValueError(f"timing {name} must be finite and > 0 ms, got {values[:5]}")
        if not samples:
            raise ValueError("a timing needs at least one sample")
        if probe and len(probe) != len(samples):
            raise ValueError(f"one drift probe block per sample: {len(probe)} for "
                             f"{len(samples)} samples")
        if self.calls and (len(self.calls) != len(samples) or min(self.calls) < 1):
            raise ValueError(f"calls must be one count >= 1 per sample, got {self.calls[:5]}")
        if self.method not in METHODS:
            raise ValueError(f"timing method {self.method!r} not in {METHODS}")
        object.__setattr__(self, "samples_ms", samples)
        object.__setattr__(self, "probe_ms", probe)

    def _percentile(self, q: float) -> float:
        return float(np.percentile(self.samples_ms, q))

    @property
    def n(self) -> int:
        return len(self.samples_ms)

    @property
    def median_ms(self) -> float:
        return self._percentile(50)

    @property
    def p10_ms(self) -> float:
        return self._percentile(10)

    @property
    def p90_ms(self) -> float:
        return self._percentile(90)

    @property
    def iqr_ms(self) -> float:
        """p75 - p25 (ms)."""
        return self._percentile(75) - self._percentile(25)

    @property
    def noisy(self) -> bool:
        """IQR / median > :data:`NOISE_THRESHOLD`."""
        return self.iqr_ms / self.median_ms > NOISE_THRESHOLD

    def to_dict(self) -> dict[str, object]:
        """The record's ``time_ms`` (:class:`~pagedbench.harness.results.record.TimingStats`)."""
        return {"median": self.median_ms, "p10": self.p10_ms, "p90": self.p90_ms,
                "iqr": self.iqr_ms, "n": self.n, "method": self.method,
                "samples": list(self.samples_ms), "noisy": self.noisy,
                "probe": list(self.probe_ms)}


def time_once(fn: Callable[[], object], method: str = "interpreted") -> Timing:
    """One wall-clock call (``time.perf_counter``), for an interpreter."""
    start = time.perf_counter()
    fn()
    return Timing(((time.perf_counter() - start) * 1e3,), method)


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
        sdpa = torch.nn.functional.scaled_dot_product_attention
        for q, k, v in self._sequences:
            sdpa(q, k, v, enable_gqa=True)


#: A drift probe block lasts about this share of the block of calls it follows (at
#: least one probe call).
PROBE_SHARE = 0.5
#: Torch threads of a CPU timing unless chosen: with more, a call waits at every parallel
#: region for a thread the scheduler preempted, so on a shared host medians snap to
#: multiples of its 4 ms slice (``python -m pagedbench.harness.calibration.gate
#: --threads-study``; docs/gate.md has the figures).
CPU_THREADS = 1
#: A block that lasts more than this many times its planned length re-sizes the blocks
#: after it (the one-call estimate was too short).
RESIZE_FACTOR = 2.0


def oversubscribed(threads: int, load: float | None = None,
                   cores: int | None = None, workers: int = 1) -> str:
    """A warning when ``threads`` torch threads (in all, over ``workers`` CPU workers
    at once) plus the host's 1-minute load average (``os.getloadavg``, or ``load``)
    exceed its cores (``os.cpu_count``, or ``cores``): such timings wait for preempted
    threads (:data:`CPU_THREADS`); "" otherwise, and always for one thread."""
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
    between: Callable[[int], None] | None = None,
) -> Timing:
    """Time ``fn()`` on the CPU with ``torch.utils.benchmark.Timer.timeit`` blocks.

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

    Parameters
    ----------
    fn : callable
        One complete call of the implementation (no arguments).
    threads : int
        torch threads while timing (``Timer(num_threads=...)``).
    warmup : int
        Untimed calls first (caches, lazy initialisation); one more call, also untimed
        by the Timer, estimates the call's duration.
    min_samples, min_run_time_s, max_run_time_s : int, float
        As above (samples; seconds).
    probe : callable, optional
        Fixed work timed after every block (:class:`DriftProbe`).
    between : callable, optional
        ``between(k)``, untimed, before block ``k`` (new inputs written in place).

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

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for _ in range(warmup):
            fn()
        one_s = time_once(fn, "perf_counter").median_ms / 1e3
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
            if between is not None:
                between(len(samples_ms))
            per_call_s = timer.timeit(calls).mean
            samples_ms.append(per_call_s * 1e3)
            block_calls.append(calls)
            if probe is not None:
                probe_ms.append(_probe_block(probe, probe_calls))
            spent_s += per_call_s * calls
            if per_call_s * calls > RESIZE_FACTOR * block_s and calls > 1:
                resized = max(1, int(block_s / per_call_s))
                if probe is not None:
                    probe_calls = max(1, round(probe_calls * resized / calls))
                calls = resized
            if spent_s >= max_run_time_s or (len(samples_ms) >= min_samples
                                             and spent_s >= min_run_time_s):
                break
    finally:
        torch.set_num_threads(previous)
    return Timing(tuple(samples_ms), "torch_timer", tuple(probe_ms), tuple(block_calls))


def _probe_block(probe: Callable[[], object], calls: int) -> float:
    """Milliseconds per call of ``calls`` probe calls (with the caller's torch threads)."""
    start = time.perf_counter()
    for _ in range(calls):
        probe()
    return (time.perf_counter() - start) * 1e3 / calls


def _do_bench():
    from triton.testing import do_bench, do_bench_cudagraph

    return do_bench, do_bench_cudagraph


def time_cuda(fn: Callable[[], object], *, warmup_ms: float = 25, rep_ms: float = 100,
              graph_below_ms: float = CUDA_GRAPH_BELOW_MS,
              between: Callable[[int], None] | None = None) -> Timing:
    """Time ``fn()`` on the current CUDA device: ``do_bench`` (cold L2), and, when its
    median is below ``graph_below_ms``, CUDA-graph replay instead (if ``fn`` can be
    captured; otherwise the cold-L2 timing stands). ``between(0)`` runs once, untimed, before the first call (``do_bench`` takes its
    samples itself).

    ``warmup_ms``/``rep_ms`` are do_bench's budgets in milliseconds (its defaults).

    Raises
    ------
    RuntimeError
        If CUDA is not available.
    """
    if not torch.cuda.is_available():
        raise RuntimeError("time_cuda needs a CUDA device; none is visible to torch")
    do_bench, do_bench_cudagraph = _do_bench()
    if between is not None:
        between(0)
    cold = Timing(tuple(do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="all")),
                  "cuda_events")
    if cold.median_ms >= graph_below_ms:
        return cold
    try:
        replayed = do_bench_cudagraph(fn, rep=rep_ms, return_mode="all")
    except RuntimeError:  # not capturable (a host sync, an allocation on another stream)
        torch.cuda.synchronize()
        return cold
    return Timing(tuple(replayed), "cuda_graph")


@dataclass(frozen=True)
class DevicePeaks:
    """What the device sustained when measured, for fractions of peak and rooflines.

    Attributes
    ----------
    copy_gbps : float
        ``dst.copy_(src)`` of :data:`COPY_BYTES`, counting its read and its write (GB/s).
    bf16_tflops : float
        A square bf16 matmul (``2 n^3`` FLOPs) at its median time (TFLOP/s).
    method : str
        The timing method (``torch_timer`` or ``cuda_events``).
    cache_copy_gbps : float or None
        The fastest ``dst.copy_(src)`` of :data:`CACHE_COPY_BYTES`, whose source and
        destination stay in a cache between calls (GB/s, read plus write;
        :func:`cache_copy_gbps`); None when not measured.
    """

    copy_gbps: float
    bf16_tflops: float
    method: str
    cache_copy_gbps: float | None = None

    def to_dict(self) -> dict[str, object]:
        return {"copy_gbps": self.copy_gbps, "bf16_tflops": self.bf16_tflops,
                "method": self.method, "cache_copy_gbps": self.cache_copy_gbps}


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
                timed = time_cuda(copy, graph_below_ms=math.inf)  # graph replay: warm L2
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
            copy_t, mm_t = time_cuda(copy, graph_below_ms=0), time_cuda(matmul, graph_below_ms=0)
    else:
        copy_t = time_cpu(copy, threads=threads, min_samples=5, min_run_time_s=0.2)
        mm_t = time_cpu(matmul, threads=threads, min_samples=5, min_run_time_s=0.2)
    return DevicePeaks(copy_gbps=2 * src.nbytes / (copy_t.median_ms / 1e3) / 1e9,
                       bf16_tflops=2 * n**3 / (mm_t.median_ms / 1e3) / 1e12,
                       method=copy_t.method, cache_copy_gbps=cache_copy_gbps(device, threads))


def bytes_moved(case: PagedCase) -> int:
    """Bytes a kernel must move at least once for ``case`` (bytes).

    Q and O (``total_q * num_q_heads * head_dim`` elements each), K and V of every token
    each sequence attends to (``sum(kv_lens) * num_kv_heads * head_dim`` each, at the KV
    cache's element size: 1 byte for fp8; with a sliding window, only the keys inside it),
    and the used block-table entries (int32).
    """
    elem = torch.empty((), dtype=case.torch_dtype).element_size()
    kv_elem = torch.empty((), dtype=case.kv_torch_dtype).element_size()  # 1 for fp8
    qo = 2 * case.total_q * case.num_q_heads * case.head_dim * elem
    attended = sum(
        min(kv, case.sliding_window + q - 1) if case.sliding_window else kv
        for kv, q in zip(case.kv_lens, case.q_lens_or_decode)
    )
    kv = 2 * attended * case.num_kv_heads * case.head_dim * kv_elem
    tables = sum(case.blocks_per_seq) * 4
    return qo + kv + tables


def flops(case: PagedCase) -> int:
    """Floating-point operations of the two matmuls (FLOPs): ``4 * head_dim * num_q_heads``
    per visible (query, key) pair (FlashInfer's ``attention_flops_with_actual_seq_lens``)."""
    pairs = 0
    for kv, q in zip(case.kv_lens, case.q_lens_or_decode):
        first = kv - q  # position of the first query token
        if case.sliding_window:
            for pos in range(first, kv):
                pairs += pos - max(0, pos - case.sliding_window + 1) + 1
        else:  # sum of (pos + 1) for pos in [first, kv)
            pairs += (kv * (kv + 1) - first * (first + 1)) // 2
    return 4 * case.head_dim * case.num_q_heads * pairs


def roofline_floor_ms(moved: int, work: int, peaks: DevicePeaks) -> float:
    """The least time a call can take on a device with ``peaks``: the longer of moving
    ``moved`` bytes at the copy bandwidth and doing ``work`` FLOPs at the bf16 throughput
    (ms)."""
    return max(moved / (peaks.copy_gbps * 1e9), work / (peaks.bf16_tflops * 1e12)) * 1e3


__all__ = ["CPU_THREADS", "CUDA_GRAPH_BELOW_MS", "DevicePeaks", "METHODS", "NOISE_THRESHOLD", "Timing",
           "PROBE_SHARE", "DriftProbe",
           "bytes_moved", "cache_copy_gbps", "flops", "measure_peaks", "oversubscribed",
           "roofline_floor_ms", "time_cpu",
           "time_cuda", "time_once"]
