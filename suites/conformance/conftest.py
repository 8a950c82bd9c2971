"""Fixtures of the conformance suite: which implementations to check (``--impl``), on
which device (``--pagedbench-device``; both registered by :mod:`pagedbench.suites.plugin`),
with how many examples (:func:`search_budget`).

Implementations are found without importing them (:func:`pagedbench.adapters.entries`,
through :func:`pagedbench.suites.plugin.implementations`, which checks ``--impl``); only the ones a test session selects are imported, when their first test runs. Naming a
fault of the catalogue (``--impl fault-...``, suites/faults) puts the catalogue's
distribution on the path first (:func:`~pagedbench.harness.run.selftest.register_catalogue`),
so its entry points register it as an out-of-tree kernel is registered. Each test
records the implementation it checked as the JUnit property ``impl`` (the plugin's
``_record_impl``; ``pagedbench selftest`` reads it).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from pagedbench.adapters import Adapter
from pagedbench.suites import budget, plugin
from pagedbench.suites.implementations import available_adapter, mark_compilers_nightly

#: The device the suite checks on (``--pagedbench-device``), fixed when this is imported.
DEVICE = plugin.early_device()


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "impl" in metafunc.fixturenames:
        metafunc.parametrize("impl", plugin.implementations(metafunc.config))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """This folder's tests of a built-in that compiles each new shape are ``nightly``
    (its search's fewest examples take 2 minutes of a core); its own cases and the saved
    ones still run."""
    mark_compilers_nightly(items, Path(__file__).parent)


def pytest_configure(config: pytest.Config) -> None:
    if plugin.device(config) != DEVICE:  # imported before the plugin parsed the option
        raise pytest.UsageError(f"--pagedbench-device {plugin.device(config)}: this conftest "
                                f"was imported with {DEVICE}; load the plugin with -p "
                                "pagedbench")


@pytest.fixture
def adapter(impl: str) -> Adapter:
    """The adapter under test; skipped (with the reason) when it cannot run here."""
    return available_adapter(impl, DEVICE)


#: ``(impl, examples, seconds used, seconds of budget, runs)`` of each search this
#: session ran, for the terminal summary.
_SEARCHES = pytest.StashKey[list[tuple[str, int, float, float | None, list[int]]]]()


@pytest.fixture
def search_budget(impl: str, request: pytest.FixtureRequest, record_property):
    """``impl``'s conformance search in the profile in force, filling its seconds
    (:class:`~pagedbench.suites.budget.TimedSearch`); afterwards the examples it checked
    and the seconds it used are the JUnit properties ``search_examples`` and
    ``search_seconds`` and a line of the terminal summary."""
    search = budget.timed_search(impl, plugin.search_seconds(request.config))
    yield search
    record_property("search_examples", search.examples)
    record_property("search_seconds", round(search.elapsed_s, 2))
    request.config.stash.setdefault(_SEARCHES, []).append(
        (impl, search.examples, search.elapsed_s, search.seconds, search.runs))


def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:
    searches = config.stash.get(_SEARCHES, [])
    if not searches:
        return
    terminalreporter.section(f"pagedbench search (profile {budget.profile()})")
    for impl, examples, used, seconds, runs in searches:
        limit = "the profile's max_examples" if seconds is None else f"{seconds:g} s"
        terminalreporter.line(f"{impl}: {examples} examples in {used:.1f} s "
                              f"(budget {limit}; runs of {'+'.join(map(str, runs))})")
