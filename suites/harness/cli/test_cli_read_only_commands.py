"""Read-only commands write nothing: ``schema``, ``report`` (to stdout) and ``gate`` leave
the current folder as it was, so they work in a read-only checkout. Tests run as root, where
a mode of 0555 stops no write: the folder is checked for anything created instead."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pagedbench.harness.results.store import ResultsFile
from pagedbench.harness.run.environment import CACHE_FOLDERS

from ..conftest import result


@pytest.fixture
def read_only_folder(tmp_path: Path):
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o555)
    yield folder
    folder.chmod(0o755)


def test_read_only_commands_create_nothing_in_the_current_folder(tmp_path,
                                                                 read_only_folder) -> None:
    results = ResultsFile(tmp_path / "r.jsonl")
    results.append(result("x", "c1", "pass", 2.0))
    env = {k: v for k, v in os.environ.items() if k not in CACHE_FOLDERS}
    script = ("import sys; from pagedbench.harness.cli import main; "
              "codes = [main(a) for a in (['schema'], ['report', sys.argv[1]], "
              "['gate', '--current', sys.argv[1], '--baseline', sys.argv[1], "
              "'--allow-unjudged'])]; print(codes)")
    done = subprocess.run([sys.executable, "-P", "-c", script, str(results.path)],
                          cwd=read_only_folder, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[0, 0, 0]", done.stderr
    assert list(read_only_folder.iterdir()) == []
