"""``pagedbench run --junit-xml FILE``: one testcase per (implementation, case), a failure
with the tolerance figures, errors and skips by status; parsed back with junitparser, as CI
reporters read it."""

from __future__ import annotations

import subprocess
import sys
import xml.etree.ElementTree as ET

from junitparser import Error, Failure, JUnitXml, Skipped

from pagedbench.harness.results.junit import junit_xml
from pagedbench.harness.results.record import ResultRecord
from pagedbench.harness.results.store import read_lines
from pagedbench.harness.verdict.status import ExitCode

from ..conftest import result

CLI = [sys.executable, "-m", "pagedbench.harness.cli"]


def properties(path) -> dict[tuple[str, str], dict[str, str]]:
    """Each testcase's ``<properties>`` (junitparser reads them only on suites)."""
    return {(case.get("classname"), case.get("name")):
            {p.get("name"): p.get("value") for p in case.iter("property")}
            for case in ET.parse(path).iter("testcase")}


def test_run_writes_one_testcase_per_implementation_and_case(tmp_path, plugin_env) -> None:
    xml = tmp_path / "verdicts.xml"
    impls = ["torch-gather", "reads-past", "missing-module", "flashinfer-nhd"]
    proc = subprocess.run(
        [*CLI, "run", "--preset", "llama3.1-70b-tp8", "--block-size", "16", "--no-timing",
         *(a for impl in impls for a in ("--impl", impl)), "--junit-xml", str(xml),
         "--results-dir", str(tmp_path / "results"), "--cache-dir", str(tmp_path / "build")],
        env=plugin_env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == ExitCode.CONFORMANCE_FAILURE, proc.stdout + proc.stderr
    (jsonl,) = (tmp_path / "results").glob("*.jsonl")
    records = {(r.impl, r.case_id): r for r in read_lines([jsonl]) if isinstance(r, ResultRecord)}
    (suite,) = JUnitXml.fromfile(str(xml))
    cases = {(c.classname, c.name): c for c in suite}
    assert set(cases) == set(records) and len(cases) == 2 * len(impls)
    assert (suite.tests, suite.failures, suite.errors, suite.skipped) == (8, 2, 2, 2)
    for key, case in cases.items():
        record = records[key]
        kinds = [type(r) for r in case.result]
        expected = {"torch-gather": [], "reads-past": [Failure], "missing-module": [Error],
                    "flashinfer-nhd": [Skipped]}[key[0]]
        assert kinds == expected, (key, kinds)
        if key[0] == "reads-past":
            (failure,) = case.result
            assert failure.message == record.reason and failure.type == "fail"
            # NaN read past kv_len: only the worst element is known.
            assert failure.text.endswith(f"\nworst_index = {record.worst_index}")
            assert record.worst_index is not None and record.max_abs_err is None
        assert properties(xml)[key] == {"status": str(record.status),
                                        "device": record.env.device}


def test_control_characters_and_timings_survive_as_valid_xml(tmp_path) -> None:
    records = [result("a", "c1", "error", reason="boom\x00\x1b[31m"), result("a", "c1", ms=2.5),
               result("b", "c1", ms=1.25)]
    path = tmp_path / "j.xml"
    path.write_text(junit_xml(records, "suite \x07"))
    (suite,) = JUnitXml.fromfile(str(path))
    assert suite.name == "suite \\x07"
    cases = {c.classname: c for c in suite}
    assert [type(r) for r in cases["a"].result] == []  # the later result of (a, c1) wins
    assert properties(path)[("b", cases["b"].name)]["time_ms_median"] == "1.25"
    (error,) = junit_xml(records[:1], "s").split("<error ")[1:]
    assert 'message="boom\\x00\\x1b[31m"' in error


def test_a_failure_carries_the_tolerance_figures() -> None:
    failed = result("a", "c1", "fail", reason="error 3.1x the allowance", max_abs_err=0.031,
                    allowed_abs_err=0.01, err_over_allowance=3.1, worst_index=[0, 1, 2, 3])
    ((case,),) = JUnitXml.fromstring(junit_xml([failed], "s"))
    text = case.result[0].text
    assert text.splitlines() == [
        "a on c1-fp32-d8-bs4-h2x1-b1-kv3: fail at step ?: error 3.1x the allowance",
        "max_abs_err = 0.031", "allowed_abs_err = 0.01", "err_over_allowance = 3.1",
        "worst_index = [0, 1, 2, 3]"]
