"""What ``make test`` leaves out (``-m "not nightly"``): every conformance test of a
built-in that compiles each shape, and none of another implementation
(docs/running.md, "The test suite in parallel")."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_make_test_leaves_out_the_conformance_tests_of_a_built_in_that_compiles_per_shape():
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:randomly",
         "-m", "nightly", "--impl", "flex-paged", "--impl", "torch-gather",
         "suites/conformance/test_edges.py", "suites/conformance/test_paged_matches_dense.py"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    nightly = {line for line in done.stdout.splitlines() if "::" in line}
    edges = "suites/conformance/test_edges.py::test_edge_probe_matches_dense"
    search = "suites/conformance/test_paged_matches_dense.py::test_paged_matches_dense"
    assert {f"{edges}[flex-paged-empty-kv]", f"{search}[flex-paged]"} <= nightly
    assert all("[flex-paged" in test for test in nightly), sorted(nightly)[:5]
