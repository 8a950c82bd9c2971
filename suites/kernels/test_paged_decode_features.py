"""Sliding window and logits soft cap in the paged-decode kernel, against the float64 truth.

Semantics are the reference's (reference/dense.py): a window ``W`` lets the query at
position ``kv_len - 1`` see keys ``kv_len - W .. kv_len - 1``; a cap ``c`` maps scaled
logits ``s`` to ``c * tanh(s / c)``. Hypothesis draws windows at and around the tile and
block edges and caps that bite (``sm_scale`` 1 puts the logits' spread near 8). The
pinned cases must also move the truth by more than twice the allowed error when the
feature is switched off (one key more or less, for the window), or they would pass even
if the kernel ignored the feature or were off by one.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from pagedbench.harness.verdict.tolerance import Comparison, assert_matches_truth
from pagedbench.reference import PagedCase, materialize
from pagedbench.suites.feature_effect import assert_feature_matters

pytest.importorskip("triton")
from pagedbench.kernels.paged_decode import KV_TILE, paged_decode  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = ("float32", "float16", "bfloat16")
MAX_KV_LEN = 90


def _check(case: PagedCase) -> Comparison:
    inputs = materialize(case, DEVICE)
    out = paged_decode(inputs.q, inputs.kv_cache, inputs.block_tables, inputs.kv_lens,
                       inputs.scale, sliding_window=case.sliding_window,
                       logits_soft_cap=case.logits_soft_cap)
    return assert_matches_truth(out, inputs, case.case_id)


@st.composite
def window_cases(draw) -> PagedCase:
    block_size = draw(st.sampled_from((1, 8, 16, 48)))
    kv_lens = draw(st.lists(st.integers(2, MAX_KV_LEN), min_size=1, max_size=2))
    window = draw(st.one_of(st.sampled_from((1, block_size, KV_TILE - 1, KV_TILE, KV_TILE + 1)),
                            st.integers(1, MAX_KV_LEN)))
    return PagedCase(kv_lens=tuple(kv_lens), num_q_heads=4, num_kv_heads=2, head_dim=64,
                     block_size=block_size, dtype=draw(st.sampled_from(DTYPES)),
                     sliding_window=window, seed=draw(st.integers(0, 2**16)),
                     name="triton-decode")


@given(case=window_cases())
def test_decode_sliding_window_matches_dense(case: PagedCase):
    _check(case)


@st.composite
def soft_cap_cases(draw) -> PagedCase:
    return PagedCase(
        kv_lens=tuple(draw(st.lists(st.integers(1, MAX_KV_LEN), min_size=1, max_size=2))),
        num_q_heads=4, num_kv_heads=2, head_dim=64,
        block_size=draw(st.sampled_from((2, 16, 32))),
        dtype=draw(st.sampled_from(DTYPES)),
        sm_scale=1.0,
        logits_soft_cap=draw(st.sampled_from((1.0, 4.0, 10.0, 30.0))),
        seed=draw(st.integers(0, 2**16)),
        name="triton-decode",
    )


@given(case=soft_cap_cases())
def test_decode_soft_cap_matches_dense(case: PagedCase):
    _check(case)


_BASE = dict(num_q_heads=4, num_kv_heads=2, head_dim=64, sm_scale=1.0, name="triton-decode")
#: (case, the change that must move the truth): each feature off, and each window one
#: key wider (the off-by-one), in every dtype.
PINNED = [
    (PagedCase(kv_lens=(90, 40), block_size=16, dtype="bfloat16", sliding_window=1, **_BASE),
     {"sliding_window": None}),
    (PagedCase(kv_lens=(65, 35), block_size=48, dtype="float32",
               sliding_window=KV_TILE + 1, **_BASE),
     {"sliding_window": KV_TILE + 2}),
    (PagedCase(kv_lens=(50, 20), block_size=8, dtype="float16", sliding_window=8, **_BASE),
     {"sliding_window": 9}),
    (PagedCase(kv_lens=(77, 20), block_size=16, dtype="float32", logits_soft_cap=30.0,
               **_BASE),
     {"logits_soft_cap": None}),
    (PagedCase(kv_lens=(70, 9), block_size=8, dtype="bfloat16", logits_soft_cap=4.0,
               sliding_window=40, **_BASE),
     {"sliding_window": None, "logits_soft_cap": None}),
]


@pytest.mark.parametrize(("case", "change"), PINNED, ids=[c.case_id for c, _ in PINNED])
def test_decode_pinned_feature_cases_match_and_matter(case: PagedCase, change: dict):
    assert_feature_matters(case, change, _check(case).allowed_abs_err)
