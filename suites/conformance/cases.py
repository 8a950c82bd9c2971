"""The cases the conformance suites run: what the search draws for an implementation
(:func:`case_strategy`) and the pinned cases at the smallest shapes it takes
(:func:`pinned_case`). Shared by ``test_paged_matches_dense``, ``test_pinned_probes``
and ``measure``; not a test module."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from hypothesis import strategies as st

from pagedbench.adapters import Adapter
from pagedbench.harness.cases.strategies import paged_cases
from pagedbench.reference import PagedCase

from .conftest import DEVICE


def case_strategy(adapter: Adapter) -> st.SearchStrategy[PagedCase]:
    """The cases the search draws for ``adapter``: within its capabilities, from the
    edge box (degenerate rows, fresh prefills, layouts, poisons, a V head dim of its own,
    every declared option at once now and then) and one logit regime of the pinned
    probes' at a time (``harness/cases/strategies.py``); smaller where it runs interpreted."""
    interpreted = adapter.is_interpreted(DEVICE)
    return paged_cases(
        adapter.capabilities(DEVICE),
        max_batch=3 if interpreted else 4,
        max_kv_len=80 if interpreted else 300,
        max_kv_heads=1 if interpreted else 2,
        edges=True,
        logit_regimes=True,
    )


def _probe(caps, block_size: int = 16, head_dim: int = 64) -> PagedCase:
    dtype = sorted(caps.dtypes)[0]
    return PagedCase(kv_lens=(1,), num_q_heads=1, num_kv_heads=1, head_dim=head_dim,
                     block_size=block_size, dtype=dtype, name="probe")


def pinned_case(adapter, kv_lens: Callable[[int], tuple[int, ...]], num_q_heads: int,
                num_kv_heads: int, name: str, **fields) -> PagedCase:
    """A pinned case at the first block size (16, 32, 64, 128, 8, 2, 1, 48) and head dim
    (64, 128, 96, 80, 256) the adapter declares, in fp16 (else bf16, else fp32), with
    ``kv_lens(block_size)``; ``fields`` override those or set any other field (a callable
    value is called with the block size). Skips the test, with the ``unsupported``
    reason, when the adapter cannot run it."""
    caps = adapter.capabilities(DEVICE)
    block_size = fields.pop("block_size", None) or next(
        (b for b in (16, 32, 64, 128, 8, 2, 1, 48)
         if not caps.why_unsupported(_probe(caps, block_size=b), DEVICE)), None)
    head_dim = fields.pop("head_dim", None) or next(
        (d for d in (64, 128, 96, 80, 256)
         if not caps.why_unsupported(_probe(caps, head_dim=d), DEVICE)), None)
    if block_size is None or head_dim is None:
        pytest.skip(f"{adapter.name} declares none of the pinned block sizes/head dims")
    dtype = fields.pop("dtype", None) or next(
        d for d in ("float16", "bfloat16", "float32") if d in caps.dtypes)
    fields = {k: v(block_size) if callable(v) else v for k, v in fields.items()}
    case = PagedCase(kv_lens=kv_lens(block_size), num_q_heads=num_q_heads,
                     num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size,
                     dtype=dtype, name=name, **fields)
    reasons = adapter.why_unsupported(case, DEVICE)
    if reasons:
        pytest.skip(f"{adapter.name}: {'; '.join(reasons)}")
    return case
