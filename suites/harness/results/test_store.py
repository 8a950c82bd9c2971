"""Reports and resumes trust no input: every results line is validated against the schema,
refused ones are named by file and line, torn ones are skipped with a warning naming the
file, and Markdown cells are escaped."""

from __future__ import annotations

import json
import re
import threading
import warnings

import pytest

from pagedbench.harness.cli import main
from pagedbench.harness.results import report
from pagedbench.harness.results.record import SCHEMA_VERSION, RunRecord, now
from pagedbench.harness.results.store import ResultsFile, ResultsFileError, read_lines
from pagedbench.reference import PagedCase

from ..conftest import ENV, result


def _line(record) -> str:
    return record.model_dump_json() + "\n"


def _data(record) -> dict:
    return json.loads(record.model_dump_json())


@pytest.mark.parametrize("change, message", [
    ({"schema_version": 99}, "schema_version 99 was written by a newer pagedbench"),
    ({"schema_version": "2"}, "schema_version '2' is not an integer"),
    ({"status": "PASSED"}, "status: Input should be 'pass', 'fail'"),
    ({"bytes_moved": "12"}, "bytes_moved: Input should be a valid integer"),
    ({"interpreted": "true"}, "interpreted: Input should be a valid boolean"),
    ({"case": {"kv_lens": [0]}}, "case is missing fields"),
    ({"surprise": 1}, "surprise: Extra inputs are not permitted"),
])
def test_a_bad_line_is_refused_naming_file_and_line(change, message, tmp_path) -> None:
    good = result("x")
    path = tmp_path / "r.jsonl"
    path.write_text(_line(good) + json.dumps(_data(good) | change) + "\n")
    with pytest.raises(ResultsFileError, match=f"r.jsonl:2: {message}"):
        list(read_lines([path]))


def test_a_missing_field_is_refused(tmp_path) -> None:
    data = _data(result("x"))
    del data["flops"]
    path = tmp_path / "r.jsonl"
    path.write_text(json.dumps(data) + "\n")
    with pytest.raises(ResultsFileError, match="r.jsonl:1: flops: Field required"):
        list(read_lines([path]))


def test_a_torn_last_line_is_skipped_in_any_file_of_a_set(tmp_path) -> None:
    torn = tmp_path / "a.jsonl"
    torn.write_text(_line(result("x", "c1")) + _line(result("x", "c2"))[:150])
    whole = tmp_path / "b.jsonl"
    whole.write_text(_line(result("y", "c1")))
    with pytest.warns(UserWarning, match="a.jsonl:2: skipping a torn last line"):
        records = list(read_lines([torn, whole]))
    assert [(r.impl, r.case["name"]) for r in records] == [("x", "c1"), ("y", "c1")]


def test_concatenated_files_with_a_torn_one_keep_every_whole_record(tmp_path) -> None:
    """``cat torn.jsonl whole.jsonl``: the fragment is glued to the next file's first
    record; that record is kept, the fragment skipped."""
    merged = tmp_path / "merged.jsonl"
    merged.write_text(_line(result("x", "c1")) + _line(result("x", "c2"))[:150]
                      + _line(result("y", "c1")) + _line(result("y", "c2")))
    with pytest.warns(UserWarning, match="merged.jsonl:2: skipping a torn line glued"):
        records = list(read_lines([merged]))
    assert [(r.impl, r.case["name"]) for r in records] == [
        ("x", "c1"), ("y", "c1"), ("y", "c2")]


def test_garbage_in_the_middle_is_refused(tmp_path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(_line(result("x")) + "{not json\n" + _line(result("y")))
    with pytest.raises(ResultsFileError, match="bad.jsonl:2: not a JSON line"):
        list(read_lines([path]))


def test_appending_after_a_torn_line_drops_it_first(tmp_path) -> None:
    path = tmp_path / "r.jsonl"
    path.write_text(_line(result("x", "c1")) + '{"kind": "res')
    with pytest.warns(UserWarning, match="dropping a torn last line"):
        ResultsFile(path).append(result("x", "c2"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert [r.case["name"] for r in read_lines([path])] == ["c1", "c2"]


def test_version_1_lines_are_read(tmp_path) -> None:
    data = _data(result("x"))
    for name in ("kind", "step", "worst_index"):
        data.pop(name)
    path = tmp_path / "old.jsonl"
    path.write_text(json.dumps(data | {"schema_version": 1}) + "\n")
    (record,) = read_lines([path])
    assert record.schema_version == SCHEMA_VERSION and record.step is None


def test_version_3_timings_are_read_without_a_drift_probe(tmp_path) -> None:
    data = _data(result("x", ms=2.0))
    data["time_ms"].pop("probe")
    path = tmp_path / "v3.jsonl"
    path.write_text(json.dumps(data | {"schema_version": 3}) + "\n")
    (record,) = read_lines([path])
    assert record.time_ms.probe == [] and record.time_ms.samples == data["time_ms"]["samples"]
    # ... but a version-4 line must have it.
    path = tmp_path / "v4.jsonl"
    path.write_text(json.dumps(data | {"schema_version": SCHEMA_VERSION}) + "\n")
    with pytest.raises(ResultsFileError, match="probe"):
        list(read_lines([path]))


def test_a_probe_without_one_block_per_sample_is_refused(tmp_path) -> None:
    data = _data(result("x", ms=2.0))  # three samples
    data["time_ms"]["probe"] = [1.0, 1.0]
    path = tmp_path / "r.jsonl"
    path.write_text(json.dumps(data) + "\n")
    with pytest.raises(ResultsFileError, match=r"r\.jsonl:1.*time_ms\.probe.*one per sample \(3\)"):
        list(read_lines([path]))


def test_markdown_cells_are_escaped() -> None:
    case = PagedCase(kv_lens=(3,), num_q_heads=2, num_kv_heads=1, head_dim=8, block_size=4,
                     dtype="float32", name="a|b\nc")
    records = [result("x|y", case, "fail", reason="bad | worse\nworst"),
               result("z", case, "pass", 1.0)]
    text = report.markdown(records)
    (row,) = [line for line in text.splitlines() if line.startswith("| a")]
    assert _cells(row) == [r"a\|b<br>c-fp32-d8-bs4-h2x1-b1-kv3", "fail", "pass 1 ms [1-1] n=3"]
    header = next(line for line in text.splitlines() if line.startswith("| case"))
    assert _cells(header) == ["case", r"x\|y", "z"]
    assert r"- x\|y: fail: bad \| worse<br>worst (every case)" in text


def test_markdown_escapes_html_from_names_case_ids_and_reasons() -> None:
    """A Markdown renderer passes raw HTML through, so every ``<``, ``>`` and ``&`` from an
    implementation, a case id or a reason is an entity."""
    case = PagedCase(kv_lens=(3,), num_q_heads=2, num_kv_heads=1, head_dim=8, block_size=4,
                     dtype="float32", name="<img src=x onerror=alert(1)>")
    records = [result("<script>alert(1)</script>", case, "fail", reason="</table> & <b>|"),
               result("z", case, "pass", 1.0)]
    text = report.markdown(records)
    for raw in ("<script", "<img", "</table>", "<b>", " & "):
        assert raw not in text
    header = next(line for line in text.splitlines() if line.startswith("| case"))
    assert _cells(header) == ["case", "&lt;script&gt;alert(1)&lt;/script&gt;", "z"]
    assert "&lt;img src=x onerror=alert(1)&gt;-fp32" in text
    assert r"fail: &lt;/table&gt; &amp; &lt;b&gt;\| (every case)" in text
    assert report.escape("a\nb") == "a<br>b"


def _cells(row: str) -> list[str]:
    """The cells of a Markdown table row, split at unescaped pipes."""
    return [cell.strip() for cell in re.split(r"(?<!\\)\|", row)[1:-1]]


def test_fastest_is_never_bolded_across_cpu_and_gpu() -> None:
    h200 = ENV | {"device": "NVIDIA H200", "device_type": "cuda"}
    records = [result("k", "c1", "pass", 9.0, device="cpu"),
               result("k", "c1", "pass", 0.05, device="cuda", env=h200),
               result("j", "c1", "pass", 4.0, device="cpu")]
    table = report.leaderboard(report.frame(records))
    row = table.loc[records[0].case_id]
    assert row.to_dict() == {"k@cpu0": "pass 9 ms [9-9] n=3",
                             "k@NVIDIA H200": "pass 0.05 ms [0.05-0.05] n=3",
                             "j@cpu0": "**pass 4 ms [4-4] n=3**"}


def test_a_report_of_an_unfinished_run_says_so(tmp_path) -> None:
    from pagedbench.harness.run.runner import make_plan

    cases = [PagedCase(kv_lens=(3,), num_q_heads=2, num_kv_heads=1, head_dim=8, block_size=4,
                       dtype="float32", name=n) for n in ("c1", "c2")]
    started = RunRecord(kind="run", schema_version=SCHEMA_VERSION, run_id="r1",
                        timestamp=now(), event="started", plan=make_plan({"x": "t:T"}, cases),
                        config={}, exit_code=None, counts=None)
    lines = [started, result("x", cases[0])]
    text = report.markdown(lines)
    assert "Unfinished run r1: 1 of 2 results, no end recorded" in text
    finished = started.model_copy(update={"event": "finished", "plan": None, "exit_code": 0})
    assert "Unfinished" not in report.markdown([*lines, result("x", cases[1]), finished])


def test_report_refuses_a_bad_file_with_its_line_and_no_traceback(tmp_path, capsys) -> None:
    path = tmp_path / "future.jsonl"
    path.write_text(json.dumps(_data(result("x")) | {"schema_version": 99}) + "\n")
    assert main(["report", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"{path}:1: schema_version 99" in err and "Traceback" not in err


def test_report_merges_files_and_later_lines_win(tmp_path, capsys) -> None:
    import csv
    import io

    ResultsFile(tmp_path / "a.jsonl").append(result("x", "c1", "fail"))
    ResultsFile(tmp_path / "b.jsonl").append(result("x", "c1", "pass", 3.0))
    ResultsFile(tmp_path / "b.jsonl").append(result("y", "c1", "pass", 1.5))
    assert main(["report", str(tmp_path), "--format", "csv"]) == 0
    rows = list(csv.DictReader(io.StringIO(capsys.readouterr().out)))
    assert [(r["impl"], r["status"], r["time_ms_median"]) for r in rows] == [
        ("x", "pass", "3.0"), ("y", "pass", "1.5")]
    # The case's axes (conftest.result's case: float32, 2 query heads over 1 KV head of 8).
    assert [[r[c] for c in ("dtype", "num_q_heads", "num_kv_heads", "head_dim", "layout")]
            for r in rows] == [["float32", "2", "1", "8", "contiguous"]] * 2
    out = tmp_path / "board.md"
    assert main(["report", str(tmp_path / "b.jsonl"), "--output", str(out)]) == 0
    assert "**pass 1.5 ms [1.5-1.5] n=3**" in out.read_text()


@pytest.mark.parametrize("name, target", [
    ("sdpa-contiguous", "pagedbench.suites.harness.plugins.exits_at_import:Anything"),
    ("planted", "pagedbench.suites.harness.plugins.exits_at_import:Anything"),
])
def test_resume_refuses_a_target_the_registry_does_not_name(tmp_path, capsys, name,
                                                           target) -> None:
    """A results file is data, not a list of programs: an edited plan naming a target that
    is not the registered adapter of its name is refused (exit 2, naming file and line)
    before anything is imported or written."""
    from pagedbench.harness.run.runner import RunConfig, make_plan

    case = PagedCase(kv_lens=(3,), num_q_heads=2, num_kv_heads=1, head_dim=8, block_size=4,
                     dtype="float32")
    plan = make_plan({"torch-gather": "pagedbench.adapters.torch_sdpa:TorchGather",
                      name: target}, [case])
    results = ResultsFile(tmp_path / "r1.jsonl")
    results.append(result("torch-gather", case))
    results.append(RunRecord(kind="run", schema_version=SCHEMA_VERSION, run_id="r1",
                             timestamp=now(), event="started", plan=plan,
                             config=RunConfig(timing=False).to_dict(), exit_code=None,
                             counts=None))
    before = results.path.read_bytes()
    assert main(["run", "--resume", "r1", "--results-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"{results.path}:2: the plan's {name!r} = {target!r} is not a registered" in err
    assert results.path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r1.jsonl"]


def test_results_file_appends_whole_lines_from_many_threads(tmp_path) -> None:
    store = ResultsFile(tmp_path / "sub" / "r.jsonl")
    payload = "x" * 5000

    def write(worker: int) -> None:
        for i in range(50):
            store.append(result(f"w{worker}", f"c{i}", reason=payload))

    threads = [threading.Thread(target=write, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    records = list(read_lines([tmp_path / "sub"]))
    assert len(records) == 200
    assert sorted((r.impl, r.case["name"]) for r in records) == sorted(
        (f"w{w}", f"c{i}") for w in range(4) for i in range(50))


def test_non_finite_figures_are_written_as_null(tmp_path) -> None:
    store = ResultsFile(tmp_path / "r.jsonl")
    store.append(result("x", max_abs_err=float("nan"), err_ratio_vs_naive=float("inf")))
    line = (tmp_path / "r.jsonl").read_text()
    data = json.loads(line)
    assert data["max_abs_err"] is None and data["err_ratio_vs_naive"] is None
    assert "NaN" not in line and "Infinity" not in line
