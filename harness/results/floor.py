"""The physical floor: a time no device could take is refused, never ranked.

A timed pass whose bytes per second exceed what its device was measured to move, or whose
FLOPs per second exceed its measured matmul rate, by more than a margin, is not a fast
kernel but a time that does not measure the work: an output kept from an earlier call or
computed outside the timed one, work still running when the call returns, a patched timer.
:func:`refusal` says why such a point is impossible; :func:`judged` makes its record a
``fail`` of step :data:`STEP` with that reason, its time kept as the evidence (only a
``pass`` is ranked, scored or gated as fast). The runner judges every record it writes
(:func:`~pagedbench.harness.results.outcome.result_record`); reports and the gate judge what
they read, so lines written before the floor existed are refused as well.

The ceilings (docs/trust.md, "The physical floor", has the measurements behind them):

- bytes (:func:`~pagedbench.harness.measure.roofline.bytes_moved`: every byte once) per
  second: for a timing whose every call starts from a cleared cache (:data:`COLD_METHODS`:
  ``do_bench`` clears the L2 first) :data:`COLD_MARGIN` times the copy bandwidth; for one
  whose data may stay cached between calls (the CPU's blocks of calls, CUDA-graph replay)
  :data:`WARM_MARGIN` times the faster of the copy bandwidth and the in-cache copy rate
  (peaks recorded without one: :data:`UNMEASURED_CACHE_FACTOR` times the copy bandwidth);
- FLOPs per second, against GPU peaks only (their method ``cuda_events``):
  :data:`FLOPS_MARGIN` times the bf16 matmul rate. A CPU's bf16 matmul is no ceiling:
  torch converts where the core has no bf16 unit (0.0012 to 0.42 TFLOP/s measured on a
  2-core EPYC whose bf16 SDPA ran 28 times the lower).

Interpreted timings are never ranked and not judged; a record without peaks cannot be.
"""

from __future__ import annotations

from pagedbench.harness.results.record import DevicePeaks, ResultRecord
from pagedbench.harness.verdict.status import Status

#: The step of a record refused by the floor.
STEP = "floor"
#: Timing methods whose every call reads its data from memory past every cache.
COLD_METHODS = frozenset({"cuda_events"})
#: Timing methods that are never ranked, so never judged.
UNRANKED_METHODS = frozenset({"interpreted"})
#: Cold timings: a kernel that only reads reaches up to about 1.2 times a copy's rate on a
#: GPU (a copy writes as much as it reads), and the peaks may be measured on a busier
#: device than the point.
COLD_MARGIN = 2.0
#: Warm timings: reads from a cache run up to twice a copy there (two load ports to one
#: store port per core), and peaks measured on a shared host moved threefold between runs
#: (docs/trust.md); the fastest honest CPU point measured there reached 0.37 of the
#: in-cache copy.
WARM_MARGIN = 4.0
#: The in-cache copy rate assumed, as a multiple of the copy bandwidth, for peaks recorded
#: before it was measured: above the 3-6x measured on the caches of a 2-core EPYC.
UNMEASURED_CACHE_FACTOR = 8.0
#: GPU FLOPs: fp8 tensor cores run twice bf16's rate, and a measured bf16 matmul reaches
#: 0.6-0.8 of the data sheet's.
FLOPS_MARGIN = 4.0


def bandwidth_ceiling(peaks: DevicePeaks, method: str) -> tuple[float, str]:
    """The most GB/s a point timed by ``method`` on a device with ``peaks`` can move, and
    what it is a multiple of (for the reason)."""
    if method in COLD_METHODS:
        return COLD_MARGIN * peaks.copy_gbps, (
            f"{COLD_MARGIN:g}x the copy bandwidth measured on this device "
            f"({peaks.copy_gbps:.4g} GB/s; the cache is cleared before every timed call)")
    if peaks.cache_copy_gbps is None:
        cached, what = UNMEASURED_CACHE_FACTOR * peaks.copy_gbps, (
            f"{UNMEASURED_CACHE_FACTOR:g}x its copy bandwidth {peaks.copy_gbps:.4g} GB/s, "
            "its in-cache copy not measured")
    else:
        cached, what = max(peaks.cache_copy_gbps, peaks.copy_gbps), (
            f"its fastest copy, {max(peaks.cache_copy_gbps, peaks.copy_gbps):.4g} GB/s "
            "(in cache; the data may stay cached between timed calls)")
    return WARM_MARGIN * cached, f"{WARM_MARGIN:g}x {what}"


def refusal(moved: int, work: int, median_ms: float, method: str,
            peaks: DevicePeaks | None) -> str:
    """Why a point moving ``moved`` bytes and doing ``work`` FLOPs in ``median_ms``
    (timed by ``method``) is impossible on a device with ``peaks``; "" when it is
    possible, or cannot be judged (no peaks, an interpreted timing, no time).

    Parameters
    ----------
    moved, work : int
        Bytes and FLOPs of the case (``harness/measure/timing.py``).
    median_ms : float
        The point's median time per call (ms).
    method : str
        Its timing method (``harness.measure.timing.METHODS``).
    peaks : DevicePeaks or None
        What its device was measured to sustain.
    """
    if peaks is None or method in UNRANKED_METHODS or not median_ms > 0:
        return ""
    seconds = median_ms / 1e3
    gbps = moved / seconds / 1e9
    ceiling, what = bandwidth_ceiling(peaks, method)
    if gbps > ceiling:
        return (f"physical floor: {gbps:.4g} GB/s ({moved / 1e6:.4g} MB in "
                f"{median_ms:.3g} ms) is past {ceiling:.4g} GB/s, {what}: the time does not "
                "measure the work (docs/trust.md)")
    tflops = work / seconds / 1e12
    if peaks.method in COLD_METHODS and tflops > FLOPS_MARGIN * peaks.bf16_tflops:
        return (f"physical floor: {tflops:.4g} TFLOP/s ({work:.4g} FLOPs in "
                f"{median_ms:.3g} ms) is past {FLOPS_MARGIN * peaks.bf16_tflops:.4g} TFLOP/s, "
                f"{FLOPS_MARGIN:g}x the bf16 matmul rate measured on this device "
                f"({peaks.bf16_tflops:.4g} TFLOP/s): the time does not measure the work "
                "(docs/trust.md)")
    return ""


def judged(record: ResultRecord) -> ResultRecord:
    """``record`` as the floor judges it: a timed ``pass`` whose time is impossible
    (:func:`refusal`) becomes a ``fail`` of step :data:`STEP` with the reason, its time and
    figures kept; every other record is returned as it is."""
    if record.status is not Status.PASS or record.time_ms is None or record.interpreted:
        return record
    reason = refusal(record.bytes_moved, record.flops, record.time_ms.median,
                     record.time_ms.method, record.peaks)
    if not reason:
        return record
    return record.model_copy(update={"status": Status.FAIL, "step": STEP, "reason": reason})


__all__ = ["COLD_MARGIN", "COLD_METHODS", "FLOPS_MARGIN", "STEP", "UNMEASURED_CACHE_FACTOR",
           "UNRANKED_METHODS", "WARM_MARGIN", "bandwidth_ceiling", "judged", "refusal"]
