"""Fixtures of the benchmarks suite."""

from __future__ import annotations

import pytest

from pagedbench.suites.allocator.vllm_driver import VllmApi, import_vllm_api


@pytest.fixture(scope="module")
def vllm_api() -> VllmApi:
    """vLLM v1's allocator API (the allocator suite's cross-check uses the same), or a
    skip naming why it does not import."""
    return import_vllm_api()

