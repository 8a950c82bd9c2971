"""Fixtures of the conformance suite: which implementations to check (``--impl``), on
which device (``--pagedbench-device``; both registered by :mod:`pagedbench.suites.plugin`),
with how many examples.

Implementations are found without importing them (:func:`pagedbench.adapters.entries`,
through :func:`pagedbench.suites.plugin.implementations`, which checks ``--impl``); only the ones a test session selects are imported, when their first test runs. Naming a
fault of the catalogue (``--impl fault-...``, suites/faults) puts the catalogue's
distribution on the path first (:func:`~pagedbench.harness.run.selftest.register_catalogue`),
so its entry points register it as an out-of-tree kernel is registered. Each test
records the implementation it checked as the JUnit property ``impl`` (``pagedbench
selftest`` reads it).
"""

from __future__ import annotations

import functools

import pytest

from pagedbench.adapters import Adapter, entries, load
from pagedbench.suites import budget, plugin

#: The device the suite checks on (``--pagedbench-device``), fixed when this is imported.
DEVICE = plugin.early_device()


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "impl" in metafunc.fixturenames:
        metafunc.parametrize("impl", plugin.implementations(metafunc.config))


@functools.cache
def _load(impl: str) -> Adapter:
    target = next(e.target for e in entries() if e.name == impl)
    return load(target)


def pytest_configure(config: pytest.Config) -> None:
    if plugin.device(config) != DEVICE:  # imported before the plugin parsed the option
        raise pytest.UsageError(f"--pagedbench-device {plugin.device(config)}: this conftest "
                                f"was imported with {DEVICE}; load the plugin with -p "
                                "pagedbench")


@pytest.fixture
def adapter(impl: str) -> Adapter:
    """The adapter under test; skipped (with the reason) when it cannot run here."""
    instance = _load(impl)
    availability = instance.available(DEVICE)
    if not availability.ok:
        pytest.skip(f"{impl} unavailable on {DEVICE}: {availability.reason}")
    return instance


@pytest.fixture
def example_budget(impl: str) -> dict[str, int]:
    """``max_examples`` for ``impl``'s conformance search in the profile in force
    (``suites/budget.py``); empty for a profile without a time budget."""
    count = budget.examples_for(impl, budget.seconds_per_example())
    return {} if count is None else {"max_examples": count}


@pytest.fixture(autouse=True)
def _record_impl(request: pytest.FixtureRequest, record_property) -> None:
    if "impl" in request.fixturenames:
        record_property("impl", request.getfixturevalue("impl"))
