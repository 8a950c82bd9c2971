"""`pagedbench report` renders stored result files; `pagedbench list --json` describes
every registered implementation."""

from __future__ import annotations

import csv
import io
import json

import pytest

from pagedbench.adapters import registry
from pagedbench.harness.cli import main
from pagedbench.harness.store import ResultsFile


def _write(path, impl, case_id, status, ms):
    ResultsFile(path).append({"impl": impl, "case_id": case_id, "status": status, "reason": "",
                              "time_ms_median": ms, "timing_method": "perf_counter",
                              "run_id": "r1", "env": {"device": "cpu0"}})


def test_report_merges_files_and_later_lines_win(tmp_path, capsys) -> None:
    _write(tmp_path / "a.jsonl", "x", "c1", "fail", None)
    _write(tmp_path / "b.jsonl", "x", "c1", "pass", 3.0)
    _write(tmp_path / "b.jsonl", "y", "c1", "pass", 1.5)
    assert main(["report", str(tmp_path), "--format", "csv"]) == 0
    rows = list(csv.DictReader(io.StringIO(capsys.readouterr().out)))
    assert [(r["impl"], r["status"], r["time_ms_median"]) for r in rows] == [
        ("x", "pass", "3.0"), ("y", "pass", "1.5")]
    out = tmp_path / "board.md"
    assert main(["report", str(tmp_path / "b.jsonl"), "--output", str(out)]) == 0
    assert "**pass 1.5 ms**" in out.read_text()


def test_report_rejects_missing_paths(tmp_path) -> None:
    with pytest.raises(SystemExit, match="no such file"):
        main(["report", str(tmp_path / "absent.jsonl")])


def test_list_json_covers_every_registered_adapter(capsys) -> None:
    assert main(["list", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["name"] for r in rows] == list(registry())
    for row in rows:
        assert isinstance(row["available"], bool)
        assert row["available"] or row["reason"], f"{row['name']} unavailable without a reason"
        assert set(row["capabilities"]) >= {"devices", "dtypes", "block_sizes", "head_dims", "modes"}
