"""The ``pagedbench`` console script beyond :func:`main`: its warnings are its own lines on
stderr, each once, without Python's category and source line."""

from __future__ import annotations

import subprocess
import sys

from ..conftest import result


def test_a_torn_line_is_one_warning_line_of_the_command(tmp_path) -> None:
    path = tmp_path / "run.jsonl"
    path.write_text(result("a").model_dump_json() + "\n" + '{"kind": "res')  # killed mid-write
    done = subprocess.run([sys.executable, "-m", "pagedbench.harness.cli", "report", str(path),
                           "--format", "csv"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stderr.splitlines() == [
        f"pagedbench report: warning: {path}:2: skipping a torn last line (a run killed "
        "mid-write)"], done.stderr


def test_a_warning_that_cannot_be_written_is_dropped_and_the_command_goes_on(tmp_path) -> None:
    """As Python's own warnings: stderr on a full device (``/dev/full``) or closed, the
    report is still written whole, and nothing of the warning reaches stdout."""
    path = tmp_path / "run.jsonl"
    path.write_text(result("a").model_dump_json() + "\n" + '{"kind": "res')
    command = f"{sys.executable} -m pagedbench.harness.cli report {path} --format csv"
    for redirect in ("2>/dev/full", "2>&-"):
        done = subprocess.run(["bash", "-c", f"{command} {redirect}"],
                              stdout=subprocess.PIPE, text=True, timeout=120)
        assert done.returncode == 0, redirect
        header, row = [line for line in done.stdout.splitlines() if line]
        assert header.startswith("case_id,dtype,") and ",a,cpu," in row, (redirect, done.stdout)
