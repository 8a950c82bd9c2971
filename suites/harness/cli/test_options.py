"""The CLI refuses bad options and paths with the option, the value and what is allowed
(exit 2, no traceback), documents its exit codes, and prints the results schema."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from pagedbench.harness.cli import main
from pagedbench.harness.results.record import json_schema
from pagedbench.harness.verdict.status import ExitCode

ROOT = Path(__file__).resolve().parents[3]
ONE_PRESET = ["--preset", "llama3.1-70b-tp8", "--block-size", "16", "--no-timing"]


@pytest.mark.parametrize("argv, message", [
    (["run", "--device", "tpu"], "must be cpu, cuda or cuda:N"),
    (["run", "--device", "cuda:x"], "must be cpu, cuda or cuda:N"),
    (["run", "--case-timeout", "nan"], "finite number of seconds > 0"),
    (["run", "--harness-timeout", "-1"], "finite number of seconds > 0"),
    (["run", "--case-timeout", "0"], "finite number of seconds > 0"),
    (["run", "--block-size", "0"], "argument --block-size: must be an integer >= 1, got 0\n"),
    (["run", "--block-size", str(2**64)],
     f"argument --block-size: must be an integer >= 1 and <= 2**62, got {2**64}\n"),
    (["bench", "--shard", "3/2"], "argument --shard: must be K/N with 1 <= K <= N, got '3/2'"),
    (["run", "--threads", "100000"], "<= 1024"),
    (["run", "--preset", "gpt-5"], "invalid choice"),
    (["run", "--resume", "../x"], "must be a run id"),
    (["list", "--device", "mps"], "must be cpu, cuda or cuda:N"),
    (["list", "--timeout", "inf"], "finite number of seconds > 0"),
])
def test_bad_arguments_are_named_with_the_allowed_values(argv, message, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == ExitCode.USAGE_ERROR
    assert message in capsys.readouterr().err


def _usage_error(argv: list[str], capsys) -> str:
    assert main(argv) == ExitCode.USAGE_ERROR
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


@pytest.mark.parametrize("option", ["--results-dir", "--cache-dir"])
@pytest.mark.parametrize("where", ["a file", "under a file", "/proc"])
def test_unusable_output_folders_are_refused(option, where, tmp_path, capsys) -> None:
    a_file = tmp_path / "f"
    a_file.write_text("")
    path = {"a file": a_file, "under a file": a_file / "sub", "/proc": Path("/proc/pb")}[where]
    err = _usage_error(["run", option, str(path), "--impl", "torch-gather"], capsys)
    assert f"{option} {path}" in err


@pytest.mark.parametrize("where", ["under a file", "/proc"])
def test_simulate_output_dir_under_a_file_or_proc_is_refused(where, tmp_path, capsys) -> None:
    a_file = tmp_path / "f"
    a_file.write_text("")
    path = a_file / "sub" if where == "under a file" else Path("/proc/pb")
    err = _usage_error(["simulate", "--output-dir", str(path)], capsys)
    assert f"--output-dir {path}" in err


@pytest.mark.parametrize("output, message", [
    ("missing/x.md", "--output folder .* does not exist"),
    (".", "--output .* is a folder"),
    ("/proc/x.md", "--output /proc/x.md: cannot write there"),
])
def test_report_output_is_checked(output, message, tmp_path, capsys) -> None:
    from ..conftest import result
    from pagedbench.harness.results.store import ResultsFile

    ResultsFile(tmp_path / "r.jsonl").append(result("x"))
    target = output if output.startswith("/") else str(tmp_path / output)
    err = _usage_error(["report", str(tmp_path / "r.jsonl"), "--output", target], capsys)
    assert re.search(message, err), err


def test_report_rejects_missing_paths(tmp_path, capsys) -> None:
    err = _usage_error(["report", str(tmp_path / "absent.jsonl")], capsys)
    assert "no such file or folder" in err


def test_a_typo_in_impl_is_a_usage_error(tmp_path, capsys) -> None:
    err = _usage_error(["run", "--impl", "torch-gathr", "--results-dir", str(tmp_path)], capsys)
    assert "--impl torch-gathr: unknown; choose from sdpa-contiguous, torch-gather, " in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_a_device_this_machine_lacks_is_refused_before_any_worker(tmp_path, capsys) -> None:
    err = _usage_error(["run", "--device", "cuda", "--results-dir", str(tmp_path)], capsys)
    assert "--device cuda: device 'cuda': no CUDA device is visible to torch" in err
    assert not list(tmp_path.iterdir())


def test_an_implausible_block_size_is_refused_naming_it(tmp_path, capsys) -> None:
    err = _usage_error(["run", *ONE_PRESET[:2], "--block-size", "1000000000", "--impl",
                        "torch-gather", "--results-dir", str(tmp_path)], capsys)
    assert "--block-size 1000000000: block_size=1000000000: case llama3.1-70b-tp8" in err
    assert "GB of memory of cpu" in err and not list(tmp_path.iterdir())


def test_resume_needs_a_recorded_run_and_no_selection(tmp_path, capsys) -> None:
    err = _usage_error(["run", "--resume", "nope", "--results-dir", str(tmp_path)], capsys)
    assert f"--resume nope: no {tmp_path / 'nope.jsonl'}" in err
    err = _usage_error(["run", "--resume", "nope", "--impl", "x", "--results-dir",
                        str(tmp_path)], capsys)
    assert "drop --impl" in err
    from ..conftest import result
    from pagedbench.harness.results.store import ResultsFile

    ResultsFile(tmp_path / "old.jsonl").append(result("x", run_id="old"))
    err = _usage_error(["run", "--resume", "old", "--results-dir", str(tmp_path)], capsys)
    assert "records no start with a plan" in err


def test_run_exits_3_when_nothing_ran(tmp_path) -> None:
    """The selected implementation is unavailable here (a GPU-only one on the CPU, or a
    library not installed): no verdict at all must not look like success."""
    code = main(["run", "--impl", "flashinfer-nhd", *ONE_PRESET, "--results-dir",
                 str(tmp_path), "--cache-dir", str(tmp_path / "build")])
    assert code == ExitCode.NOTHING_RAN


def test_help_lists_every_exit_code(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    out = capsys.readouterr().out
    for code in ExitCode:
        assert f"  {int(code)}  {code.meaning}" in out


def test_schema_command_prints_the_committed_schema(capsys) -> None:
    assert main(["schema"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == json_schema()
    committed = json.loads((ROOT / "docs" / "result.schema.json").read_text())
    assert committed == printed, "regenerate: pagedbench schema > docs/result.schema.json"


def test_docs_document_every_field_and_readme_every_exit_code() -> None:
    results_page = (ROOT / "docs" / "results.md").read_text()
    schema = json_schema()["$defs"]
    for model, heading in (("ResultRecord", "## Result lines"), ("RunRecord", "## Run lines")):
        section = results_page.split(heading, 1)[1].split("\n## ", 1)[0]
        for field in schema[model]["properties"]:
            assert f"`{field}`" in section, f"docs/results.md, {heading[3:]}, lacks {model}.{field}"
    readme = (ROOT / "README.md").read_text()
    for code in ExitCode:
        assert f"| {int(code)} |" in readme


def test_what_commands_write_by_default_is_not_tracked() -> None:
    """The default output folders of run, bench, simulate and tune are ignored by git, so
    following the README leaves a clean checkout (tune wrote over the published
    ``results/tune/`` once) and later results do not record ``dirty``."""
    import shutil
    import subprocess

    from pagedbench.harness.capacity import simulate, tune
    from pagedbench.harness.run.config import DEFAULT_RESULTS_DIR

    if not (ROOT / ".git").exists() or shutil.which("git") is None:
        pytest.skip("not a git checkout")
    for folder in (DEFAULT_RESULTS_DIR, simulate.DEFAULT_OUTPUT_DIR, tune.DEFAULT_OUTPUT_DIR):
        probe = folder / "probe.jsonl"
        ignored = subprocess.run(["git", "check-ignore", "-q", str(probe)], cwd=ROOT)
        assert ignored.returncode == 0, f"{folder} is tracked"
