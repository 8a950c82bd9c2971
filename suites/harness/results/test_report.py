"""Leaderboard cells and tables (``harness/results/report.py``): the spread, samples and
noise flag of a pass, the fastest ranked pass in bold, interpreted timings never ranked,
marks for stale tails and case-dtype logits, and the error and bias of the passes in ulps."""

from __future__ import annotations

import pytest

from pagedbench.harness.results import report

from ..conftest import result


def test_cells_show_the_spread_samples_and_the_noise_flag() -> None:
    from pagedbench.harness.measure.timing import Timing

    record = result("a", "c1", "pass", 1.0)
    noisy = Timing((1.0, 1.0, 2.0, 3.0, 9.0), "torch_timer")  # IQR 2 > 10% of median 2
    record = record.model_copy(update={"time_ms": record.time_ms.model_validate(
        noisy.to_dict()), "time_ms_median": noisy.median_ms})
    assert report.cell_text(record) == "pass 2 ms [1-6.6] n=5 noisy"


def test_leaderboard_bolds_the_fastest_ranked_pass_and_never_ranks_interpreted() -> None:
    records = [
        result("a", "c1", "pass", 2.0), result("b", "c1", "pass", 1.0),
        result("interp", "c1", "pass", 0.5, method="interpreted"),
        result("a", "c2", "fail"), result("b", "c2", "unsupported"),
        result("interp", "c2", "pass", 0.1, method="interpreted"),
        result("gpu-only", "c1", "unavailable"), result("gpu-only", "c2", "unavailable"),
    ]
    c1, c2 = records[0].case_id, records[3].case_id
    df = report.frame(records)
    table = report.leaderboard(df)
    assert table.loc[c1, "b"] == "**pass 1 ms [1-1] n=3**"
    assert table.loc[c1, "a"] == "pass 2 ms [2-2] n=3"
    assert table.loc[c1, "interp"] == "pass (interp.)"
    assert table.loc[c2, "a"] == "fail" and table.loc[c2, "interp"] == "pass (interp.)"
    assert list(table.columns) == ["a", "b", "interp"]  # never-available: no column
    counts = report.summary(df)
    assert counts.loc["gpu-only", "unavailable"] == 2
    assert counts.loc["a"].to_dict() == {"pass": 1, "fail": 1, "unsupported": 0, "unavailable": 0,
                                         "max err (ulps)": "", "bias (ulps)": ""}
    text = report.markdown(records)
    assert "Device: cpu0" in text and "a: fail: why" in text


def test_summary_shows_the_error_and_bias_in_ulps_of_the_passes() -> None:
    records = [result("trunc", "c1", "pass", 1.0, max_err_ulps=1.0, mean_err_ulps=-0.3),
               result("trunc", "c2", "pass", 1.0, max_err_ulps=0.9, mean_err_ulps=-0.4),
               result("trunc", "c3", "fail", max_err_ulps=50.0, mean_err_ulps=9.0)]
    row = report.summary(report.frame(records)).loc["trunc"]
    assert row["max err (ulps)"] == 1.0 and row["bias (ulps)"] == pytest.approx(-0.35)


def test_cells_mark_stale_tails_and_declared_case_dtype_logits() -> None:
    plain = result("p", "c1", "pass", 2.0)
    stale = result("s", "c1", "pass", 2.0, tail_poison="stale")
    case_logits = result("l", "c1", "pass", 2.0, logits_precision="case")
    both = result("b", "c1", "pass", 2.0, tail_poison="stale", logits_precision="case")
    spread = "2 ms [2-2] n=3"
    assert [report.cell_text(r) for r in (plain, stale, case_logits, both)] == [
        f"pass {spread}", f"pass† {spread}", f"pass‡ {spread}", f"pass†‡ {spread}"]
    assert "`‡`: the implementation declares" in report.markdown([plain, case_logits])


def test_a_baseline_without_results_is_refused_naming_those_there(tmp_path, capsys) -> None:
    """``report --baseline NAME`` with no result of NAME would leave every speedup empty:
    exit 2, naming the implementations the files hold; without the option, the default
    baseline may be absent."""
    from pagedbench.harness.cli import main
    from pagedbench.harness.results.store import ResultsFile

    results = ResultsFile(tmp_path / "r.jsonl")
    for record in (result("a", "c1", "pass", 2.0), result("b", "c1", "pass", 1.0)):
        results.append(record)
    assert main(["report", str(results.path), "--baseline-impl", "nosuch"]) == 2
    assert "--baseline nosuch: no result of it in these files; the implementations there: " \
           "a, b" in capsys.readouterr().err
    assert main(["report", str(results.path), "--baseline", "b"]) == 0
    assert main(["report", str(results.path)]) == 0


def test_the_markdown_and_the_site_show_the_same_measured_peaks() -> None:
    """Two runs that measured different peaks: both formats show the later run's (the
    Markdown showed the last run's, the site the first's)."""
    from pagedbench.harness.measure.roofline import DevicePeaks
    from pagedbench.harness.results import site

    first = DevicePeaks(copy_gbps=38.7, bf16_tflops=0.525, method="torch_timer")
    later = DevicePeaks(copy_gbps=34.3, bf16_tflops=0.255, method="torch_timer")
    lines = [result("a", "c1", "pass", 1.0, run_id="r1", peaks=first),
             result("a", "c2", "pass", 1.0, run_id="r2", peaks=later)]
    assert "Measured peaks: 34.3 GB/s copy, 0.255 TFLOP/s bf16 matmul." in \
        report.markdown(lines)
    conditions = site.conditions(lines, lines)
    assert "34.3 GB/s (measured)" in conditions and "38.7" not in conditions


def test_of_two_runs_of_a_point_the_one_measured_last_is_shown_in_any_order(tmp_path) -> None:
    """Two runs of one point in two files: the report shows the one measured last, whichever
    file is named first (the one named last won before), and says once that the point was
    measured twice; the gate's points take the same one."""
    import warnings
    from datetime import datetime, timezone

    from pagedbench.harness.cli import main
    from pagedbench.harness.gate.compare import point_key, points
    from pagedbench.harness.results.store import ResultsFile

    early = result("k", "c1", "pass", 2.0, run_id="r-early",
                   timestamp=datetime(2026, 1, 1, tzinfo=timezone.utc))
    late = result("k", "c1", "pass", 1.0, run_id="r-late",
                  timestamp=datetime(2026, 1, 2, tzinfo=timezone.utc))
    other = result("k", "c2", "pass", 3.0, run_id="r-early",
                   timestamp=datetime(2026, 1, 1, tzinfo=timezone.utc))
    files = {}
    for name, records in (("late", [late]), ("early", [early, other])):
        files[name] = ResultsFile(tmp_path / f"{name}.jsonl")
        for record in records:
            files[name].append(record)
    for order in (("late", "early"), ("early", "late")):
        out = tmp_path / f"{order[0]}.csv"
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert main(["report", *(str(files[n].path) for n in order), "--format", "csv",
                         "--output", str(out)]) == 0
        rows = [line.split(",") for line in out.read_text().splitlines()]
        median = rows[0].index("time_ms_median")
        assert sorted((r[rows[0].index("case_id")][:2], float(r[median])) for r in rows[1:]) \
            == [("c1", 1.0), ("c2", 3.0)], order
        said = [str(w.message) for w in caught]
        assert [m for m in said if "more than one run" in m] == [
            "1 point(s) measured by more than one run (r-early, r-late): each shows the "
            "result measured last; name one run's file to read only its results"], said
        assert points([files[n].lines()[0] for n in order] + [other])[
            point_key(late)] == late
