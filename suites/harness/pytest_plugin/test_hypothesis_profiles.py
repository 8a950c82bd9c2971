"""``--hypothesis-profile`` on the pytest command line takes effect, example counts
included, and wins over ``HYPOTHESIS_PROFILE``; the conformance search fills the profile's
seconds at the speed measured on the implementation itself (``suites/budget.py``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from hypothesis import settings
from hypothesis import strategies as st

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
          f"SECONDS={budget.search_seconds()}")
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
    (("--hypothesis-profile", "nightly"), None, "PROFILE=nightly CALLS=7 SECONDS=600.0"),
    (("--hypothesis-profile", "ci"), "nightly", "PROFILE=ci CALLS=3 SECONDS=30.0"),
], ids=["option", "option-over-variable"])
def test_profile_option_sets_example_counts(tmp_path, options, variable, expected):
    assert expected in _session(tmp_path, *options, variable=variable)


class FakeClock:
    """A clock that moves only when told: each example "takes" ``per_example_s``."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _search(per_example_s: float, guess_s: float = budget.UNMEASURED_SECONDS,
            strategy=st.integers(), seconds: float = 30.0):
    """A ``ci``-sized search (30 s, 8..500 examples) whose every example takes
    ``per_example_s`` on a fake clock; returns it and the values each run drew."""
    clock = FakeClock()
    search = budget.TimedSearch(seconds=seconds, guess_s=guess_s, bounds=(8, 500), clock=clock)
    drawn: list[list] = []

    def body(data) -> None:
        if len(drawn) < len(search.runs):
            drawn.append([])
        drawn[-1].append(data.draw(strategy))
        search.counted()
        clock.now += per_example_s

    search.run(body)
    return search, drawn


@pytest.mark.parametrize("per_example_s, examples, runs", [
    (1 / 64, 500, [8, 492]),  # a fast plug-in the table lacks: the cap, not 15
    # refills for 3/4 of what is left (of 29 s: 21.75 s, then 5.4375 s, ...), at least
    # one example where one fits, the sixth run for all of it: 30 s filled
    (0.125, 240, [8, 174, 43, 11, 3, 1]),
    (1.0, 30, [8, 16, 4, 1, 1]),
    (5.0, 8, [8]),  # slower than the budget: the floor only
], ids=["fast", "mid", "slow", "slower-than-the-budget"])
def test_the_search_fills_its_seconds_at_the_measured_speed(per_example_s, examples, runs):
    search, _ = _search(per_example_s)
    assert (search.examples, search.runs) == (examples, runs)
    assert search.elapsed_s == pytest.approx(max(8 * per_example_s, min(
        30.0, 500 * per_example_s)), abs=per_example_s)


def test_the_table_sizes_only_the_first_run():
    """A guess of 1 s per example sizes the first run for half the 30 s (15 examples);
    the implementation runs at 0.25 s, so the refills fill the 26.25 s left (78 for 3/4
    of it, 20 for 3/4 of the 6.75 s then left, ...). A guess of 0.125 s (120 examples) is
    held to twice the floor: 16."""
    search, _ = _search(0.25, guess_s=1.0)
    assert search.runs == [15, 78, 20, 5, 1, 1] and search.examples == 120
    search, _ = _search(0.25, guess_s=0.125)
    assert search.runs == [16, 78, 19, 5, 1, 1] and search.examples == 120


def test_a_slow_start_does_not_make_every_refill_short():
    """The first 8 examples take 0.5 s each (an import, a compilation), the rest 0.1 s.
    Sized at the last run's speed, the second run is short (39 at 0.5 s for 3/4 of the
    26 s left) and the next ones fill the 22.1 s left (165, 41, 11, 3: within one example
    of it by rounding). Sized at the average so far, as once, the search stopped at
    :data:`~pagedbench.suites.budget.MAX_RUNS` 1.1 s short of its 30."""
    clock = FakeClock()
    search = budget.TimedSearch(seconds=30.0, guess_s=budget.UNMEASURED_SECONDS,
                                bounds=(8, 500), clock=clock)

    def body(data) -> None:
        data.draw(st.integers())
        search.counted()
        clock.now += 0.5 if search.examples <= 8 else 0.1

    search.run(body)
    assert search.runs == [8, 39, 165, 41, 11, 3] and search.examples == 267
    assert search.elapsed_s == pytest.approx(30.0, abs=0.1)


def test_examples_of_uneven_cost_end_the_search_at_its_seconds():
    """The first 24 examples take 0.1 s, the rest 2 s (dear examples, batches of hundreds
    of sequences, come later): the second run, sized at the first's 0.1 s for 3/4 of the
    28.4 s left (floored), holds 212 examples, 408 s of them; the search stops at the first example
    after its 30 s instead. Its fewest 8 examples are checked even past the seconds."""
    clock = FakeClock()
    search = budget.TimedSearch(seconds=30.0, guess_s=0.1, bounds=(8, 500), clock=clock)

    def body(data) -> None:
        data.draw(st.integers())
        search.counted()
        clock.now += 0.1 if search.examples <= 24 else 2.0

    search.run(body)
    assert search.runs == [16, 212], search.runs
    assert 30.0 <= search.elapsed_s <= 32.0 and search.examples == 24 + 14
    # the floor comes first: 8 examples of 4 s each are checked although they take 32 s
    slow = budget.TimedSearch(seconds=30.0, guess_s=4.0, bounds=(8, 500), clock=FakeClock())

    def dear(data) -> None:
        data.draw(st.integers())
        slow.counted()
        slow.clock.now += 4.0

    slow.run(dear)
    assert slow.examples == 8 and slow.elapsed_s == pytest.approx(32.0)


def test_a_failure_found_near_the_seconds_is_shrunk_and_reported():
    """Examples of 4 s, the seventh and later failing: the failure comes at 24 s of 30,
    and hypothesis's shrinking runs past the seconds; the search raises it, never ends
    quietly at its seconds."""
    clock = FakeClock()
    search = budget.TimedSearch(seconds=30.0, guess_s=4.0, bounds=(8, 500), clock=clock)

    def body(data) -> None:
        data.draw(st.integers())
        search.counted()
        clock.now += 4.0
        assert search.examples < 7, "the seventh example fails"

    with pytest.raises(AssertionError, match="the seventh example fails"):
        search.run(body)
    assert clock.now > 30.0


def test_each_refill_draws_new_examples_and_a_small_space_ends_the_search():
    """Under the derandomized ``ci`` profile each run has its own seed (the refill is not
    the first run again); a strategy of two values ends the search at its first run."""
    _, drawn = _search(0.125)
    assert set(drawn[1]) - set(drawn[0])
    search, drawn = _search(0.125, strategy=st.booleans())
    assert search.runs == [8] and search.examples == 2 and sorted(drawn[0]) == [False, True]


def test_a_profile_without_seconds_gets_one_run_of_its_own_max_examples(monkeypatch):
    monkeypatch.setattr(budget, "profile", lambda: "someone-elses")
    search = budget.timed_search("x")
    assert search.seconds is None and search.bounds == (1, settings().max_examples)
    assert budget.timed_search("x", seconds_override=4.0).seconds == 4.0
    monkeypatch.setattr(budget, "profile", lambda: "nightly")
    assert budget.timed_search("mid", table={"mid": 2.0}).first_count() == 150
    assert budget.timed_search("fast", table={"fast": 0.1}).first_count() == 200


def test_fewer_seconds_than_the_profiles_get_proportionally_fewer_fewest_examples(monkeypatch):
    """``ci``'s floor of 8 examples is for its 30 s: 5 s (``make test``) get 2, more than
    30 s keep 8; the most stays the profile's."""
    monkeypatch.setattr(budget, "profile", lambda: "ci")
    low, high = budget.EXAMPLES["ci"]
    assert budget.SECONDS["ci"] == 30.0 and low == 8
    for seconds, fewest in ((5.0, 2), (8.0, 3), (0.1, 1), (30.0, 8), (None, 8), (600.0, 8)):
        assert budget.timed_search("x", seconds).bounds == (fewest, high), seconds


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
