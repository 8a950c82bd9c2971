"""``pagedbench gate``: a conformance regression or a slowdown beyond noise exits 1, a point
too noisy to judge is listed as such, other devices are never compared (exit 5),
``--update-baseline`` writes the golden under ``<folder>/<device>/``."""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest

from pagedbench.harness.cli import main
from pagedbench.harness.gate import compare as gate
from pagedbench.harness.measure.speed import Outcome, Thresholds, compare_samples, holm
from pagedbench.harness.results.record import TimingStats
from pagedbench.harness.verdict.status import ExitCode

from ..conftest import ENV, result

RNG = np.random.default_rng(8)


def lognormal(median_ms: float, n: int = 30, sigma: float = 0.05) -> list[float]:
    """``n`` samples around ``median_ms`` with a multiplicative spread ``sigma``."""
    return list(median_ms * np.exp(RNG.normal(0, sigma, n)))


def timed(impl: str, case: str, samples: list[float] | None, status: str = "pass",
          device: str = "cpu0", probe: list[float] | None = None, **changes):
    """A result of ``impl`` on ``case`` with these raw samples (ms) on ``device``, and the
    drift probe blocks timed after them (none by default)."""
    record = result(impl, case, status, None if samples is None else 1.0,
                    env={**ENV, "device": device}, **changes)
    if samples is None:
        return record
    q10, q25, q50, q75, q90 = np.percentile(samples, [10, 25, 50, 75, 90])
    stats = TimingStats(median=q50, p10=q10, p90=q90, iqr=q75 - q25, n=len(samples),
                        method="perf_counter", samples=samples, noisy=None,
                        probe=probe or [])
    return record.model_copy(update={"time_ms": stats, "time_ms_median": q50})


def write(path, records) -> str:
    path.write_text("".join(r.model_dump_json() + "\n" for r in records))
    return str(path)


def test_holm_adjusts_as_the_step_down_procedure() -> None:
    # By hand: sorted 0.01, 0.03, 0.04 -> 3 x 0.01, max(0.03, 2 x 0.03), max(0.06, 0.04).
    assert holm([0.01, 0.04, 0.03]) == pytest.approx([0.03, 0.06, 0.06])
    assert holm([0.5, 0.9]) == [1.0, 1.0]


@pytest.mark.parametrize("factor, outcome", [(1.0, Outcome.SAME), (1.25, Outcome.SLOWER),
                                             (0.75, Outcome.FASTER), (1.05, Outcome.SAME)])
def test_a_shift_is_judged_by_the_u_test_and_the_minimum_effect(factor, outcome) -> None:
    baseline = lognormal(10.0)
    speed = compare_samples(baseline, [s * factor for s in lognormal(10.0)])
    assert speed.outcome is outcome, speed
    assert speed.ratio == pytest.approx(factor, rel=0.05)
    low, high = speed.interval
    assert low < speed.ratio < high


def test_too_few_or_too_spread_samples_are_too_noisy_never_same() -> None:
    few = compare_samples(lognormal(10.0, n=5), lognormal(10.0, n=30))
    assert few.outcome is Outcome.NOISY and "baseline has 5 samples" in few.reason
    # The same 30 values spread over e^-1..e on both sides: p = 1, but +10% cannot be
    # excluded.
    spread = list(10 * np.exp(np.linspace(-1, 1, 30)))
    wide = compare_samples(spread, spread[::-1])
    assert wide.p_value == pytest.approx(1.0) and wide.ratio == 1.0
    assert wide.outcome is Outcome.NOISY and "can be neither shown nor ruled out" in wide.reason


def busy(work_ms: float, load: tuple[float, float], n: int = 30):
    """``n`` samples of ``work_ms`` and of a 1 ms probe, each pair slowed alike by a
    machine load drawn per block from ``load`` (a factor range), each with its own 3%
    noise: what a shared runner does to both at the same moment."""
    factor = RNG.uniform(*load, n)
    samples = list(work_ms * factor * np.exp(RNG.normal(0, 0.03, n)))
    return samples, list(factor * np.exp(RNG.normal(0, 0.03, n)))


def timed_busy(impl: str, case: str, work_ms: float, load: tuple[float, float]):
    """:func:`timed` with samples and drift probe from :func:`busy`."""
    samples, probe = busy(work_ms, load)
    return timed(impl, case, samples, probe=probe)


def test_the_drift_probe_cancels_the_machines_drift_and_keeps_a_real_slowdown() -> None:
    base = [timed_busy("a", f"c{i}", 10.0, (1.0, 1.2)) for i in range(3)]
    # The same code on a machine 40-120% busier, block by block: raw ms say slower.
    drifted = [timed_busy("a", f"c{i}", 10.0, (1.4, 2.2)) for i in range(3)]
    judged = gate.compare(base, drifted)
    assert judged.exit_code is ExitCode.CLEAN, judged.markdown()
    assert all(p.outcome is Outcome.SAME for p in judged.points)
    assert all(1.4 < p.drift < 1.8 for p in judged.points)  # the drift probe's own change
    assert "the drift probe (the machine's own speed) moved +" in judged.markdown()
    raw = gate.compare(base, drifted, Thresholds(probe=False))
    assert raw.exit_code is ExitCode.REGRESSION
    assert all(p.outcome is Outcome.SLOWER and math.isnan(p.drift) for p in raw.points)
    # 25% slower code on the busier machine: slower by about 25%, not by 75%.
    slowed = [timed_busy("a", f"c{i}", 12.5, (1.4, 2.2)) for i in range(3)]
    judged = gate.compare(base, slowed)
    assert judged.exit_code is ExitCode.REGRESSION
    assert all(p.outcome is Outcome.SLOWER and 1.15 < p.ratio < 1.35 for p in judged.points)


def test_raw_ms_are_judged_where_a_side_has_no_drift_probe(tmp_path, capsys) -> None:
    samples, probe = busy(10.0, (1.0, 1.2))
    base = [timed("a", "c1", samples, probe=probe)]
    now = [timed("a", "c1", [2 * s for s in samples])]  # no drift probe (a GPU timing)
    (point,) = gate.compare(base, now).points
    assert point.outcome is Outcome.SLOWER and point.ratio == pytest.approx(2.0)
    assert math.isnan(point.drift)
    # --raw on the command line judges raw ms even where both sides have drift probes.
    now = [timed("a", "c1", [2 * s for s in samples], probe=[2 * y for y in probe])]
    paths = ["--baseline", write(tmp_path / "b.jsonl", base),
             "--current", write(tmp_path / "c.jsonl", now)]
    assert main(["gate", *paths]) == ExitCode.CLEAN
    report = tmp_path / "gate.md"
    assert main(["gate", *paths, "--raw", "--output", str(report)]) == ExitCode.REGRESSION
    assert "raw ms, --raw" in report.read_text()


def test_thresholds_refuse_bad_values_naming_the_option() -> None:
    with pytest.raises(ValueError, match="--min-effect"):
        Thresholds(min_effect=0)
    with pytest.raises(ValueError, match="--min-samples"):
        Thresholds(min_samples=1)


def test_conformance_regressions_fail_the_gate_whatever_the_speed() -> None:
    base = [timed("a", "c1", lognormal(5)), timed("a", "c2", None, "fail"),
            timed("b", "c1", lognormal(5)), timed("b", "c2", None, "unsupported")]
    now = [timed("a", "c1", None, "crash"), timed("a", "c2", lognormal(5)),
           timed("b", "c1", lognormal(5)), timed("b", "c2", None, "timeout")]
    report = gate.compare(base, now)
    outcomes = {(p.key.impl, p.key.case_id.split("-")[0]): p.outcome for p in report.points}
    assert outcomes == {("a", "c1"): Outcome.BROKEN, ("a", "c2"): Outcome.FIXED,
                        ("b", "c1"): Outcome.SAME, ("b", "c2"): Outcome.BROKEN}
    assert report.exit_code is ExitCode.REGRESSION


def test_other_devices_are_never_compared() -> None:
    report = gate.compare([timed("a", "c1", lognormal(5), device="NVIDIA H100")],
                          [timed("a", "c1", lognormal(50), device="NVIDIA H200")])
    assert report.points == [] and report.exit_code is ExitCode.NOTHING_COMPARABLE
    assert "NVIDIA H100" in report.markdown() and "NVIDIA H200" in report.markdown()


def test_the_table_lists_what_moved_by_effect_then_what_was_too_noisy(tmp_path, capsys) -> None:
    base = [timed("a", f"c{i}", lognormal(10)) for i in range(4)]
    base.append(timed("a", "c4", lognormal(10, n=4)))
    now = [timed("a", "c0", lognormal(13)), timed("a", "c1", lognormal(30)),
           timed("a", "c2", lognormal(5)), timed("a", "c3", lognormal(10)),
           timed("a", "c4", lognormal(10, n=4))]
    code = main(["gate", "--baseline", write(tmp_path / "b.jsonl", base),
                 "--current", write(tmp_path / "c.jsonl", now),
                 "--output", str(tmp_path / "gate.md")])
    printed = capsys.readouterr().out
    assert code == ExitCode.REGRESSION
    # The terminal's summary: the same order, outcome first, then the one verdict line.
    listed = re.findall(r"^ *(slower|faster|too noisy) +a +(c\d)-", printed, re.MULTILINE)
    assert listed == [("slower", "c1"), ("slower", "c0"), ("faster", "c2"), ("too noisy", "c4")]
    assert printed.strip().splitlines()[-1].startswith("gate: FAIL: 5 points compared")
    out = (tmp_path / "gate.md").read_text()
    moved = out.split("## What moved", 1)[1].split("## Too noisy", 1)[0]
    rows = [line.split("|")[3].strip().split("-")[0] for line in moved.splitlines()
            if "| a " in line]
    assert rows == ["c1", "c0", "c2"]  # slower x3, slower x1.3, then faster x0.5
    noisy = out.split("## Too noisy to judge", 1)[1]
    assert "c4" in noisy and "fewer than 9" in noisy
    assert "5 points compared: 2 slower, 1 faster, 1 too noisy, 1 same" in out


def test_update_baseline_writes_per_device_and_the_next_gate_reads_it(tmp_path,
                                                                       capsys) -> None:
    records = [timed("a", "c1", lognormal(5), device="AMD EPYC 7763"),
               timed("a", "c1", lognormal(5), device="NVIDIA H200")]
    baselines = tmp_path / "results" / "baselines"
    current = write(tmp_path / "run.jsonl", records)
    assert main(["gate", "--baseline", str(baselines), "--current", current,
                 "--update-baseline"]) == ExitCode.CLEAN
    written = sorted(p.relative_to(baselines).as_posix() for p in baselines.rglob("*.jsonl"))
    assert written == ["amd-epyc-7763/baseline.jsonl", "nvidia-h200/baseline.jsonl"]
    lines = (baselines / "nvidia-h200" / "baseline.jsonl").read_text().splitlines()
    assert [json.loads(line)["env"]["device"] for line in lines] == ["NVIDIA H200"]
    assert main(["gate", "--baseline", str(baselines), "--current", current]) == ExitCode.CLEAN
    one_thread = timed("a", "c1", lognormal(5), device="M3")
    one_thread = one_thread.model_copy(update={"env": one_thread.env.model_copy(
        update={"threads": 1})})
    other = write(tmp_path / "other.jsonl", [timed("a", "c1", lognormal(5), device="M3"),
                                             one_thread])
    assert main(["gate", "--baseline", str(baselines), "--current", other]) \
        == ExitCode.NOTHING_COMPARABLE
    out = " ".join(capsys.readouterr().out.split())  # the log's width wraps it, whole
    assert ("the current results hold M3 with 1 thread; M3 with 2 threads (points are "
            "compared only on the same device, thread count, implementation, case and "
            "dtype)") in out, out


def test_a_probe_judged_change_is_marked_and_the_mark_explained(tmp_path, capsys,
                                                                monkeypatch) -> None:
    """The table's ms columns are raw medians; a change judged on samples divided by their
    probe is marked, the mark explained under the table; a raw one is not."""
    monkeypatch.setenv("COLUMNS", "160")  # the table whole, whatever runs the test
    base = [timed_busy("a", "c1", 10.0, (1.0, 1.1)), timed("a", "c2", lognormal(10))]
    now = [timed_busy("a", "c1", 15.0, (1.0, 1.1)), timed("a", "c2", lognormal(15))]
    argv = ["gate", "--baseline", write(tmp_path / "b.jsonl", base), "--current",
            write(tmp_path / "c.jsonl", now)]
    assert main(argv) == ExitCode.CONFORMANCE_FAILURE
    out = capsys.readouterr().out
    marks = {words[2][:2]: words[-1].endswith("%*") for line in out.splitlines()
             if len(words := line.split()) > 5 and words[0] == "slower"}
    assert marks == {"c1": True, "c2": False}, out
    assert ("*: the change judged, of samples each divided by the drift probe timed after "
            "it; the ms columns are raw medians") in " ".join(out.split())


@pytest.mark.parametrize("argv, message", [
    (["gate", "--current", "x.jsonl"], "--baseline"),
    (["gate", "--baseline", "b", "--current", "c", "--min-effect", "0"], "must be a number > 0"),
    (["gate", "--baseline", "b", "--current", "c", "--alpha", "1"], "must be a number > 0 and < 1"),
])
def test_bad_gate_options_are_usage_errors(argv, message, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == ExitCode.USAGE_ERROR
    assert message in capsys.readouterr().err


def test_a_missing_or_malformed_file_is_a_usage_error(tmp_path, capsys) -> None:
    current = write(tmp_path / "c.jsonl", [timed("a", "c1", lognormal(5))])
    assert main(["gate", "--baseline", str(tmp_path / "none.jsonl"), "--current", current]) \
        == ExitCode.USAGE_ERROR
    assert "--update-baseline" in capsys.readouterr().err
    (tmp_path / "bad.jsonl").write_text('{"kind": "result"}\n')
    assert main(["gate", "--baseline", str(tmp_path / "bad.jsonl"), "--current", current]) \
        == ExitCode.USAGE_ERROR
    assert "bad.jsonl" in capsys.readouterr().err


def steady(median_ms: float, n: int = 20, phase: float = 0.0) -> list[float]:
    """``n`` samples within +-1% of ``median_ms`` (a fixed ripple, not random), so that
    the verdicts below follow from the medians alone."""
    return list(median_ms * np.exp(0.01 * np.sin(np.arange(n) * 1.3 + phase)))


def probed(impl: str, case: str, sample_ms: float, probe_ms: float):
    """:func:`timed` with :func:`steady` samples and drift probe blocks."""
    return timed(impl, case, steady(sample_ms), probe=steady(probe_ms, phase=0.7))


# m = log(1 + min_effect) = log 1.1 = 0.0953. The probe is not applied when |log d| >
# |log r| + m (r, d: ratios of the medians of the samples and of the probe).
@pytest.mark.parametrize("now_ms, now_probe, outcome, applied", [
    # The false alarm: the samples fell 1.739 -> 1.34 ms (log r = -0.261), the
    # probe fell 64% (log d = -1.022 > 0.261 + 0.095): not applied; raw ms say faster
    # (-23%), the divided samples slower (0.771 / 0.36 = 2.14): too noisy, not FAIL.
    (1.34, 0.36, Outcome.NOISY, False),
    # A busier machine, the same code: both +50% (0.405 <= 0.405 + 0.095): applied, same.
    (1.739 * 1.5, 1.5, Outcome.SAME, True),
    # 25% slower code on that machine: r = 1.875 (log 0.629), d = 1.5: applied, slower.
    (1.739 * 1.875, 1.5, Outcome.SLOWER, True),
    # The probe doubled (log 0.693), the samples +20% (log 0.182; 0.693 > 0.278): not
    # applied; raw +20% but divided -40%: too noisy.
    (1.739 * 1.2, 2.0, Outcome.NOISY, False),
    # The probe fell 40% (log 0.511), the samples rose 30% (log 0.262; 0.511 > 0.357): not
    # applied; raw +30% and divided +117% agree: slower.
    (1.739 * 1.3, 0.6, Outcome.SLOWER, False),
    # The quiet calibration's try 7 (results/gate-calibration/quiet-2core.json): code
    # slowed 1.5x on a machine 30% faster than when the golden was timed: the samples
    # +0.5% (31.779 -> 31.93 ms, log 0.005), the probe -30% (29.740 -> 20.924 ms, log
    # 0.352 > 0.100): not applied; raw ms say same, divided +43% (1.005 / 0.704): too
    # noisy, not a pass.
    (1.739 * 31.93 / 31.779, 20.924 / 29.740, Outcome.NOISY, False),
    # The same with the probe -5% only: applied (0.051 <= 0.100), divided +5.8%: same.
    (1.739 * 31.93 / 31.779, 0.95, Outcome.SAME, True),
])
def test_the_drift_probe_is_not_applied_where_it_moved_more_than_the_samples(
        now_ms, now_probe, outcome, applied) -> None:
    report = gate.compare([probed("a", "c1", 1.739, 1.0)], [probed("a", "c1", now_ms, now_probe)])
    (point,) = report.points
    assert (point.outcome, point.probe_applied) == (outcome, applied), point
    assert point.drift == pytest.approx(now_probe, rel=0.02)
    raw = now_ms / 1.739
    assert point.ratio == pytest.approx(raw if not applied else raw / now_probe, rel=0.02)
    assert (point.reason.startswith("drift probe not applied")) is (not applied)
    wanted = {Outcome.NOISY: ExitCode.UNJUDGED, Outcome.SAME: ExitCode.CLEAN,
              Outcome.SLOWER: ExitCode.REGRESSION}[outcome]
    assert report.exit_code is wanted


def test_points_missing_from_the_current_results_are_not_judged(tmp_path, capsys) -> None:
    """22 of 24 baseline points missing from the current results: the gate judges nothing
    there (exit 7), it never passes on the two points left."""
    base = [timed("a", f"c{i}", lognormal(5)) for i in range(24)]
    now = [timed("a", f"c{i}", lognormal(5)) for i in range(2)]
    paths = ["--baseline", write(tmp_path / "b.jsonl", base),
             "--current", write(tmp_path / "c.jsonl", now)]
    assert main(["gate", *paths]) == ExitCode.UNJUDGED
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last == ("gate: NOT JUDGED: 2 points compared: 2 same; 22 only in the baseline, 0 "
                    "only in the current results; 22 of 24 points not judged (exit 7; "
                    "--allow-unjudged to pass them)")
    assert main(["gate", *paths, "--allow-unjudged"]) == ExitCode.CLEAN
    assert capsys.readouterr().out.strip().endswith("(allowed by --allow-unjudged)")
    # New points (no baseline) are not judged either.
    assert gate.compare(now, base).exit_code is ExitCode.UNJUDGED


def test_too_noisy_or_one_sided_timings_exit_7_and_untimed_passes_do_not() -> None:
    few = gate.compare([timed("a", "c1", lognormal(5))], [timed("a", "c1", lognormal(5, n=6))])
    assert few.points[0].outcome is Outcome.NOISY and few.exit_code is ExitCode.UNJUDGED
    assert gate.compare([timed("a", "c1", lognormal(5))], [timed("a", "c1", lognormal(5, n=6))],
                        allow_unjudged=True).exit_code is ExitCode.CLEAN
    # Timed in the baseline, --no-timing now: the speed that was measured is not judged.
    one_sided = gate.compare([timed("a", "c1", lognormal(5))], [timed("a", "c1", None)])
    assert one_sided.points[0].outcome is Outcome.UNTIMED
    assert one_sided.exit_code is ExitCode.UNJUDGED
    # Neither side timed: the verdicts were all there was to judge.
    untimed = gate.compare([timed("a", "c1", None)], [timed("a", "c1", None)])
    assert untimed.points[0].outcome is Outcome.UNTIMED and untimed.exit_code is ExitCode.CLEAN
    # A regression still exits 1 beside points not judged.
    mixed = gate.compare([timed("a", "c1", lognormal(5)), timed("a", "c2", lognormal(5))],
                         [timed("a", "c1", lognormal(10)), timed("a", "c2", lognormal(5, n=3))])
    assert mixed.exit_code is ExitCode.REGRESSION
    assert mixed.summary().endswith("1 of 2 points not judged")
