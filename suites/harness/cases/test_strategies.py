"""The conformance search's strategy draws the edges and the feature combinations: in 400
derandomized draws over every axis, degenerate rows, fresh prefills, one-token contexts,
every layout and poison, a V head dim of its own, every logit regime, and examples with
every option on at once; float32 cases get every regime and logit scale too (the tolerance
allows for the logits' float32 rounding: docs/tolerance.md); and, given ``max_large_batch``,
ragged batches of hundreds of sequences at small shapes."""

from __future__ import annotations

import math

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedbench.harness.cases.strategies import LARGE_BATCH_MAX_KV, LOGIT_REGIMES, paged_cases
from pagedbench.reference.axes import LAYOUTS, POISONS

DRAWS = 400


def _drawn(**options):
    cases = []

    @settings(max_examples=DRAWS, derandomize=True, database=None, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(st.data())
    def draw(data) -> None:
        cases.append(data.draw(paged_cases(edges=True, logit_regimes=True, **options)))

    draw()
    return cases


def _regime(case) -> dict:
    fields = {"qk_magnitude": 1.0, "v_magnitude": 1.0, "logit_offset": 0.0}
    return {k: getattr(case, k) for k, everyday in fields.items() if getattr(case, k) != everyday}


def test_the_search_draws_the_edges_and_every_option_together() -> None:
    cases = _drawn()
    q_lens = [(c.q_lens or (1,) * c.batch_size) for c in cases]
    rows = [(q, kv) for c, qs in zip(cases, q_lens) for q, kv in zip(qs, c.kv_lens)]
    assert any(kv == 0 for _, kv in rows) and any(q == 0 for q, _ in rows)
    assert any(q > kv > 0 for q, kv in rows)            # rows before position 0
    assert any(q == kv > 16 for q, kv in rows)          # fresh prefills
    assert any(c.kv_lens == (1,) * c.batch_size for c in cases)  # one-token contexts
    assert {c.layout for c in cases} == set(LAYOUTS)
    assert {c.poison for c in cases} == set(POISONS)
    assert any(c.head_dim_v not in (None, c.head_dim) for c in cases)
    regimes = [_regime(c) for c in cases]
    sixteen = [r for c, r in zip(cases, regimes) if c.dtype != "float32"]
    assert all(r in sixteen for r in LOGIT_REGIMES)
    fp32 = [r for c, r in zip(cases, regimes) if c.dtype == "float32"]  # offsets, Q/K too
    assert any("logit_offset" in r for r in fp32) and any("qk_magnitude" in r for r in fp32)
    # no float32 cap on the logits' scale (it was sm_scale 10 at head_dim 64, sqrt(64) * 10)
    assert any(c.sm_scale * math.sqrt(c.head_dim) > 80.0 for c in cases
               if c.dtype == "float32" and c.sm_scale)
    assert any(c.latent_cache for c in cases)  # MLA's latent cache where V is narrower
    together = [c for c in cases if c.sliding_window and c.logits_soft_cap and c.alibi
                and c.sinks and c.kv_cache_dtype != "auto" and c.gqa_ratio > 1 and c.q_lens]
    assert len(together) >= DRAWS // 40, len(together)


def test_the_search_draws_batches_like_production_at_small_shapes() -> None:
    """With ``max_large_batch`` (the conformance search's 257), batches past 16 and up to
    past 128 sequences, ragged, one KV head, every KV length at most
    :data:`LARGE_BATCH_MAX_KV`; without it, none past ``max_batch``."""
    large = [c for c in _drawn(max_large_batch=257) if c.batch_size > 4]
    assert any(c.batch_size > 16 for c in large) and max(c.batch_size for c in large) > 128
    assert all(c.batch_size <= 257 and c.num_kv_heads == 1 for c in large)
    assert all(max(c.kv_lens) <= LARGE_BATCH_MAX_KV and len(set(c.kv_lens)) > 1
               for c in large)
    assert max(c.batch_size for c in _drawn()) <= 4


def test_fp8_scales_are_unequal_not_one_nor_reciprocal_on_shared_blocks_too() -> None:
    """A kernel that drops, swaps or inverts a scale is off by a visible factor: every fp8
    case's scales differ from 1, from each other and from each other's reciprocal (a
    latent cache has one scale), prefix hits and forks among them."""
    fp8 = [c for c in _drawn() if c.kv_cache_dtype != "auto"]
    assert len(fp8) >= DRAWS // 10, len(fp8)
    for case in fp8:
        k, v = case.k_scale, case.v_scale
        assert abs(math.log(k)) > 0.2 and abs(math.log(v)) > 0.2, (k, v)
        if case.latent_cache:
            assert k == v
        else:
            assert abs(math.log(k / v)) > 0.2 and abs(math.log(k * v)) > 0.2, (k, v)
    assert any(c.shared_blocks and not c.latent_cache for c in fp8)

