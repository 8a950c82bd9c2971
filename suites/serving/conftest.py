"""Fixtures of the serving-loop suite: the implementations to drive (``--impl``, as the
conformance suite takes them), on the device of ``--pagedbench-device``, with the loop's
budget of the hypothesis profile in force (:data:`EXAMPLES`, :data:`STEPS`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pagedbench.adapters import Adapter
from pagedbench.suites import budget, plugin
from pagedbench.suites.implementations import available_adapter, mark_compilers_nightly

#: The device the suite drives (``--pagedbench-device``), fixed when this is imported.
DEVICE = plugin.early_device()
#: State-machine loops per implementation and loop configuration, by profile, after the
#: scheduled loop each configuration gets; an interpreted kernel gets the first of the pair
#: (in ``ci`` the scheduled loop alone: a step costs it about a second). ``catch``, the
#: self-test's profile, runs the scheduled loop alone: it meets every fault of the
#: catalogue that a loop can, and the state machine's shrinking is not wanted there.
EXAMPLES = {"ci": (0, 8), "catch": (0, 0), "nightly": (30, 100)}
#: Forward steps of the scheduled loop and most events of a state-machine loop, by profile:
#: an interpreted kernel gets the first of the pair.
STEPS = {"ci": (20, 40), "nightly": (120, 120)}


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "impl" in metafunc.fixturenames:
        metafunc.parametrize("impl", plugin.implementations(metafunc.config))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    mark_compilers_nightly(items, Path(__file__).parent)


@pytest.fixture
def adapter(impl: str) -> Adapter:
    """The adapter under test; skipped (with the reason) when it cannot run here."""
    return available_adapter(impl, DEVICE)


def loop_budget(adapter: Adapter) -> tuple[int, int]:
    """``(loops, events per loop)`` for ``adapter`` in the profile in force."""
    name = budget.profile()
    which = 0 if adapter.is_interpreted(DEVICE) else 1
    return (EXAMPLES.get(name, EXAMPLES["ci"])[which], STEPS.get(name, STEPS["ci"])[which])
