"""The current folder is never on a worker's module path: ``python -m`` puts it first, so a
``selectors.py`` there (a module the worker imports) would run inside every worker. Workers
start with ``-P`` (Python 3.11+)."""

from __future__ import annotations


import pytest

from pagedbench.adapters import entries
from pagedbench.harness.run import list_job

PLANTED = """\
from pathlib import Path
Path(__file__).with_name("planted-module-ran").touch()
raise SystemExit("a planted module ran")
"""


@pytest.mark.parametrize("module", ["selectors", "json"])
def test_a_module_in_the_current_folder_never_runs_in_a_worker(tmp_path, monkeypatch,
                                                               module) -> None:
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    (cwd / f"{module}.py").write_text(PLANTED)
    monkeypatch.chdir(cwd)
    found = [e for e in entries() if e.name == "torch-gather"]
    (row,) = list_job.list_adapters(found, "cpu", tmp_path / "cache", timeout_s=60)
    assert not (cwd / "planted-module-ran").exists()
    assert (row.name, row.status) == ("torch-gather", "available"), row.reason
