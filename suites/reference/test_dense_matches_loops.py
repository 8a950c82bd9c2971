"""The float64 truth equals attention written out query by query with Python floats
(math.exp, explicit sums), independent of torch's einsum/softmax."""

from __future__ import annotations

import math

import pytest

from pagedbench.reference import PagedCase, materialize, reference_attention


def loop_attention(inputs) -> list:
    """Attention by definition: for each query row and head, scores over visible keys
    (bottom-right causal, window, soft cap), a max-shifted softmax, a weighted sum."""
    case = inputs.case
    bs, ratio = case.block_size, case.gqa_ratio
    cache = inputs.kv_cache.double().tolist()  # [blocks][2][bs][hkv][d]
    q_all = inputs.q.double().tolist()
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
                    k = cache[tables[i][t // bs]][0][t % bs][g]
                    s = case.scale * sum(a * b for a, b in zip(q, k))
                    if case.logits_soft_cap is not None:
                        s = case.logits_soft_cap * math.tanh(s / case.logits_soft_cap)
                    scores.append(s)
                top = max(scores)
                weights = [math.exp(s - top) for s in scores]
                total = sum(weights)
                acc = [0.0] * case.head_dim
                for w, t in zip(weights, keys):
                    v = cache[tables[i][t // bs]][1][t % bs][g]
                    acc = [a + w / total * x for a, x in zip(acc, v)]
                row.append(acc)
            out.append(row)
    return out


@pytest.mark.parametrize(
    "case",
    [
        PagedCase(kv_lens=(1, 4, 5, 11), num_q_heads=4, num_kv_heads=2, head_dim=8 * 8,
                  block_size=4, dtype="float32", name="decode"),
        PagedCase(kv_lens=(6, 9), q_lens=(3, 9), num_q_heads=3, num_kv_heads=1, head_dim=64,
                  block_size=2, dtype="bfloat16", name="prefill"),
        PagedCase(kv_lens=(13,), q_lens=(4,), num_q_heads=2, num_kv_heads=2, head_dim=64,
                  block_size=8, dtype="float16", sliding_window=3, logits_soft_cap=2.0,
                  name="features"),
    ],
    ids=lambda c: c.name,
)
def test_reference_matches_per_query_loops(case) -> None:
    inputs = materialize(case)
    truth = reference_attention(inputs).tolist()
    expected = loop_attention(inputs)
    worst = max(abs(a - b) for t, e in zip(truth, expected) for th, eh in zip(t, e)
                for a, b in zip(th, eh))
    assert worst < 1e-12
