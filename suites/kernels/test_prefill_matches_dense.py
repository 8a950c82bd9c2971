"""The paged prefill kernel agrees with float64 dense attention (harness/verdict/tolerance.py).

Causal bottom-right over varlen queries (reference/dense.py): whole prompts (``q_len ==
kv_len``), chunked prefill (``q_len < kv_len``), multi-token decode and single-token
decode mixed in one batch, NaN in every unused slot, tables from a shuffled pool. Pinned
cases cover block sizes 1/16/48/256, GQA ratios 1/4/7 (with 7, a program's rows hold whole
groups and leave the rest unused), kv_len 1, block_size and block_size + 1, windows 1,
2 and block_size +- 1, soft cap, ALiBi, sinks and fp8 E4M3/E5M2 in float32, float16 and
bfloat16 (interpreted via the float32 upcast); hypothesis draws the rest.
"""

from __future__ import annotations


import pytest
import torch
from hypothesis import given, settings

from pagedbench.harness.verdict.tolerance import assert_matches_truth
from pagedbench.reference import PagedCase, materialize
from pagedbench.suites.budget import by_profile

pytest.importorskip("triton")
from pagedbench.suites.kernels.kernel_runs import feature_cases, run_prefill  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EXAMPLES = {"ci": 5, "nightly": 200}


def _case(kv_lens, q_lens, ratio, block_size, dtype, **features) -> PagedCase:
    return PagedCase(kv_lens=kv_lens, q_lens=q_lens, num_q_heads=ratio, num_kv_heads=1,
                     head_dim=64, block_size=block_size, dtype=dtype,
                     seed=block_size + ratio, name="prefill", **features)


PINNED = [
    # whole prompt, chunk, decode; kv_len 1, block_size, block_size + 1
    _case((1, 16, 17, 40), (1, 16, 5, 1), 4, 16, "float32"),
    _case((48, 49, 30), (20, 1, 30), 7, 48, "bfloat16"),
    _case((2, 33, 9), (2, 12, 1), 1, 1, "float16"),
    _case((256, 257, 3), (9, 1, 3), 4, 256, "float16"),
    _case((40, 12), (12, 12), 4, 16, "bfloat16", sliding_window=1),
    _case((40, 12), (9, 3), 7, 16, "float32", sliding_window=2),
    _case((50, 20), (20, 1), 4, 16, "float16", sliding_window=15),
    _case((50, 20), (17, 20), 1, 16, "bfloat16", sliding_window=17),
    _case((45, 9), (10, 9), 4, 48, "float32", logits_soft_cap=4.0, sm_scale=1.0),
    _case((45, 1), (14, 1), 7, 16, "bfloat16", alibi=True),
    _case((45, 3), (8, 3), 4, 16, "float16", sinks=True),
    _case((40, 33), (16, 2), 4, 16, "float16", kv_cache_dtype="fp8_e4m3", k_scale=0.5,
          v_scale=2.0),
    _case((40, 33), (6, 1), 7, 48, "bfloat16", kv_cache_dtype="fp8_e5m2", k_scale=2.0,
          v_scale=0.25, sinks=True, alibi=True, logits_soft_cap=10.0, sliding_window=20),
]


@pytest.mark.parametrize("case", PINNED, ids=[c.case_id for c in PINNED])
def test_prefill_pinned_cases_match_dense(case: PagedCase):
    inputs = materialize(case, DEVICE)
    assert_matches_truth(run_prefill(inputs), inputs, case.case_id)


@settings(max_examples=by_profile(EXAMPLES))
@given(case=feature_cases(max_kv_len=60, prefill=True))
def test_prefill_matches_dense(case: PagedCase):
    inputs = materialize(case, DEVICE)
    assert_matches_truth(run_prefill(inputs), inputs, case.case_id)


def test_prefill_two_kv_heads_head_dim_256_matches_dense():
    case = PagedCase(kv_lens=(20, 33), q_lens=(20, 3), num_q_heads=4, num_kv_heads=2,
                     head_dim=256, block_size=16, dtype="bfloat16", name="prefill")
    inputs = materialize(case, DEVICE)
    assert_matches_truth(run_prefill(inputs), inputs, case.case_id)
