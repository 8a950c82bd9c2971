"""Fixtures of the adapters suite."""

from __future__ import annotations

import pytest

from pagedbench.adapters.flex_paged import FlexPaged


@pytest.fixture(scope="session")
def flex_paged() -> FlexPaged:
    """The flex-paged adapter on the CPU, or a skip with its reason."""
    flex = FlexPaged()
    availability = flex.available("cpu")
    if not availability.ok:
        pytest.skip(f"flex-paged unavailable: {availability.reason}")
    return flex
