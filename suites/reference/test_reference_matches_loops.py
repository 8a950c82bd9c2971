"""The float64 truth equals attention written out query by query with Python floats
(math.exp, explicit sums), independent of torch's einsum/softmax, from the definitions:

- GQA ``h // (num_q_heads // num_kv_heads)``, bottom-right causal, sliding window, soft
  cap ``c * tanh(s / c)`` of the scaled logit;
- ALiBi (Press et al., ICLR 2022): logit ``s(i, j) - slope[h] * (i - j)``, added after the
  soft cap (vLLM's CPU test reference);
- sinks (gpt-oss, vLLM's ``s_aux``): ``exp(sink[h])`` joins the softmax denominator only;
- fp8 KV: attention on ``stored * k_scale`` and ``stored * v_scale``;
- a row that sees no key (kv_len 0, or a position below 0 when q_len > kv_len) is 0;
  a V head dim of its own (MLA) shapes the output.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings

from pagedbench.harness.cases.strategies import paged_cases
from pagedbench.reference import PagedCase, materialize, naive_attention, reference_attention


def loop_attention(inputs) -> list:
    """Per query row and head: visible keys (bottom-right causal, window), scaled and
    capped logits plus the ALiBi bias, a max-shifted softmax whose denominator also holds
    the sink, and the weighted sum of dequantized values."""
    case = inputs.case
    bs, ratio = case.block_size, case.gqa_ratio
    cache = inputs.kv_cache.double().tolist()  # [blocks][2][bs][hkv][d], stored values
    q_all = inputs.q.double().tolist()
    slopes = None if inputs.alibi_slopes is None else inputs.alibi_slopes.double().tolist()
    sinks = None if inputs.sinks is None else inputs.sinks.double().tolist()
    tables = inputs.block_tables.tolist()
    cu = inputs.cu_seqlens_q.tolist()
    out = []
    for i, kv_len in enumerate(case.kv_lens):
        q_len = cu[i + 1] - cu[i]
        for j in range(q_len):
            pos = kv_len - q_len + j
            row = []
            for h in range(case.num_q_heads):
                g = h // ratio
                q = q_all[cu[i] + j][h]
                keys = [t for t in range(kv_len) if t <= pos
                        and (case.sliding_window is None or t > pos - case.sliding_window)]
                scores = []
                for t in keys:
                    k = [x * case.k_scale
                         for x in cache[tables[i][t // bs]][0][t % bs][g][: case.head_dim]]
                    s = case.scale * sum(a * b for a, b in zip(q, k))
                    if case.logits_soft_cap is not None:
                        s = case.logits_soft_cap * math.tanh(s / case.logits_soft_cap)
                    if slopes is not None:
                        s -= slopes[h] * (pos - t)
                    scores.append(s)
                acc = [0.0] * case.v_head_dim
                if not keys:  # no key to see: the output stays 0
                    row.append(acc)
                    continue
                top = max(scores + ([sinks[h]] if sinks else []))
                weights = [math.exp(s - top) for s in scores]
                total = sum(weights) + (math.exp(sinks[h] - top) if sinks else 0.0)
                for w, t in zip(weights, keys):
                    v = [x * case.v_scale
                         for x in cache[tables[i][t // bs]][1][t % bs][g][: case.v_head_dim]]
                    acc = [a + w / total * x for a, x in zip(acc, v)]
                row.append(acc)
            out.append(row)
    return out


CASES = [
    PagedCase(kv_lens=(1, 4, 5, 11), num_q_heads=4, num_kv_heads=2, head_dim=64,
              block_size=4, dtype="float32", name="decode"),
    PagedCase(kv_lens=(6, 9), q_lens=(3, 9), num_q_heads=3, num_kv_heads=1, head_dim=64,
              block_size=2, dtype="bfloat16", name="prefill"),
    PagedCase(kv_lens=(13,), q_lens=(4,), num_q_heads=2, num_kv_heads=2, head_dim=64,
              block_size=8, dtype="float16", sliding_window=3, logits_soft_cap=2.0,
              name="window-cap"),
    PagedCase(kv_lens=(1, 5, 9), num_q_heads=4, num_kv_heads=2, head_dim=16, block_size=4,
              dtype="float32", alibi=True, name="alibi-decode"),
    PagedCase(kv_lens=(7, 12), q_lens=(7, 3), num_q_heads=6, num_kv_heads=2, head_dim=16,
              block_size=4, dtype="bfloat16", alibi=True, sliding_window=5,
              logits_soft_cap=3.0, name="alibi-6heads-window-cap"),
    PagedCase(kv_lens=(1, 6, 13), q_lens=(1, 2, 4), num_q_heads=3, num_kv_heads=1,
              head_dim=16, block_size=4, dtype="float16", sinks=True, name="sinks"),
    PagedCase(kv_lens=(3, 10), q_lens=(1, 10), num_q_heads=4, num_kv_heads=4, head_dim=16,
              block_size=8, dtype="float32", sinks=True, sliding_window=2,
              name="sinks-window"),
    PagedCase(kv_lens=(5, 11), q_lens=(2, 3), num_q_heads=4, num_kv_heads=2, head_dim=16,
              block_size=4, dtype="bfloat16", kv_cache_dtype="fp8_e4m3", k_scale=0.5,
              v_scale=0.25, name="fp8e4m3"),
    PagedCase(kv_lens=(9,), q_lens=(4,), num_q_heads=2, num_kv_heads=1, head_dim=16,
              block_size=4, dtype="float16", kv_cache_dtype="fp8_e5m2", k_scale=0.3,
              v_scale=2.0, alibi=True, sinks=True, name="fp8e5m2-alibi-sinks"),
    PagedCase(kv_lens=(0, 6, 3, 0), q_lens=(2, 0, 5, 0), num_q_heads=4, num_kv_heads=2,
              head_dim=16, block_size=4, dtype="float16", sinks=True, alibi=True,
              sliding_window=2, name="degenerate-rows"),
    PagedCase(kv_lens=(0, 7), num_q_heads=2, num_kv_heads=1, head_dim=16, block_size=4,
              dtype="float32", name="decode-kv0"),
    PagedCase(kv_lens=(5, 12), q_lens=(2, 3), num_q_heads=4, num_kv_heads=1, head_dim=24,
              head_dim_v=16, block_size=4, dtype="bfloat16", logits_soft_cap=4.0,
              name="head-dim-v"),
    PagedCase(kv_lens=(9, 4), q_lens=(3, 1), num_q_heads=2, num_kv_heads=2, head_dim=16,
              block_size=4, dtype="float32", qk_magnitude=30.0, v_magnitude=1e3,
              logit_offset=-1e4, min_block_id=40, layout="layer_in_block",
              name="magnitudes-offset-high-blocks"),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_reference_features_match_per_query_loops(case: PagedCase) -> None:
    inputs = materialize(case)
    truth = reference_attention(inputs).tolist()
    expected = loop_attention(inputs)
    worst = max(abs(a - b) for t, e in zip(truth, expected) for th, eh in zip(t, e)
                for a, b in zip(th, eh))
    assert worst < 1e-12


@settings(max_examples=15)
@given(paged_cases(max_batch=3, max_kv_len=12, max_kv_heads=1, dtypes=("float32",),
                   edges=True, logit_range=True))
def test_reference_matches_per_query_loops_at_the_edges(case: PagedCase) -> None:
    """Degenerate rows, a V head dim of its own, layouts, poisons and the logit range, as
    the search draws them (small, so the loops stay quick), relative to the output's
    scale (float64 logits of magnitude up to ~1e8 round at ~1e-8)."""
    # Small head dims (a latent cache's V is K's first channels: narrower than K's).
    head_dim_v = None if case.head_dim_v is None else 4 if case.latent_cache else 12
    case = case.with_(head_dim=8, head_dim_v=head_dim_v)
    inputs = materialize(case)
    truth = reference_attention(inputs).tolist()
    expected = loop_attention(inputs)
    flat = [(a, b) for t, e in zip(truth, expected) for th, eh in zip(t, e)
            for a, b in zip(th, eh)]
    scale = max([abs(b) for _, b in flat] + [1.0])
    assert max([abs(a - b) for a, b in flat] + [0.0]) <= 1e-9 * scale


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_naive_yardstick_is_close_to_the_truth_with_features(case: PagedCase) -> None:
    """The case-dtype yardstick computes the same features: its error is the rounding of
    the case dtype (< 5e-2 for bf16 on unit-scale data), not a missing bias or sink."""
    inputs = materialize(case)
    err = (naive_attention(inputs).double() - reference_attention(inputs)).abs().max()
    bound = {"float32": 1e-5, "float16": 1e-2, "bfloat16": 5e-2}[case.dtype]
    assert float(err) < bound


def test_each_feature_changes_the_truth() -> None:
    """ALiBi, sinks and fp8 storage each move the output (none is silently ignored)."""
    base = PagedCase(kv_lens=(9, 14), q_lens=(3, 2), num_q_heads=4, num_kv_heads=2,
                     head_dim=16, block_size=4, dtype="float32", name="base")
    plain = reference_attention(materialize(base))
    for change in ({"alibi": True}, {"sinks": True}, {"kv_cache_dtype": "fp8_e5m2"}):
        moved = reference_attention(materialize(base.with_(**change)))
        assert float((moved - plain).abs().max()) > 1e-2, change
