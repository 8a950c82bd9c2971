"""The cases the conformance suites run: what the search draws for an implementation
(:func:`case_strategy`) and the pinned cases at the smallest shapes it takes
(:func:`pinned_case`). Shared by ``test_paged_matches_dense``, ``test_pinned_probes``
and ``measure``; not a test module."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from hypothesis import strategies as st

from pagedbench.adapters import Adapter
from pagedbench.adapters.base import allows
from pagedbench.harness.cases.strategies import paged_cases
from pagedbench.reference import PagedCase, PagedInputError

from .conftest import DEVICE


#: The most sequences of the search's batches like production
#: (``harness/cases/strategies.py``, ``max_large_batch``): past 256, the size of a
#: per-sequence table a kernel might keep; under Triton's interpreter, where every
#: sequence is a program run in Python (257 of them: 5 to 15 s a case on a loaded 2-core
#: host, against 1 to 2.4 s for 17), one past 16 and a few more.
LARGE_BATCH = 257
INTERPRETED_LARGE_BATCH = 24


def case_strategy(adapter: Adapter) -> st.SearchStrategy[PagedCase]:
    """The cases the search draws for ``adapter``: within its capabilities, from the
    edge box (degenerate rows, fresh prefills, layouts, poisons, a V head dim of its own,
    every declared option at once now and then), one logit regime of the pinned
    probes' at a time, and now and then a ragged batch of up to :data:`LARGE_BATCH`
    sequences (``harness/cases/strategies.py``); smaller where it runs interpreted."""
    interpreted = adapter.is_interpreted(DEVICE)
    return paged_cases(
        adapter.capabilities(DEVICE),
        max_batch=3 if interpreted else 4,
        max_kv_len=80 if interpreted else 300,
        max_kv_heads=1 if interpreted else 2,
        edges=True,
        logit_regimes=True,
        max_large_batch=INTERPRETED_LARGE_BATCH if interpreted else LARGE_BATCH,
    )


def _v_fields(caps, head_dim: int) -> dict:
    """The V head dim and latent cache an implementation needs with ``head_dim``: none,
    or (MLA) the first V head dim it declares below ``head_dim``, latent where needed."""
    if caps.v_head_dims is None or allows(caps.v_head_dims, head_dim):
        return {}
    v = next((v for v in sorted(a for a in caps.v_head_dims if isinstance(a, int))
              if v < head_dim), None)
    return {} if v is None else {"head_dim_v": v, "latent_cache": caps.needs_latent_cache}


def _probe(caps, block_size: int = 16, head_dim: int = 64) -> PagedCase:
    dtype = sorted(caps.dtypes)[0]
    return PagedCase(kv_lens=(1,), num_q_heads=1, num_kv_heads=1, head_dim=head_dim,
                     block_size=block_size, dtype=dtype, name="probe",
                     **_v_fields(caps, head_dim))


def pinned_case(adapter, kv_lens: Callable[[int], tuple[int, ...]], num_q_heads: int,
                num_kv_heads: int, name: str, **fields) -> PagedCase:
    """A pinned case at the first block size (16, 32, 64, 128, 8, 2, 1, 48) and head dim
    (64, 128, 96, 80, 256, then the ones it lists, e.g. MLA's 576 with its V head dim and
    latent cache, over one KV head) the adapter declares, in fp16 (else bf16, else fp32), with
    ``kv_lens(block_size)``; ``fields`` override those or set any other field (a callable
    value is called with the block size). Skips the test, with the ``unsupported``
    reason, when the adapter cannot run it or the probe's fields cannot be a case of the
    shape it takes."""
    caps = adapter.capabilities(DEVICE)
    listed = sorted(a for a in caps.head_dims or () if isinstance(a, int))

    def takes(block_size: int, head_dim: int) -> bool:
        return not caps.why_unsupported(_probe(caps, block_size, head_dim), DEVICE)

    block_size = fields.pop("block_size", None) or next(
        (b for b in (16, 32, 64, 128, 8, 2, 1, 48) if any(takes(b, d) for d in (64, *listed))),
        None)
    head_dim = fields.pop("head_dim", None) or next(
        (d for d in (64, 128, 96, 80, 256, *listed) if takes(block_size or 16, d)), None)
    if block_size is None or head_dim is None:
        pytest.skip(f"{adapter.name} declares none of the pinned block sizes/head dims")
    dtype = fields.pop("dtype", None) or next(
        d for d in ("float16", "bfloat16", "float32") if d in caps.dtypes)
    fields = {k: v(block_size) if callable(v) else v for k, v in fields.items()}
    if caps.needs_latent_cache:  # MLA: the probe's query heads over one latent KV head
        num_kv_heads = 1
    try:
        case = PagedCase(kv_lens=kv_lens(block_size), num_q_heads=num_q_heads,
                         num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size,
                         dtype=dtype, name=name, **(_v_fields(caps, head_dim) | fields))
    except PagedInputError as exc:  # e.g. a V magnitude of its own in a latent cache
        pytest.skip(f"{adapter.name}: the probe does not fit what it takes: {exc}")
    reasons = adapter.why_unsupported(case, DEVICE)
    if reasons:
        pytest.skip(f"{adapter.name}: {'; '.join(reasons)}")
    return case
