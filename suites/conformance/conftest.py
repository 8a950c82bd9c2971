"""Fixtures of the conformance suite: which implementations to check, on which device.

Implementations are found without importing them (:func:`pagedbench.adapters.entries`);
only the ones a test session selects are imported, when their first test runs.
"""

from __future__ import annotations

import functools

import pytest
import torch

from pagedbench.adapters import Adapter, entries, load

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _selected(config: pytest.Config) -> list[str]:
    names = [e.name for e in entries()]
    wanted = config.getoption("--impl")
    unknown = [n for n in wanted if n not in names]
    if unknown:
        raise pytest.UsageError(f"--impl {unknown} unknown; choose from {names}")
    return wanted or names


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "impl" in metafunc.fixturenames:
        metafunc.parametrize("impl", _selected(metafunc.config))


@functools.cache
def _load(impl: str) -> Adapter:
    target = next(e.target for e in entries() if e.name == impl)
    return load(target)


@pytest.fixture
def adapter(impl: str) -> Adapter:
    """The adapter under test; skipped (with the reason) when it cannot run here."""
    instance = _load(impl)
    availability = instance.available(DEVICE)
    if not availability.ok:
        pytest.skip(f"{impl} unavailable on {DEVICE}: {availability.reason}")
    return instance
