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
