"""Fixtures of the conformance suite: which implementations to check, on which device."""

from __future__ import annotations

import pytest
import torch

from pagedbench.adapters import registry

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _selected(config: pytest.Config) -> list[str]:
    names = list(registry())
    wanted = config.getoption("--impl")
    unknown = [n for n in wanted if n not in names]
    if unknown:
        raise pytest.UsageError(f"--impl {unknown} unknown; choose from {names}")
    return wanted or names


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "impl" in metafunc.fixturenames:
        metafunc.parametrize("impl", _selected(metafunc.config))


@pytest.fixture
def adapter(impl: str):
    """The adapter under test; skipped (with the reason) when it cannot run here."""
    _, instance = registry()[impl]
    availability = instance.available(DEVICE)
    if not availability.ok:
        pytest.skip(f"{impl} unavailable on {DEVICE}: {availability.reason}")
    return instance
