"""``transformers-paged``: the cache the adapter builds is transformers' own layout (each
sequence's K and V read back through its block table), the declarations, and the two
declared deviations held to ``suites/peer_findings.py`` by running them anyway.
Skipped without transformers."""

from __future__ import annotations

import pytest
import torch

from pagedbench.adapters.base import Adapter
from pagedbench.harness.run import replay
from pagedbench.reference import PagedCase, materialize
from pagedbench.reference.dense import gather_kv, reference_attention
from pagedbench.suites import peer_findings

pytest.importorskip("transformers.generation.continuous_batching.cache")

from pagedbench.adapters.transformers_paged import TransformersPaged  # noqa: E402


@pytest.fixture(scope="module")
def adapter() -> TransformersPaged:
    adapter = TransformersPaged()
    assert adapter.available("cpu").ok
    return adapter


def _unchecked(monkeypatch) -> TransformersPaged:
    """The adapter without its own limits (the capabilities' still apply)."""
    monkeypatch.setattr(TransformersPaged, "why_unsupported", Adapter.why_unsupported)
    return TransformersPaged()


def test_cache_holds_each_sequence_through_its_block_table(adapter) -> None:
    case = PagedCase(kv_lens=(5, 19, 33), q_lens=(1, 4, 33), num_q_heads=4, num_kv_heads=2,
                     head_dim=32, block_size=8, dtype="float32", seed=3)
    inputs = materialize(case)
    prepared = adapter.prepare(inputs)
    cache = prepared.call.__closure__[0].cell_contents.keywords["cache"]
    allocator = cache.cache_allocators["full_attention"]
    k_view, v_view = allocator._kv_token_views[0]
    for i, (k, v) in enumerate(gather_kv(inputs)):
        rows = torch.tensor(allocator.get_read_indices(f"seq{i}", 0, case.kv_lens[i]))
        assert len(allocator.block_table[f"seq{i}"]) == case.blocks_per_seq[i]
        assert torch.equal(k_view.index_select(0, rows), k)  # [kv_len, heads, head_dim]
        assert torch.equal(v_view.index_select(0, rows), v)
    assert prepared.facts["num_blocks"] == sum(case.blocks_per_seq)
    out = adapter.run(prepared)
    torch.testing.assert_close(out.double(), reference_attention(inputs), atol=1e-5, rtol=1e-5)


def test_declared_limits_are_unsupported_with_the_reason(adapter) -> None:
    base = PagedCase(kv_lens=(3, 9), num_q_heads=2, num_kv_heads=1, head_dim=64, block_size=16,
                     dtype="float16")
    reasons = {
        "feature 'sliding_window'": base.with_(sliding_window=4),
        "feature 'sinks'": base.with_(sinks=True),
        "transformers' packed mask adds -65504": base.with_(qk_magnitude=300.0),
    }
    for expected, case in reasons.items():
        assert any(expected in r for r in adapter.why_unsupported(case, "cpu")), expected


def test_packed_mask_overflow_really_deviates(pytestconfig, monkeypatch) -> None:
    """Two sequences of one key in float16: row 0's logit against its own key is 0, and
    against sequence 1's key (packed into the same call) 70000 > 65504: the mask does not
    hold it, so row 0 returns sequence 1's V instead of its own."""
    adapter = _unchecked(monkeypatch)
    case = PagedCase(kv_lens=(1, 1), num_q_heads=1, num_kv_heads=1, head_dim=16, block_size=16,
                     dtype="float16", sm_scale=10.0, name="mask-overflow")

    def probe() -> None:
        inputs = materialize(case)
        own, other = (int(slot) for slot in inputs.slot_mapping)
        bs = case.block_size
        inputs.q.zero_()
        inputs.q[:, 0, 0] = 1.0
        inputs.kv_cache[own // bs, 0, own % bs].zero_()  # logit 0
        inputs.kv_cache[other // bs, 0, other % bs].zero_()
        inputs.kv_cache[other // bs, 0, other % bs, 0, 0] = 7000.0  # logit 70000
        out = adapter.run(adapter.prepare(inputs))
        torch.testing.assert_close(out[0, 0], inputs.kv_cache[own // bs, 1, own % bs, 0],
                                   msg="row 0 is not its own key's V")

    outcome, error = peer_findings.observe(probe)
    key = peer_findings.combination(adapter, "cpu") + ("packed-mask-overflow",)
    peer_findings.expect(key, outcome, error, case.case_id, pytestconfig.rootpath)


def test_fp16_logits_near_1e4_pass(adapter) -> None:
    """Float16 logits near 1e4, a case of the search (2.25x the allowance without the
    logits' float32 rounding term): taken, and passed."""
    case = PagedCase(kv_lens=(1, 1, 7, 128), num_q_heads=2, num_kv_heads=2, head_dim=192,
                     block_size=8, dtype="float16", sm_scale=0.2, logit_offset=1e4, seed=372,
                     name="hyp")
    assert adapter.why_unsupported(case, "cpu") == []
    assert replay.check(adapter, case, "cpu", adapter.name).comparison.err_over_allowance < 0.5
