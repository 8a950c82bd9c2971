"""Fixtures of the allocator suite."""

from __future__ import annotations

import pytest

from pagedbench.suites.allocator.vllm_driver import VllmApi, import_vllm_api


@pytest.fixture(scope="module")
def vllm_api() -> VllmApi:
    """vLLM v1's allocator API, imported once per module, or a skip naming why not."""
    return import_vllm_api()
