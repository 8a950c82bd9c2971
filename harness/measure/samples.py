"""One implementation's latency samples on one case (:class:`Timing`) and their
statistics, whatever timed them (:mod:`.timing` chooses and runs the timers)."""

from __future__ import annotations

import math
from collections.abc import Callable
from time import perf_counter  # bound before any implementation loads (docs/trust.md)
from dataclasses import dataclass

import numpy as np

#: IQR / median above which a timing is flagged noisy (``Timer.adaptive_autorange``'s
#: default ``threshold``).
NOISE_THRESHOLD = 0.1
#: Methods a timing may carry; only the first three are ever ranked.
METHODS = ("torch_timer", "cuda_events", "cuda_graph", "interpreted", "perf_counter")


@dataclass(frozen=True)
class Timing:
    """Latency samples of one implementation on one case, with their statistics.

    Attributes
    ----------
    samples_ms : tuple[float, ...]
        Milliseconds per call, one per repetition (a block of calls on the CPU, one call
        with ``cuda_events``, one graph replay over its calls with ``cuda_graph``), in
        order.
    probe_ms : tuple[float, ...]
        Milliseconds per :class:`~.timing.DriftProbe` call of the block timed right after each
        sample (CPU only; empty otherwise).
    method : str
        One of :data:`METHODS`: ``torch_timer`` (CPU blocks of calls:
        ``harness/measure/timing.py``), ``cuda_events`` (an L2 flush
        before each call), ``cuda_graph`` (graph replay of rotated input copies),
        ``interpreted`` (one wall-clock call of an interpreter: never ranked) or
        ``perf_counter`` (records written before schema 3).
    copies : int or None
        CUDA: the input copies the samples rotated over (1 with ``cuda_events``).
    sm_clock_mhz, temperature_c : tuple[float | None, float | None] or None
        CUDA: the SM clock (MHz) and GPU temperature (degrees C) after the pre-roll and
        after the samples; None where not read.
    fallback : str or None
        Why the point's planned ``cuda_graph`` was not used (what its attempt raised);
        the cold timing stands.
    calls : tuple[int, ...]
        Calls each sample averaged (CPU blocks; one per sample when empty).

    Raises
    ------
    ValueError
        If there is no sample, a sample is not finite and > 0, the drift probe has not one
        block per sample, ``copies`` is below 1, ``calls`` is not one count >= 1 per
        sample, or the method is unknown.
    """

    samples_ms: tuple[float, ...]
    method: str
    probe_ms: tuple[float, ...] = ()
    copies: int | None = None
    sm_clock_mhz: tuple[float | None, float | None] | None = None
    temperature_c: tuple[float | None, float | None] | None = None
    fallback: str | None = None
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
        if self.method not in METHODS:
            raise ValueError(f"timing method {self.method!r} not in {METHODS}")
        if self.calls and (len(self.calls) != len(samples) or min(self.calls) < 1):
            raise ValueError(f"calls must be one count >= 1 per sample, got {self.calls[:5]}")
        if self.copies is not None and (isinstance(self.copies, bool)
                                        or not isinstance(self.copies, int) or self.copies < 1):
            raise ValueError(f"copies must be None or an int >= 1, got {self.copies!r}")
        object.__setattr__(self, "samples_ms", samples)
        object.__setattr__(self, "probe_ms", probe)
        for name in ("sm_clock_mhz", "temperature_c"):
            pair = getattr(self, name)
            if pair is not None:
                object.__setattr__(self, name, tuple(None if v is None else float(v)
                                                     for v in pair))

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

    def conditions(self) -> dict[str, object]:
        """The fields beside the samples (``copies``, ``sm_clock_mhz``,
        ``temperature_c``, ``fallback``), JSON-ready."""
        pair = lambda p: None if p is None else list(p)  # noqa: E731
        return {"copies": self.copies, "sm_clock_mhz": pair(self.sm_clock_mhz),
                "temperature_c": pair(self.temperature_c), "fallback": self.fallback}

    @classmethod
    def from_message(cls, message: dict[str, object]) -> Timing:
        """The timing a worker sent (``{"samples_ms", "method", "probe_ms"}`` and
        :meth:`conditions`'s keys, those absent taken as None)."""
        pair = lambda p: None if p is None else tuple(p)  # noqa: E731
        return cls(tuple(message["samples_ms"]), message["method"],
                   tuple(message.get("probe_ms") or ()), message.get("copies"),
                   pair(message.get("sm_clock_mhz")), pair(message.get("temperature_c")),
                   message.get("fallback"))

    def to_message(self) -> dict[str, object]:
        """What a worker sends of this timing (:meth:`from_message`'s inverse)."""
        return {"samples_ms": list(self.samples_ms), "method": self.method,
                "probe_ms": list(self.probe_ms), **self.conditions()}

    def to_dict(self) -> dict[str, object]:
        """The record's ``time_ms`` (:class:`~pagedbench.harness.results.record.TimingStats`)."""
        return {"median": self.median_ms, "p10": self.p10_ms, "p90": self.p90_ms,
                "iqr": self.iqr_ms, "n": self.n, "method": self.method,
                "samples": list(self.samples_ms), "noisy": self.noisy,
                "probe": list(self.probe_ms), **self.conditions()}


def time_once(fn: Callable[[], object], method: str = "interpreted") -> Timing:
    """One wall-clock call (``time.perf_counter``), for an interpreter."""
    start = perf_counter()
    fn()
    return Timing(((perf_counter() - start) * 1e3,), method)


__all__ = ["METHODS", "NOISE_THRESHOLD", "Timing", "time_once"]
