"""The CUDA timers' loops: a pre-roll, cold-L2 CUDA events, and graph replay of rotated
input copies, on a :class:`CudaDevice` (torch.cuda and NVML, or a fake in the tests).

- :func:`preroll`: untimed calls for about :data:`PREROLL_MS` back to back, so that the
  SM clock is up before the first sample (a GPU idle between points lowers it); returns
  the mean time of a call, which sizes the sample counts.
- :func:`cold_events`: Triton's ``do_bench`` loop: before every call an L2 flush (a
  :data:`FLUSH_BYTES` buffer zeroed), then CUDA events around the call alone.
- :func:`graph_replay`: one CUDA graph holding one call on each input copy in turn,
  replayed back to back; a sample is one replay's time over the copies. Between two uses
  of one copy, the others pass through L2 (FlashInfer's ``bench_gpu_time_with_cudagraph``
  rotates its inputs the same way, ``flashinfer/testing/utils.py``); Triton's
  ``do_bench_cudagraph`` replays one call on warm L2 (triton-lang/triton#10149).
- :func:`sample_count`: at least the gate's minimum, at most :data:`MAX_SAMPLES`.

Standard library and torch only; the policy (which method at which point) is
:func:`pagedbench.harness.measure.timing.point_plan`.
"""

from __future__ import annotations

import gc
import math
from collections.abc import Callable, Sequence
from typing import Protocol

import torch

#: Bytes zeroed before each cold call: Triton's 256 MiB, over 4 times an H200's 60 MB L2.
FLUSH_BYTES = 256 * 2**20
#: Milliseconds of back-to-back calls before a point's samples (Triton's warm-up default
#: is 25 ms; twice that spans the SM clock's ramp after an idle gap).
PREROLL_MS = 50.0
#: Most calls of a pre-roll (a call of microseconds would otherwise queue thousands).
MAX_PREROLL_CALLS = 1000
#: Milliseconds of timed work a point aims for (``do_bench``'s ``rep`` default).
REP_MS = 100.0
#: Most samples of one timing (the gate's U test gains nothing past a few hundred).
MAX_SAMPLES = 500


class Event(Protocol):
    def record(self) -> None: ...

    def elapsed_time(self, end: Event) -> float: ...


class CudaDevice:
    """What the timers use of one CUDA device: events, synchronization, a buffer to flush
    L2 with, graph capture, and the SM clock and temperature from NVML.

    ``index`` is torch's device index (``CUDA_VISIBLE_DEVICES`` applied), None: the
    current device.
    """

    def __init__(self, index: int | None = None) -> None:
        self.index = torch.cuda.current_device() if index is None else index

    def event(self) -> Event:
        return torch.cuda.Event(enable_timing=True)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.index)

    def flush_buffer(self, nbytes: int) -> torch.Tensor:
        """An int32 buffer of ``nbytes``, whose ``zero_()`` evicts L2."""
        return torch.empty(nbytes // 4, dtype=torch.int32, device=torch.device("cuda",
                                                                                 self.index))

    def capture(self, calls: Sequence[Callable[[], object]]) -> Callable[[], None]:
        """One CUDA graph of ``calls`` in order (each already run once, eagerly); its
        ``replay``. Raises what capture raises (a host synchronization, an allocation
        the graph cannot hold)."""
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for call in calls:
                call()
        return graph.replay

    def conditions(self) -> tuple[float | None, float | None]:
        """The SM clock (MHz) and GPU temperature (degrees C) now, from NVML
        (``torch.cuda.clock_rate``, ``torch.cuda.temperature``); None for what cannot be
        read (no ``pynvml``, no NVML on this machine)."""
        return _nvml_read(torch.cuda.clock_rate, self.index), _nvml_read(
            torch.cuda.temperature, self.index)


def _nvml_read(read: Callable[[int], int], index: int) -> float | None:
    errors: tuple[type[BaseException], ...] = (ImportError, RuntimeError, OSError)
    try:
        import pynvml

        errors += (pynvml.NVMLError,)
    except ImportError:
        return None
    try:
        return float(read(index))
    except errors:
        return None


def sample_count(per_sample_ms: float, min_samples: int, rep_ms: float = REP_MS) -> int:
    """Samples that fill about ``rep_ms`` of ``per_sample_ms`` each, clamped to
    ``[min_samples, MAX_SAMPLES]`` (the minimum wins over the maximum)."""
    wanted = math.ceil(rep_ms / max(per_sample_ms, 1e-6))
    return max(min_samples, min(wanted, MAX_SAMPLES))


def preroll(device: CudaDevice, fn: Callable[[], object],
            preroll_ms: float = PREROLL_MS,
            after_first: Callable[[object], None] | None = None) -> float:
    """Run ``fn`` once (lazy initialization, compiles; ``after_first(its output)``), then
    back to back for about ``preroll_ms``; the mean milliseconds of one of those calls."""
    out = fn()
    if after_first is not None:
        after_first(out)
    device.synchronize()
    start, end = device.event(), device.event()
    start.record()
    fn()
    end.record()
    device.synchronize()
    one_ms = max(start.elapsed_time(end), 1e-6)
    calls = max(1, min(int(preroll_ms / one_ms), MAX_PREROLL_CALLS))
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    device.synchronize()
    return start.elapsed_time(end) / calls


def cold_events(device: CudaDevice, fn: Callable[[], object], samples: int,
                flush_bytes: int = FLUSH_BYTES,
                before: Callable[[int], None] | None = None,
                after: Callable[[int, object], None] | None = None) -> list[float]:
    """``samples`` times of ``fn`` (ms), each after an L2 flush, by CUDA events around the
    call alone; ``before(i)`` before sample ``i``'s flush and ``after(i, its output)``
    after its end event (work queued there is outside the events)."""
    cache = device.flush_buffer(flush_bytes)
    starts = [device.event() for _ in range(samples)]
    ends = [device.event() for _ in range(samples)]
    for i, (start, end) in enumerate(zip(starts, ends)):
        if before is not None:
            before(i)
        cache.zero_()
        start.record()
        out = fn()
        end.record()
        if after is not None:
            after(i, out)
    device.synchronize()
    return [start.elapsed_time(end) for start, end in zip(starts, ends)]


def graph_replay(device: CudaDevice, calls: Sequence[Callable[[], object]],
                 per_call_ms: float, min_samples: int) -> list[float]:
    """Milliseconds per call of a graph of ``calls`` (one per input copy, in turn),
    replayed back to back: each sample one replay's time over ``len(calls)``; at least
    ``min_samples``, about :data:`REP_MS` in all (:func:`sample_count`). Each call runs
    once eagerly before the capture, the graph once before the samples. Raises what
    capture or replay raises."""
    for call in calls:
        call()
    device.synchronize()
    replay = device.capture(calls)
    replay()
    device.synchronize()
    count = sample_count(per_call_ms * len(calls), min_samples)
    starts = [device.event() for _ in range(count)]
    ends = [device.event() for _ in range(count)]
    for start, end in zip(starts, ends):
        start.record()
        replay()
        end.record()
    device.synchronize()
    return [start.elapsed_time(end) / len(calls) for start, end in zip(starts, ends)]


def release_device_memory() -> None:
    """Collect garbage and return the CUDA caching allocator's unused blocks to the
    device (``torch.cuda.empty_cache``), so that one point's tensors do not crowd the
    next; nothing without CUDA."""
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


__all__ = ["FLUSH_BYTES", "MAX_SAMPLES", "PREROLL_MS", "REP_MS", "CudaDevice", "cold_events",
           "graph_replay", "preroll", "release_device_memory", "sample_count"]
