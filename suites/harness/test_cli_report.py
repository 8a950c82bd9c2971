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


@pytest.mark.parametrize("argv, message", [
    (["run", "--device", "tpu"], "must be cpu, cuda or cuda:N"),
    (["run", "--device", "cuda:x"], "must be cpu, cuda or cuda:N"),
    (["run", "--case-timeout", "nan"], "finite number of seconds > 0"),
    (["run", "--case-timeout", "0"], "finite number of seconds > 0"),
    (["run", "--block-size", "0"], "integer >= 1"),
    (["run", "--preset", "gpt-5"], "invalid choice"),
    (["list", "--device", "mps"], "must be cpu, cuda or cuda:N"),
])
def test_bad_arguments_are_named_with_the_allowed_values(argv, message, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_unusable_paths_exit_with_a_message(tmp_path) -> None:
    a_file = tmp_path / "f"
    a_file.write_text("")
    with pytest.raises(SystemExit, match="--results-dir .* is a file"):
        main(["run", "--results-dir", str(a_file)])
    with pytest.raises(SystemExit, match="--cache-dir .* is a file"):
        main(["run", "--cache-dir", str(a_file)])
    not_a_result = tmp_path / "x.jsonl"
    not_a_result.write_text("[1, 2]\n")
    with pytest.raises(SystemExit, match="record 1 is not a result"):
        main(["report", str(not_a_result)])
    with pytest.raises(SystemExit, match="--output folder .* does not exist"):
        main(["report", str(not_a_result), "--output", str(tmp_path / "no" / "x.md")])


def test_report_keeps_cpu_and_gpu_results_apart(tmp_path, capsys) -> None:
    for device, ms in (("cpu", 9.0), ("cuda", 0.05)):
        ResultsFile(tmp_path / f"{device}.jsonl").append(
            {"impl": "k", "case_id": "c1", "status": "pass", "device": device,
             "time_ms_median": ms, "timing_method": "perf_counter", "run_id": device,
             "env": {"device": device}})
    assert main(["report", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "k@cpu" in out and "k@cuda" in out
    assert "Device: cpu" in out and "Device: cuda" in out


def test_run_exits_2_when_nothing_ran(tmp_path) -> None:
    """Every selected implementation unavailable here (a GPU-only one on the CPU): no
    verdict at all must not look like success."""
    gpu_only = next(name for name, (_, a) in registry().items()
                    if "cpu" not in a.capabilities("cpu").devices)
    code = main(["run", "--impl", gpu_only, "--preset", "llama3.1-70b-tp8", "--block-size",
                 "16", "--results-dir", str(tmp_path), "--no-timing",
                 "--cache-dir", str(tmp_path / "build")])
    assert code == 2


def test_a_broken_out_of_tree_adapter_is_unavailable_not_fatal(tmp_path) -> None:
    import os
    import subprocess
    import sys

    dist = tmp_path / "site" / "broken_plugin-0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-plugin\nVersion: 0\n")
    (dist / "entry_points.txt").write_text("[pagedbench.adapters]\nx = not_installed_mod:Thing\n")
    env = dict(os.environ, PYTHONPATH=str(tmp_path / "site"))
    listed = subprocess.run([sys.executable, "-m", "pagedbench.harness.cli", "list", "--json"],
                            env=env, capture_output=True, text=True, timeout=300)
    assert listed.returncode == 0, listed.stderr
    row = next(r for r in json.loads(listed.stdout) if r["name"] == "not_installed_mod:Thing")
    assert not row["available"]
    assert "ModuleNotFoundError" in row["reason"] and "not_installed_mod" in row["reason"]
