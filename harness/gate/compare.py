"""The regression gate: a run's results against a stored baseline, point by point.

A point is one implementation on one case at one dtype, measured on one device with one
thread count (:func:`point_key`); results of another device or thread count are never
compared. For each point present in both:

- conformance: a ``pass`` that became anything else, or a new failure (``fail``,
  ``error``, ``crash``, ``timeout`` where the baseline had none) is ``broken``;
- speed, when both passed and were timed by the same, not interpreted, method: the
  two-sided Mann-Whitney U test on the samples of both runs
  (``scipy.stats.mannwhitneyu``, the test of Go's benchstat and Google Benchmark's
  ``tools/compare.py``, both at alpha 0.05), its p-values adjusted over every judged point
  by Holm's step-down method (Holm 1979, so that alpha bounds the chance of any false
  alarm in a gate), the ratio of medians current / baseline and its percentile bootstrap
  interval (``scipy.stats.bootstrap``, confidence 1 - alpha): ``slower`` when the
  adjusted p < alpha and the ratio >= 1 + ``min_effect``, ``faster`` when p < alpha and
  the ratio <= 1 / (1 + ``min_effect``) (benchstat's rule); ``too noisy`` when neither
  and the interval reaches 1 + ``min_effect`` (a slowdown that counts can be neither
  shown nor ruled out), or with fewer than ``min_samples`` samples on either side;
  ``same`` otherwise.

The samples judged: on the CPU every sample divided by the drift probe block timed right
after it (:class:`~pagedbench.harness.measure.timing.DriftProbe`, dense attention of the case's own
shapes), when both sides recorded one and it moved no more than the samples did
(:func:`probe_distrust`); else the raw ms, where a verdict that the divided samples contradict
(:func:`contradicted`: a change on the other side of 1, or a ``same`` that they show slower by
``min_effect``) is ``too noisy``, never a pass. Another process's load or
a clock change slows both about alike at that moment, so the ratio cancels a shared machine's drift
between runs and within one, which raw times on a busy runner cannot do (the false-alarm and
detection rates of both are measured by :mod:`pagedbench.harness.calibration.gate`); the table also
shows the drift probe's own change, the machine's. Raw milliseconds are judged where a side has no
drift probe (GPU timings, lines before schema 4) or with ``Thresholds(probe=False)`` (``--raw``).

The gate fails (exit 1) on any ``broken`` or ``slower`` point; with no point in common it
says "nothing comparable" (exit 5, :class:`~pagedbench.harness.verdict.status.ExitCode`);
otherwise a point it could not judge (``too noisy``, timed on one side only, or in only one
of the baseline and the current results) makes it exit 7, "not judged", on its last line
(``allow_unjudged``, ``--allow-unjudged``: exit 0). Baselines live under
``results/baselines/<device>/`` (:mod:`.baselines`, written by ``pagedbench gate
--update-baseline``). The false-alarm and detection rates of the defaults are measured by
:mod:`pagedbench.harness.calibration.gate`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from pagedbench.harness.measure.speed import (Outcome, Speed, Thresholds, compare_samples, decide,
                                              holm, median_ratio)
from pagedbench.harness.results.record import ResultRecord, latest
from pagedbench.harness.results.report import escape, escape_frame
from pagedbench.harness.verdict.status import ExitCode, Status


# Points --------------------------------------------------------------------------------
@dataclass(frozen=True, order=True)
class PointKey:
    """What makes two results comparable: the device (``env.device``, a CPU model or GPU
    name), the thread count, the implementation, the case id and the dtype."""

    device: str
    threads: int
    impl: str
    case_id: str
    dtype: str


def point_key(record: ResultRecord) -> PointKey:
    """The :class:`PointKey` of a result."""
    return PointKey(record.env.device, record.env.threads, record.impl, record.case_id,
                    str(record.case.get("dtype")))


def points(records: Iterable[ResultRecord]) -> dict[PointKey, ResultRecord]:
    """Results by point (as :func:`~pagedbench.harness.results.store.results_of` reads them:
    an impossible time is a ``fail`` of the physical floor); of several results of one
    point the one measured last wins (:func:`~pagedbench.harness.results.record.latest`),
    whatever order the files are read in."""
    return latest(records, point_key)


def _samples(record: ResultRecord) -> list[float]:
    return list(record.time_ms.samples or []) if record.time_ms is not None else []


def _drift_probe(record: ResultRecord) -> list[float]:
    """The record's drift probe blocks (one per sample,
    :class:`~pagedbench.harness.results.record.TimingStats` checks), or none."""
    return list(record.time_ms.probe) if record.time_ms is not None else []


def probe_distrust(baseline: ResultRecord, current: ResultRecord,
                   thresholds: Thresholds) -> str:
    """Why the drift probe is not applied to this point, or "" when it is (or when a side
    has none): it is not applied where it moved more than the samples did, ``|log d| >
    |log r| + log(1 + min_effect)``, with ``r`` and ``d`` the ratios (current / baseline)
    of the medians of the raw samples and of the probe blocks. Dividing by such a probe
    would make a change of at least ``min_effect`` that the samples themselves do not
    show. (A rule on the probe's own spread, tried beside it, turned tracking probes
    into raw false alarms: docs/gate.md.)"""
    probe_b, probe_c = _drift_probe(baseline), _drift_probe(current)
    if not (thresholds.probe and probe_b and probe_c):
        return ""
    raw = math.log(np.median(_samples(current)) / np.median(_samples(baseline)))
    drift = math.log(np.median(probe_c) / np.median(probe_b))
    if abs(drift) <= abs(raw) + math.log1p(thresholds.min_effect):
        return ""
    return (f"drift probe not applied: it moved {math.exp(drift) - 1:+.0%}, the samples "
            f"{math.exp(raw) - 1:+.0%}")


def contradicted(outcome: Outcome, raw: float, divided: float,
                 thresholds: Thresholds) -> bool:
    """Whether the samples divided by a distrusted drift probe (ratio ``divided``)
    contradict the verdict of the raw ms (``outcome``, ratio ``raw``): a ``slower`` or
    ``faster`` whose divided ratio lies on the other side of 1, or a ``same`` whose
    divided ratio is a slowdown of at least ``min_effect``. The second keeps a gate from
    passing a slowdown that a faster machine hid in the raw ms, as against a golden timed
    while the host ran slow (the measured case: docs/gate.md, "False alarms and power,
    measured")."""
    if outcome in (Outcome.SLOWER, Outcome.FASTER):
        return (raw - 1) * (divided - 1) <= 0
    return outcome is Outcome.SAME and divided >= 1 + thresholds.min_effect


def judged_samples(baseline: ResultRecord, current: ResultRecord,
                   thresholds: Thresholds) -> tuple[list[float], list[float], float]:
    """The samples the U test compares, and the drift probe's change (median current /
    median baseline, nan without one): each sample divided by the probe block timed right
    after it when ``thresholds.probe`` and both sides have drift probes, else the raw ms.

    Per block, not by a smoothed probe level: the probe does the case's own work, so its
    noise moves with the sample's (the median of the three nearest blocks and the
    point's median probe both left more false alarms in the recorded calibration runs:
    docs/gate.md)."""
    probe_b, probe_c = _drift_probe(baseline), _drift_probe(current)
    if not (thresholds.probe and probe_b and probe_c):
        return _samples(baseline), _samples(current), math.nan
    drift = float(np.median(probe_c) / np.median(probe_b))
    return ([s / y for s, y in zip(_samples(baseline), probe_b)],
            [s / y for s, y in zip(_samples(current), probe_c)], drift)


@dataclass(frozen=True)
class PointResult:
    """One point of the gate: its outcome and the figures behind it (``ratio``: median
    current / median baseline of the judged samples (:func:`judged_samples`), ``interval``
    its bootstrap interval, ``p_value`` Holm-adjusted, ``drift`` the drift probe's own
    ratio (nan without one), ``probe_applied`` whether the judged samples were divided by
    it: :func:`probe_distrust`)."""

    key: PointKey
    outcome: Outcome
    baseline: ResultRecord
    current: ResultRecord
    ratio: float = math.nan
    interval: tuple[float, float] | None = None
    p_value: float | None = None
    reason: str = ""
    drift: float = math.nan
    probe_applied: bool = False

    @property
    def unjudged(self) -> bool:
        """Whether the gate could not judge what the two sides measured: ``too noisy``, or
        ``untimed`` although a side has a ranked timing (timed on one side only, or by
        two methods). Passes neither side timed (``--no-timing``, interpreters) are
        judged on their verdicts alone."""
        if self.outcome is Outcome.NOISY:
            return True
        return self.outcome is Outcome.UNTIMED and any(
            r.time_ms is not None and not r.interpreted and r.time_ms.method != "interpreted"
            for r in (self.baseline, self.current))

    @property
    def baseline_ms(self) -> float | None:
        return self.baseline.time_ms.median if self.baseline.time_ms else None

    @property
    def current_ms(self) -> float | None:
        return self.current.time_ms.median if self.current.time_ms else None


def _conformance(baseline: Status, current: Status) -> Outcome | None:
    """The outcome when the verdicts alone decide (not both ``pass``), else None."""
    if baseline is Status.PASS and current is Status.PASS:
        return None
    if baseline is Status.PASS or (current.failing and not baseline.failing):
        return Outcome.BROKEN
    if current is Status.PASS:
        return Outcome.FIXED
    return Outcome.STILL_FAILING if current.failing else Outcome.NO_VERDICT


def _untimed_reason(baseline: ResultRecord, current: ResultRecord) -> str:
    """Why two passes cannot be compared for speed, or "" when they can."""
    for side, record in (("baseline", baseline), ("current", current)):
        if record.time_ms is None:
            return f"{side} not timed (--no-timing)"
        if record.interpreted or record.time_ms.method == "interpreted":
            return f"{side} ran under an interpreter (never ranked)"
    if baseline.time_ms.method != current.time_ms.method:
        return (f"timed by {baseline.time_ms.method} in the baseline, "
                f"{current.time_ms.method} now")
    return ""


@dataclass(frozen=True)
class GateReport:
    """Every point of a gate and what was left out, with the thresholds used."""

    points: list[PointResult]
    only_baseline: list[PointKey]
    only_current: list[PointKey]
    thresholds: Thresholds
    notes: list[str] = field(default_factory=list)
    allow_unjudged: bool = False

    def count(self, outcome: Outcome) -> int:
        return sum(p.outcome is outcome for p in self.points)

    @property
    def unjudged(self) -> int:
        """Points the gate could not judge: :attr:`PointResult.unjudged` ones, and those
        in only one of the baseline and the current results."""
        return (sum(p.unjudged for p in self.points) + len(self.only_baseline)
                + len(self.only_current))

    @property
    def exit_code(self) -> ExitCode:
        """5 when no point was in both, else 1 on a broken or slower point, else 7 when a
        point could not be judged (:attr:`unjudged`; 0 with ``allow_unjudged``), else 0."""
        if not self.points:
            return ExitCode.NOTHING_COMPARABLE
        if any(p.outcome.fails_gate for p in self.points):
            return ExitCode.REGRESSION
        if self.unjudged and not self.allow_unjudged:
            return ExitCode.UNJUDGED
        return ExitCode.CLEAN

    def summary(self) -> str:
        """One line: the verdict, counts per outcome, of the points left out and of those
        not judged."""
        counts = ", ".join(f"{self.count(o)} {o}" for o in Outcome if self.count(o))
        verdict = {ExitCode.CLEAN: "pass", ExitCode.REGRESSION: "FAIL",
                   ExitCode.NOTHING_COMPARABLE: "nothing comparable",
                   ExitCode.UNJUDGED: "NOT JUDGED"}[self.exit_code]
        total = len(self.points) + len(self.only_baseline) + len(self.only_current)
        unjudged = ""
        if self.unjudged:
            why = {ExitCode.UNJUDGED: f" (exit {int(ExitCode.UNJUDGED)}; --allow-unjudged "
                                      "to pass them)",
                   ExitCode.CLEAN: " (allowed by --allow-unjudged)"}
            unjudged = (f"; {self.unjudged} of {total} points not judged"
                        f"{why.get(self.exit_code, '')}")
        return (f"gate: {verdict}: {len(self.points)} points compared"
                f"{': ' + counts if counts else ''}; {len(self.only_baseline)} only in the "
                f"baseline, {len(self.only_current)} only in the current results{unjudged}")

    def markdown(self) -> str:
        """The report: conditions, what moved (broken, slower, faster, fixed; each by
        effect, ``|log ratio|``), what was too noisy to judge, then the summary line."""
        t = self.thresholds
        basis = ("each divided by the drift probe timed after it where both sides have one"
                 if t.probe else "raw ms, --raw")
        out = ["# pagedbench gate", "",
               f"Speed: two-sided Mann-Whitney U test on the samples ({basis}), "
               f"Holm-adjusted over "
               f"the judged points, alpha {t.alpha:g}; a change counts from "
               f"{t.min_effect:.0%} of the median; too noisy when the {1 - t.alpha:.0%} "
               f"bootstrap interval of the ratio of medians reaches +{t.min_effect:.0%} "
               f"without a significant change, or with fewer than {t.min_samples} samples.",
               ""]
        notes = [*self.notes, *self._drift_note()]
        out += [f"- {escape(note)}" for note in notes]
        if notes:
            out.append("")
        moved = [p for p in self.points if p.outcome in
                 (Outcome.BROKEN, Outcome.SLOWER, Outcome.FASTER, Outcome.FIXED)]
        rank = {Outcome.BROKEN: 0, Outcome.SLOWER: 1, Outcome.FASTER: 2, Outcome.FIXED: 3}
        moved.sort(key=lambda p: (rank[p.outcome], -_effect(p)))
        if moved:
            out += ["## What moved", "", escape_frame(_table(moved)).to_markdown(index=False), ""]
        noisy = [p for p in self.points if p.outcome is Outcome.NOISY]
        if noisy:
            out += ["## Too noisy to judge (neither passed nor failed)", "",
                    escape_frame(_table(noisy)).to_markdown(index=False), ""]
        if self.only_baseline:
            out += [f"Only in the baseline (not run now, not judged): "
                    f"{escape(_keys(self.only_baseline))}", ""]
        if self.only_current:
            out += [f"Only in the current results (no baseline, not judged): "
                    f"{escape(_keys(self.only_current))}", ""]
        out += [escape(self.summary()), ""]
        return "\n".join(out)

    def _drift_note(self) -> list[str]:
        """How much the drift probe (the machine) moved over the points judged with it."""
        drifts = [p.drift for p in self.points if math.isfinite(p.drift)]
        if not drifts:
            return []
        applied = sum(p.probe_applied for p in self.points)
        return [f"the drift probe (the machine's own speed) moved {np.median(drifts) - 1:+.0%} "
                f"between the runs (median of {len(drifts)} points, {min(drifts) - 1:+.0%} "
                f"to {max(drifts) - 1:+.0%}); {applied} of those points are judged relative "
                f"to it, {len(drifts) - applied} on raw ms (it moved more than their "
                "samples)"]


def _effect(point: PointResult) -> float:
    """|log ratio|: a halving and a doubling move as much; 0 without a ratio."""
    return abs(math.log(point.ratio)) if math.isfinite(point.ratio) and point.ratio > 0 else 0.0


def _keys(keys: list[PointKey], limit: int = 10) -> str:
    names = [f"{k.impl}:{k.case_id}" for k in keys[:limit]]
    more = f" and {len(keys) - limit} more" if len(keys) > limit else ""
    return ", ".join(names) + more


def _ms(value: float | None) -> str:
    return "" if value is None else f"{value:.4g}"


def _table(rows: list[PointResult]) -> pd.DataFrame:
    def change(p: PointResult) -> str:
        return f"{p.ratio - 1:+.1%}" if math.isfinite(p.ratio) else ""

    return pd.DataFrame([{
        "outcome": str(p.outcome),
        "implementation": p.key.impl,
        "case": p.key.case_id,
        "baseline ms": _ms(p.baseline_ms),
        "current ms": _ms(p.current_ms),
        "change": change(p),
        "drift probe": "" if not math.isfinite(p.drift) else
                       f"{p.drift - 1:+.1%}{'' if p.probe_applied else ' (not applied)'}",
        "interval": "" if p.interval is None else
                    f"{p.interval[0] - 1:+.1%}..{p.interval[1] - 1:+.1%}",
        "p (Holm)": "" if p.p_value is None else f"{p.p_value:.2g}",
        "n": f"{len(_samples(p.baseline))}/{len(_samples(p.current))}",
        "why": p.reason,
    } for p in rows])


def _environment_notes(baseline: dict[PointKey, ResultRecord],
                       current: dict[PointKey, ResultRecord]) -> list[str]:
    """One line per device compared: the library versions and commits of both sides,
    naming what differs."""
    notes = []
    for device in sorted({k.device for k in current} & {k.device for k in baseline}):
        b = next(r.env for k, r in baseline.items() if k.device == device)
        c = next(r.env for k, r in current.items() if k.device == device)
        changed = [f"{name} {getattr(b, name)} -> {getattr(c, name)}"
                   for name in ("torch", "triton", "vllm", "flashinfer", "flash_attn",
                                "xformers", "python") if getattr(b, name) != getattr(c, name)]
        notes.append(f"{device}: baseline commit {(b.git_sha or '?')[:12]}, current "
                     f"{(c.git_sha or '?')[:12]}{' (dirty)' if c.dirty else ''}; "
                     + ("versions differ: " + ", ".join(changed) if changed
                        else "same library versions"))
    return notes


def compare(baseline: Iterable[ResultRecord], current: Iterable[ResultRecord],
            thresholds: Thresholds = Thresholds(), allow_unjudged: bool = False) -> GateReport:
    """The gate of ``current`` against ``baseline`` (see the module docstring);
    ``allow_unjudged``: exit 0, not 7, when the only trouble is points not judged."""
    base, now = points(baseline), points(current)
    common = [k for k in now if k in base]
    judged: list[tuple[PointKey, Speed, float, str, float]] = []
    results: dict[PointKey, PointResult] = {}
    for key in common:
        b, c = base[key], now[key]
        outcome = _conformance(b.status, c.status)
        if outcome is not None:
            results[key] = PointResult(key, outcome, b, c, reason=c.reason)
            continue
        why = _untimed_reason(b, c)
        if why:
            results[key] = PointResult(key, Outcome.UNTIMED, b, c, reason=why)
            continue
        base_samples, current_samples, drift = judged_samples(b, c, thresholds)
        distrust, divided = probe_distrust(b, c, thresholds), math.nan
        if distrust:
            divided = float(median_ratio(np.asarray(current_samples),
                                         np.asarray(base_samples)))
            base_samples, current_samples = _samples(b), _samples(c)
        speed = compare_samples(base_samples, current_samples, thresholds)
        applied = math.isfinite(drift) and not distrust
        if speed.p_value is None:
            results[key] = PointResult(key, speed.outcome, b, c, speed.ratio,
                                       reason=speed.reason, drift=drift,
                                       probe_applied=applied)
        else:
            judged.append((key, speed, drift, distrust, divided))
    adjusted = holm([speed.p_value for _, speed, *_ in judged])
    for (key, speed, drift, distrust, divided), p_value in zip(judged, adjusted):
        outcome, reason = decide(speed.ratio, p_value, speed.interval, thresholds)
        if distrust and contradicted(outcome, speed.ratio, divided, thresholds):
            outcome, reason = Outcome.NOISY, (
                f"{distrust}; raw ms say {speed.ratio - 1:+.0%}, divided by it "
                f"{divided - 1:+.0%}: the machine's drift cannot be told from a change")
        elif distrust:
            reason = "; ".join(filter(None, (reason, distrust)))
        results[key] = PointResult(key, outcome, base[key], now[key], speed.ratio,
                                   speed.interval, p_value, reason, drift,
                                   probe_applied=math.isfinite(drift) and not distrust)
    order = {o: i for i, o in enumerate(Outcome)}
    ordered = sorted((results[k] for k in common), key=lambda p: order[p.outcome])
    notes = _environment_notes(base, now)
    if not common:
        notes.append(_nothing_comparable(base, now))
    return GateReport(ordered, [k for k in base if k not in now],
                      [k for k in now if k not in base], thresholds, notes, allow_unjudged)


def _nothing_comparable(base: dict[PointKey, ResultRecord],
                        now: dict[PointKey, ResultRecord]) -> str:
    def conditions(keys: Iterable[PointKey]) -> str:
        found = sorted({f"{k.device} with {k.threads} thread{'s' * (k.threads != 1)}"
                        for k in keys})
        return "; ".join(found) or "no results"

    return (f"nothing comparable: the baseline holds {conditions(base)}, the current results "
            f"hold {conditions(now)} (points are compared only on the same device, thread "
            "count, implementation, case and dtype)")


# Baselines on disk ---------------------------------------------------------------------


__all__ = [
    "GateReport",
    "PointKey",
    "PointResult",
    "compare",
    "contradicted",
    "judged_samples",
    "probe_distrust",
    "point_key",
    "points",
]
