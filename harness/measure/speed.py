"""Speed of one point: two sets of raw timing samples judged for a change that counts.

The two-sided Mann-Whitney U test (``scipy.stats.mannwhitneyu``; Go's benchstat and
Google Benchmark's ``tools/compare.py`` use it, at alpha 0.05), Holm's adjustment of the
p-values of every point of a gate (:func:`holm`), the ratio of medians and its percentile
bootstrap interval (:func:`ratio_interval`), and the thresholds of a change that counts
(:class:`Thresholds`). :mod:`pagedbench.harness.gate.compare` applies them point by point.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pagedbench.reference import PagedValueError


@dataclass(frozen=True)
class Thresholds:
    """How the gate judges speed.

    Attributes
    ----------
    alpha : float
        Family-wise significance level of the U tests (benchstat's and compare.py's 0.05);
        the bootstrap interval of each ratio has confidence 1 - alpha.
    min_effect : float
        Smallest relative change that counts: a ratio of medians of at least
        ``1 + min_effect`` (slower) or at most ``1 / (1 + min_effect)`` (faster).
    min_samples : int
        Fewest samples on either side that are judged (compare.py warns below 9).
    resamples : int
        Bootstrap resamples per point.
    probe : bool
        Judge each sample divided by the drift probe block timed right after it, where both
        sides have one (:mod:`pagedbench.harness.gate.compare`); False judges the raw milliseconds.

    Raises
    ------
    PagedValueError
        If alpha is not in (0, 1), min_effect not finite and > 0, min_samples below 2
        or resamples below 100. (Whether few samples can reach p < alpha is the U test's
        business: 2 against 10 reach 2 / C(12, 2) = 0.03, 3 against 3 only 0.1.)
    """

    alpha: float = 0.05
    min_effect: float = 0.10
    min_samples: int = 9
    resamples: int = 2000
    probe: bool = True

    def __post_init__(self) -> None:
        if not (isinstance(self.alpha, (int, float)) and 0 < self.alpha < 1):
            raise PagedValueError("--alpha", self.alpha, "a number in (0, 1)")
        if not (isinstance(self.min_effect, (int, float)) and math.isfinite(self.min_effect)
                and self.min_effect > 0):
            raise PagedValueError("--min-effect", self.min_effect, "a finite number > 0")
        for name, low in (("min_samples", 2), ("resamples", 100)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise PagedValueError(f"--{name.replace('_', '-')}", value,
                                      f"an integer >= {low}")


class Outcome(enum.StrEnum):
    """What happened to one point between the baseline and the current run; the order is
    the order of the report."""

    BROKEN = "broken"
    SLOWER = "slower"
    FASTER = "faster"
    FIXED = "fixed"
    NOISY = "too noisy"
    SAME = "same"
    UNTIMED = "untimed"
    STILL_FAILING = "still failing"
    NO_VERDICT = "no verdict"

    @property
    def fails_gate(self) -> bool:
        return self in (Outcome.BROKEN, Outcome.SLOWER)


@dataclass(frozen=True)
class Speed:
    """Two samples compared (:func:`compare_samples`).

    Attributes
    ----------
    outcome : Outcome
        ``same``, ``slower``, ``faster`` or ``too noisy``, on the raw p-value
        (:func:`compare` re-decides on Holm's adjusted one).
    ratio : float
        median(current) / median(baseline) (nan when a side has no samples).
    interval : tuple[float, float] or None
        Bootstrap interval of ``ratio`` (confidence 1 - alpha); None when not judged.
    p_value : float or None
        Two-sided U test; None when not judged.
    reason : str
        Why a point is ``too noisy``.
    """

    outcome: Outcome
    ratio: float
    interval: tuple[float, float] | None = None
    p_value: float | None = None
    reason: str = ""


def median_ratio(current: np.ndarray, baseline: np.ndarray, axis: int = -1) -> np.ndarray:
    """``median(current) / median(baseline)`` along ``axis`` (samples in ms, or any unit
    both share): above 1 is slower."""
    return np.median(current, axis=axis) / np.median(baseline, axis=axis)


def ratio_interval(baseline: Sequence[float], current: Sequence[float],
                   thresholds: Thresholds = Thresholds()) -> tuple[float, float]:
    """Percentile bootstrap interval (confidence 1 - alpha) of median(current) /
    median(baseline), each side resampled on its own; seeded, so a gate is reproducible
    (Efron and Tibshirani, "An Introduction to the Bootstrap", 1993, ch. 13)."""
    from scipy.stats import bootstrap  # scipy.stats takes 0.5 s: not at the CLI's start

    result = bootstrap((np.asarray(current, float), np.asarray(baseline, float)),
                       median_ratio, n_resamples=thresholds.resamples, vectorized=True,
                       confidence_level=1 - thresholds.alpha, method="percentile",
                       random_state=np.random.default_rng(0))
    return float(result.confidence_interval.low), float(result.confidence_interval.high)


def decide(ratio: float, p_value: float, interval: tuple[float, float],
            thresholds: Thresholds) -> tuple[Outcome, str]:
    """The outcome of a point with this ``ratio``, (Holm-adjusted) ``p_value`` and
    bootstrap ``interval`` of the ratio, and why when ``too noisy`` (module docstring of
    :mod:`pagedbench.harness.gate.compare`)."""
    limit = 1 + thresholds.min_effect
    if p_value < thresholds.alpha and ratio >= limit:
        return Outcome.SLOWER, ""
    if p_value < thresholds.alpha and ratio <= 1 / limit:
        return Outcome.FASTER, ""
    if interval[1] >= limit:
        return Outcome.NOISY, (f"ratio interval {interval[0]:.2f}..{interval[1]:.2f} reaches "
                               f"{limit:g}: a slowdown of --min-effect can be neither shown "
                               "nor ruled out")
    return Outcome.SAME, ""


def compare_samples(baseline: Sequence[float], current: Sequence[float],
                    thresholds: Thresholds = Thresholds()) -> Speed:
    """Judge ``current`` against ``baseline`` (raw samples, ms, any order; see the module
    docstring and :class:`Thresholds`)."""
    ratio = (float(np.median(current) / np.median(baseline))
             if len(baseline) and len(current) and np.median(baseline) > 0 else math.nan)
    for side, samples in (("baseline", baseline), ("current", current)):
        if len(samples) < thresholds.min_samples:
            return Speed(Outcome.NOISY, ratio,
                         reason=f"{side} has {len(samples)} samples, fewer than "
                                f"{thresholds.min_samples} (--min-samples)")
    from scipy.stats import mannwhitneyu

    p_value = float(mannwhitneyu(current, baseline, alternative="two-sided").pvalue)
    if math.isnan(p_value):  # every sample equal on both sides
        p_value = 1.0
    interval = ratio_interval(baseline, current, thresholds)
    outcome, reason = decide(ratio, p_value, interval, thresholds)
    return Speed(outcome, ratio, interval, p_value, reason)


def holm(p_values: Sequence[float]) -> list[float]:
    """Holm's step-down adjusted p-values, in the order given (Holm, "A simple
    sequentially rejective multiple test procedure", Scand. J. Statist. 6, 1979):
    the i-th smallest of m becomes max over j <= i of min(1, (m - j + 1) * p_(j))."""
    order = sorted(range(len(p_values)), key=lambda i: p_values[i])
    adjusted = [1.0] * len(p_values)
    running = 0.0
    for rank, index in enumerate(order):
        running = max(running, min(1.0, (len(p_values) - rank) * p_values[index]))
        adjusted[index] = running
    return adjusted


__all__ = ["Outcome", "Speed", "Thresholds", "compare_samples", "decide", "holm",
           "ratio_interval"]
