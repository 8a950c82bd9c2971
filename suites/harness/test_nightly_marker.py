"""What ``make test`` leaves out (``-m "not nightly"``) and what it keeps: the probes of a
built-in that compiles each shape are ``nightly``, its search is not, and the probes of
every other implementation stay (docs/running.md, "The test suite in parallel")."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _collected(*options: str) -> set[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:randomly",
         "--impl", "flex-paged", "--impl", "torch-gather",
         "suites/conformance/test_edges.py", "suites/conformance/test_paged_matches_dense.py",
         *options], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return {line for line in done.stdout.splitlines() if "::" in line}


def test_make_test_leaves_out_the_probes_of_a_built_in_that_compiles_per_shape():
    kept = _collected("-m", "not nightly")
    left_out = _collected() - kept
    assert left_out and all("[flex-paged" in test for test in left_out), sorted(left_out)[:5]
    edges = "suites/conformance/test_edges.py::test_edge_probe_matches_dense"
    assert f"{edges}[flex-paged-empty-kv]" in left_out
    assert f"{edges}[torch-gather-empty-kv]" in kept
    search = "suites/conformance/test_paged_matches_dense.py::test_paged_matches_dense"
    assert {f"{search}[flex-paged]", f"{search}[torch-gather]"} <= kept
    assert not any("torch-gather" in test for test in left_out)
