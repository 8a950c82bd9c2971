"""A plug-in that exits, segfaults or hangs at import, or returns metadata that is not JSON,
costs only itself: ``pagedbench run`` finishes with every other implementation's results and
a non-zero exit, and ``pagedbench list`` lists everyone: one adapter's failure or metadata
never ends the whole run nor makes it look green."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pagedbench.harness.results.record import ResultRecord, RunRecord
from pagedbench.harness.results.store import read_lines
from pagedbench.harness.verdict.status import ExitCode

CLI = [sys.executable, "-m", "pagedbench.harness.cli"]
ONE_PRESET = ["--preset", "llama3.1-70b-tp8", "--block-size", "16", "--no-timing"]
CASE_TIMEOUT_S = 3
#: Expected (status, words of the reason) per implementation, for both cases.
EXPECTED = {
    "exits-at-import": ("error", "SystemExit"),
    "os-exits-at-import": ("crash", "exited with code 0 during import"),
    "segfaults-at-import": ("crash", "SIGSEGV during import"),
    "hangs-at-import": ("timeout", f"import took longer than {CASE_TIMEOUT_S} s"),
    "unpicklable-describe": ("error", "describe returned data that is not JSON"),
    "object-version": ("error", "version"),
    "missing-module": ("error", "ModuleNotFoundError: No module named 'not_installed_mod'"),
    "numpy-metadata": ("pass", ""),
    "int-version": ("pass", ""),
    "torch-gather": ("pass", ""),
}


def test_a_run_with_crashing_hanging_exiting_and_correct_plugins(tmp_path, plugin_env) -> None:
    results = tmp_path / "results"
    impls = [arg for name in EXPECTED for arg in ("--impl", name)]
    proc = subprocess.run(
        [*CLI, "run", *ONE_PRESET, *impls, "--case-timeout", str(CASE_TIMEOUT_S),
         "--results-dir", str(results), "--cache-dir", str(tmp_path / "build")],
        env=plugin_env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == ExitCode.CONFORMANCE_FAILURE, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    (jsonl,) = results.glob("*.jsonl")
    lines = list(read_lines([jsonl]))
    records = [line for line in lines if isinstance(line, ResultRecord)]
    assert len(records) == 2 * len(EXPECTED)
    for record in records:
        status, words = EXPECTED[record.impl]
        assert (str(record.status), words in record.reason) == (status, True), record.reason
    numpy = next(r for r in records if r.impl == "numpy-metadata")
    assert numpy.impl_details == {"threads": 2, "ratio": 0.5, "fast": True,
                                  "isas": ["avx2", "avx512"], "shape": [1, 2], "splits": 4,
                                  "kernels": ["a", "b"]}
    assert {r.impl_version for r in records if r.impl == "int-version"} == {"3"}
    events = [line.event for line in lines if isinstance(line, RunRecord)]
    assert events == ["started", "finished"]
    assert jsonl.with_suffix(".md").exists()


@pytest.mark.nightly  # list of plug-ins; one at a time: cli/test_cli_read_only_commands
def test_list_shows_every_plugin_by_its_entry_point_name(tmp_path, plugin_env) -> None:
    listed = subprocess.run([*CLI, "list", "--json", "--timeout", "3"], env=plugin_env,
                            capture_output=True, text=True, timeout=300)
    assert listed.returncode == 0, listed.stderr
    rows = {row["name"]: row for row in json.loads(listed.stdout)}
    assert {name: rows[name]["status"] for name in EXPECTED} == {
        "exits-at-import": "error", "os-exits-at-import": "crash",
        "segfaults-at-import": "crash", "hangs-at-import": "timeout",
        "unpicklable-describe": "available", "object-version": "error", "missing-module": "error",
        "numpy-metadata": "available", "int-version": "available", "torch-gather": "available",
    }
    assert rows["int-version"]["version"] == "3"
    assert rows["numpy-metadata"]["details"]["isas"] == ["avx2", "avx512"]
    assert not any(rows[name]["available"] for name in
                   ("exits-at-import", "segfaults-at-import", "hangs-at-import"))


def test_builtin_names_are_their_classes_names() -> None:
    """``BUILTIN`` names each in-tree implementation without importing it; the name is the
    one its class declares (imported here, in-process, as the pytest suites do)."""
    from pagedbench.adapters import BUILTIN, entries, load

    assert {name: load(target).name for name, target in BUILTIN.items()} == {
        name: name for name in BUILTIN}
    assert [e.name for e in entries()][: len(BUILTIN)] == list(BUILTIN)
