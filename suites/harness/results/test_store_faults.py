"""Results and report files under hostile conditions: a write that fails (disk full, I/O
error) is reported naming the file, with exit 6 and no torn line; a line nested deeper than
Python can parse is refused naming file and line; one run has one writer at a time; a
symbolic link where pagedbench writes is refused, its target untouched."""

from __future__ import annotations

import errno
import os
import subprocess
import sys

import pytest

from pagedbench.harness.cli import main
from pagedbench.harness.results import store
from pagedbench.harness.results.record import SCHEMA_VERSION, RunRecord, now
from pagedbench.harness.results.store import (OutputError, ResultsFile, ResultsFileError,
                                              read_lines, write_output)
from pagedbench.harness.verdict.status import ExitCode

from ..conftest import result

GATHER = "pagedbench.adapters.torch_sdpa:TorchGather"


def _failing_write(monkeypatch, fail_at: int, code: int = errno.ENOSPC, short: bool = True):
    """Make ``os.write`` fail as a nearly full disk does: the ``fail_at``-th call (from 1)
    writes half its bytes (``short``) and the next one raises ``OSError(code)``."""
    real, calls = os.write, []

    def write(fd: int, data: bytes) -> int:
        calls.append(len(data))
        if len(calls) == fail_at and short:
            return real(fd, bytes(data)[: len(data) // 2])
        if len(calls) >= fail_at:
            raise OSError(code, os.strerror(code))
        return real(fd, data)

    monkeypatch.setattr(store.os, "write", write)
    return calls


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EIO])
def test_a_failed_append_leaves_no_torn_line_and_names_the_file(tmp_path, monkeypatch,
                                                                code) -> None:
    results = ResultsFile(tmp_path / "r.jsonl")
    results.append(result("x", "c1"))
    before = results.path.read_bytes()
    _failing_write(monkeypatch, fail_at=1, code=code)
    with pytest.raises(OutputError, match=f"{results.path}: cannot write .*{os.strerror(code)}"):
        results.append(result("x", "c2"))
    monkeypatch.undo()
    assert results.path.read_bytes() == before
    assert [r.case_id for r in read_lines([results.path])] == [
        result("x", "c1").case_id]


def test_a_failed_report_write_keeps_the_old_file_and_exits_6(tmp_path, monkeypatch,
                                                              capsys) -> None:
    results = ResultsFile(tmp_path / "r.jsonl")
    results.append(result("x", "c1"))
    out = tmp_path / "board.md"
    out.write_text("the previous board\n")
    _failing_write(monkeypatch, fail_at=1)
    assert main(["report", str(results.path), "--output", str(out)]) == ExitCode.WRITE_ERROR == 6
    err = capsys.readouterr().err
    assert f"{out}: cannot write" in err and "No space left on device" in err
    assert "pagedbench bug" not in err and "Traceback" not in err
    assert out.read_text() == "the previous board\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["board.md", "r.jsonl"]


def test_a_run_on_a_full_disk_prints_no_pass_it_did_not_record(tmp_path, monkeypatch,
                                                               capsys) -> None:
    """The end-to-end case: the third line written (the second result) hits a full disk;
    nothing counts it (no line claims a pass: progress prints an implementation's line
    only once its results are all recorded), nothing torn is left, exit 6."""
    real_append, appended = ResultsFile.append, []

    def append(self, line) -> None:
        appended.append(line)
        if len(appended) == 3:
            _failing_write(monkeypatch, fail_at=1)
        real_append(self, line)

    monkeypatch.setattr(ResultsFile, "append", append)
    code = main(["run", "--impl", "sdpa-contiguous", "--preset", "llama3.1-70b-tp8",
                 "--no-timing", "--block-size", "16", "--dtype", "float32",
                 "--results-dir", str(tmp_path)])
    monkeypatch.undo()
    out, err = capsys.readouterr()
    assert code == ExitCode.WRITE_ERROR, err
    (path,) = tmp_path.glob("*.jsonl")
    assert f"{path}: cannot write" in err and "pagedbench bug" not in err
    assert path.read_bytes().endswith(b"\n")
    lines = list(read_lines([path]))
    assert [type(line).__name__ for line in lines] == ["RunRecord", "ResultRecord"]
    assert " pass" not in out and "done:" not in out, out
    assert not list(tmp_path.glob("*.md"))


@pytest.mark.parametrize("depth", [990, 100_000])
def test_a_deeply_nested_line_is_refused_naming_file_and_line(tmp_path, capsys, depth) -> None:
    path = tmp_path / "deep.jsonl"
    good = result("x").model_dump_json()
    path.write_text(good + "\n" + '{"a": ' * depth + "1" + "}" * depth + "\n")
    with pytest.raises(ResultsFileError, match=r"deep\.jsonl:2: "):
        list(read_lines([path]))
    for command in (["report", str(path)], ["gate", "--current", str(path),
                                            "--baseline", str(path)]):
        assert main(command) == ExitCode.USAGE_ERROR
        err = capsys.readouterr().err
        assert f"{path}:2:" in err and "Traceback" not in err


def test_a_second_writer_of_a_run_is_refused_naming_the_holder(tmp_path) -> None:
    results = ResultsFile(tmp_path / "r.jsonl")
    with results.locked():
        with pytest.raises(ResultsFileError, match=f"r.jsonl: .*pid {os.getpid()}"):
            with ResultsFile(results.path).locked():
                pass  # pragma: no cover: refused before
    with ResultsFile(results.path).locked():  # released: the next writer is let in
        pass
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_the_holder_named_is_the_other_process(tmp_path) -> None:
    results = ResultsFile(tmp_path / "r.jsonl")
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys; from pagedbench.harness.results.store import ResultsFile\n"
         "with ResultsFile(sys.argv[1]).locked():\n print('held', flush=True)\n "
         "sys.stdin.read()", str(results.path)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        with pytest.raises(ResultsFileError, match=f"another pagedbench \\(pid {holder.pid}\\)"):
            with results.locked():
                pass  # pragma: no cover: refused before
    finally:
        holder.communicate("", timeout=60)
    with results.locked():  # the holder ended: its lock is gone
        pass


def test_a_concurrent_resume_is_refused_with_exit_2(tmp_path, capsys) -> None:
    from pagedbench.harness.run.runner import RunConfig, make_plan
    from pagedbench.reference import PagedCase

    case = PagedCase(kv_lens=(3,), num_q_heads=2, num_kv_heads=1, head_dim=8, block_size=4,
                     dtype="float32")
    results = ResultsFile(tmp_path / "r1.jsonl")
    results.append(RunRecord(kind="run", schema_version=SCHEMA_VERSION, run_id="r1",
                             timestamp=now(), event="started",
                             plan=make_plan({"torch-gather": GATHER}, [case]),
                             config=RunConfig(timing=False).to_dict(), exit_code=None,
                             counts=None))
    before = results.path.read_bytes()
    with ResultsFile(results.path).locked():
        code = main(["run", "--resume", "r1", "--results-dir", str(tmp_path)])
    assert code == ExitCode.USAGE_ERROR
    err = capsys.readouterr().err
    assert f"{results.path}: " in err and f"pid {os.getpid()}" in err
    assert results.path.read_bytes() == before


def test_a_symlinked_results_file_is_refused_and_its_target_untouched(tmp_path) -> None:
    target = tmp_path / "elsewhere.jsonl"
    target.write_bytes(result("x", "c1").model_dump_json().encode()[:40])  # torn
    link = tmp_path / "r.jsonl"
    link.symlink_to(target)
    before = target.read_bytes()
    with pytest.raises(OutputError, match=f"{link}: .*symbolic link"):
        ResultsFile(link).append(result("x", "c2"))
    assert link.is_symlink() and target.read_bytes() == before


def test_a_symlinked_report_is_refused_and_its_target_untouched(tmp_path, capsys) -> None:
    target = tmp_path / "precious.txt"
    target.write_text("keep me\n")
    link = tmp_path / "board.md"
    link.symlink_to(target)
    with pytest.raises(OutputError, match="symbolic link"):
        write_output(link, "board\n")
    results = ResultsFile(tmp_path / "r.jsonl")
    results.append(result("x", "c1"))
    assert main(["report", str(results.path), "--output", str(link)]) == ExitCode.WRITE_ERROR
    assert "symbolic link" in capsys.readouterr().err
    assert link.is_symlink() and target.read_text() == "keep me\n"
    write_output(tmp_path / "new.md", "x\n")
    assert (tmp_path / "new.md").read_text() == "x\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "board.md", "new.md", "precious.txt", "r.jsonl"]
