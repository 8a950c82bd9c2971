"""The split-KV decode kernel agrees with float64 dense attention (harness/verdict/tolerance.py).

Every case is materialized with NaN in every unused slot and block tables drawn from a
shuffled pool (reference/inputs.py), so a read past ``kv_len`` or through a padded table
entry fails. Pinned cases cover block sizes 1/16/48/256, GQA ratios 1/4/7, kv_len 1,
block_size and block_size + 1, windows 1, 2 and block_size +- 1, soft cap, ALiBi, sinks
and fp8 E4M3/E5M2 caches with scales, in float32, float16 and bfloat16 (interpreted via
the float32 upcast), with the planned splits; three of them also with more splits than
they have tiles (empty splits in the merge). Hypothesis draws the rest, features
included. Interpreted cases are kept to a few tiles (about 10 ms per loop step).
"""

from __future__ import annotations


import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedbench.harness.verdict.tolerance import assert_matches_truth
from pagedbench.reference import PagedCase, materialize
from pagedbench.suites.budget import by_profile

pytest.importorskip("triton")
from pagedbench.suites.kernels.kernel_runs import DTYPES, feature_cases, run_split  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
#: Hypothesis examples by profile (suites/conftest.py); each is an interpreted launch.
EXAMPLES = {"ci": 6, "nightly": 200}


def _case(kv_lens, ratio, block_size, dtype, **features) -> PagedCase:
    return PagedCase(kv_lens=kv_lens, num_q_heads=ratio, num_kv_heads=1, head_dim=64,
                     block_size=block_size, dtype=dtype, seed=block_size + ratio,
                     name="split", **features)


PINNED = [
    _case((1, 16, 17), 4, 16, "float32"),
    _case((1, 48, 49, 100), 7, 48, "bfloat16"),
    _case((1, 2, 70), 1, 1, "float16"),
    _case((256, 257, 3), 4, 256, "float16"),
    _case((90, 5), 4, 16, "bfloat16", sliding_window=1),
    _case((90, 2), 7, 16, "float32", sliding_window=2),
    _case((80, 30), 4, 16, "float16", sliding_window=15),
    _case((80, 17), 1, 16, "bfloat16", sliding_window=17),
    _case((70, 9), 4, 48, "float32", logits_soft_cap=4.0, sm_scale=1.0),
    _case((70, 1), 7, 16, "bfloat16", alibi=True),
    _case((70, 1), 4, 16, "float16", sinks=True),
    _case((60, 33), 4, 16, "float16", kv_cache_dtype="fp8_e4m3", k_scale=0.5, v_scale=2.0),
    _case((60, 33), 7, 48, "bfloat16", kv_cache_dtype="fp8_e5m2", k_scale=2.0,
          v_scale=0.25, sinks=True, alibi=True, logits_soft_cap=10.0, sliding_window=40),
]


@pytest.mark.parametrize("case", PINNED, ids=[c.case_id for c in PINNED])
def test_split_decode_pinned_cases_match_dense(case: PagedCase):
    inputs = materialize(case, DEVICE)
    assert_matches_truth(run_split(inputs), inputs, case.case_id)


EMPTY_SPLITS = [PINNED[2], PINNED[7], PINNED[12]]


@pytest.mark.parametrize("case", EMPTY_SPLITS, ids=[c.case_id for c in EMPTY_SPLITS])
def test_split_decode_with_empty_splits_matches_dense(case: PagedCase):
    """5 splits for at most 2 visible tiles a sequence: 3 or more splits of every
    sequence see no key (a short context, a window) and must weigh nothing."""
    inputs = materialize(case, DEVICE)
    assert_matches_truth(run_split(inputs, num_splits=5), inputs, case.case_id)


@settings(max_examples=by_profile(EXAMPLES))
@given(case=feature_cases(), num_splits=st.sampled_from((None, 1, 3)))
def test_split_decode_matches_dense(case: PagedCase, num_splits):
    inputs = materialize(case, DEVICE)
    assert_matches_truth(run_split(inputs, num_splits=num_splits), inputs, case.case_id)


@pytest.mark.parametrize("dtype", DTYPES)
def test_split_decode_head_dim_256_and_two_kv_heads_match_dense(dtype: str):
    """head_dim 256 (its own tile and 8 warps) with 2 KV heads in one batch."""
    case = PagedCase(kv_lens=(1, 33, 70), num_q_heads=4, num_kv_heads=2, head_dim=256,
                     block_size=16, dtype=dtype, name="split")
    inputs = materialize(case, DEVICE)
    assert_matches_truth(run_split(inputs, num_splits=2), inputs, case.case_id)
