"""The conformance search fills its seconds on the implementation itself: a fast out-of-tree
kernel the measured table has never seen gets far more examples than the table's guess gives
it, a slow one stays within the seconds (or the floor), and each search reports what it used
(JUnit properties, the terminal summary)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from xml.etree import ElementTree

from pagedbench.suites import budget

from ..conftest import PLUGINS, register
from ..plugins.search_speed import UnmeasuredSlow

ROOT = Path(__file__).resolve().parents[3]
#: Seconds of search each plug-in gets here (``--pagedbench-search-seconds``).
SECONDS = 8.0
FAST, SLOW = "unmeasured-fast", "unmeasured-slow"
#: Examples the table's guess alone gives an unmeasured plug-in in ``ci``: 30 s at 2 s each.
GUESSED_CI_EXAMPLES = 15


def _searches(tmp_path: Path) -> tuple[dict[str, dict[str, float]], str]:
    """Run the conformance search on both plug-ins; each one's JUnit properties and the
    session's output."""
    env = register(tmp_path / "site", {FAST: f"{PLUGINS}.search_speed:UnmeasuredFast",
                                       SLOW: f"{PLUGINS}.search_speed:UnmeasuredSlow"})
    junit = tmp_path / "search.xml"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest",
         "suites/conformance/test_paged_matches_dense.py::test_paged_matches_dense",
         "--impl", FAST, "--impl", SLOW, "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
         "--hypothesis-profile", "ci", "--pagedbench-search-seconds", str(SECONDS),
         f"--junitxml={junit}"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    found = {}
    for case in ElementTree.parse(junit).getroot().iter("testcase"):
        props = {p.get("name"): p.get("value") for p in case.iter("property")}
        found[props["impl"]] = {"examples": int(props["search_examples"]),
                                "seconds": float(props["search_seconds"])}
    return found, proc.stdout


def test_a_fast_plugin_fills_the_seconds_and_a_slow_one_stays_within_them(tmp_path):
    found, out = _searches(tmp_path)
    low, high = budget.fewest_examples("ci", SECONDS), budget.EXAMPLES["ci"][1]
    fast, slow = found[FAST], found[SLOW]
    # The fast one: more examples in 8 s than the table's guess gave it in 30.
    assert fast["examples"] > GUESSED_CI_EXAMPLES, found
    # The slow one: at least the floor, no more than the seconds hold at its sleep alone.
    assert low <= slow["examples"] <= SECONDS / UnmeasuredSlow.SLEEP_S, found
    assert fast["examples"] > slow["examples"], found
    for figures in found.values():
        # Each filled its seconds (or the floor) and stopped within two examples of them,
        # or a quarter past or a twentieth short of them where the host's speed moved
        # between runs (each run is sized by the speed of those before it; measured under
        # pytest -n 2: 9.51 s of 8, and 7.83 s of 8 with two examples of 0.058 s left).
        per_example = figures["seconds"] / figures["examples"]
        limit = max(SECONDS, low * per_example)
        assert figures["seconds"] <= 1.25 * limit + 2 * per_example, found
        assert figures["examples"] == high or figures["seconds"] >= min(
            limit - 2 * per_example, 0.95 * limit), found
    for impl, figures in found.items():
        assert f"{impl}: {figures['examples']} examples in " in out, out
