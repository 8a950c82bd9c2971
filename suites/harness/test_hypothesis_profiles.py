"""``--hypothesis-profile`` on the pytest command line takes effect, example counts
included, and wins over ``HYPOTHESIS_PROFILE`` (issue 7, section 3); the conformance
search's budget follows the profile and the measured speed (``suites/budget.py``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from pagedbench.suites import budget

#: A session with the suites' profiles (suites/conftest.py loaded as a plug-in): one
#: property whose example count follows the profile, and a line reporting what ran.
PROBE = '''
from hypothesis import given, settings, strategies as st
from pagedbench.suites import budget

CALLS = []

@settings(max_examples=budget.by_profile({"ci": 3, "nightly": 7}), database=None)
@given(st.integers())
def test_count(x):
    CALLS.append(x)

def test_report():
    print(f"PROFILE={budget.profile()} CALLS={len(CALLS)} "
          f"BUDGET={budget.examples_for('x', {'x': 0.5})}")
'''


def _session(tmp_path, *options: str, variable: str | None = None) -> str:
    (tmp_path / "test_probe.py").write_text(PROBE)
    env = {k: v for k, v in os.environ.items() if k != "HYPOTHESIS_PROFILE"}
    if variable:
        env["HYPOTHESIS_PROFILE"] = variable
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "test_probe.py", "-q", "-s", "-p", "no:cacheprovider",
         "-p", "pagedbench.suites.conftest", *options],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return next(line for line in proc.stdout.splitlines() if "PROFILE=" in line)


@pytest.mark.parametrize("options, variable, expected", [
    (("--hypothesis-profile", "nightly"), None, "PROFILE=nightly CALLS=7 BUDGET=1200"),
    (("--hypothesis-profile", "ci"), "nightly", "PROFILE=ci CALLS=3 BUDGET=60"),
], ids=["option", "option-over-variable"])
def test_profile_option_sets_example_counts(tmp_path, options, variable, expected):
    assert expected in _session(tmp_path, *options, variable=variable)


def test_examples_for_scales_with_measured_speed(monkeypatch):
    """ci gives 30 s of search: 0.05 s per example -> 500 (the cap), 0.1 s -> 300, an
    interpreted kernel at 1.5 s -> 20, anything unmeasured (2 s) -> 15."""
    monkeypatch.setattr(budget, "profile", lambda: "ci")
    seconds = {"fast": 0.05, "mid": 0.1, "interpreted": 1.5}
    assert [budget.examples_for(n, seconds) for n in ("fast", "mid", "interpreted", "new")] == [
        500, 300, 20, 15]
    monkeypatch.setattr(budget, "profile", lambda: "nightly")
    assert budget.examples_for("mid", seconds) == 6000
    monkeypatch.setattr(budget, "profile", lambda: "someone-elses")
    assert budget.examples_for("mid", seconds) is None


def test_every_implementation_is_in_the_table():
    """The table of seconds per example names every registered implementation, measured
    or unavailable where it was measured, so none falls back to the unmeasured floor
    unnoticed (re-measure with ``python -m pagedbench.suites.conformance.measure``)."""
    from pagedbench.adapters import entries

    table = json.loads(budget.TABLE.read_text())
    listed = set(table["seconds"]) | set(table["unavailable"])
    missing = [e.name for e in entries() if e.name not in listed]
    assert not missing, f"not in {budget.TABLE.name}: {missing}"
    assert set(budget.seconds_per_example()) == set(table["seconds"])
