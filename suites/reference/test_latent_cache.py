"""MLA's latent cache as a case property (``PagedCase.latent_cache``): V is K's first
``head_dim_v`` channels in every live slot, nothing else about the case changes, the
truth follows, and bad combinations are refused by name. Also the V head dims and the
latent-cache need that an implementation declares (``Capabilities.v_head_dims``,
``needs_latent_cache``), and what the search draws for such an implementation."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings

from pagedbench.adapters.base import Capabilities
from pagedbench.harness.cases.strategies import paged_cases
from pagedbench.reference import PagedCase, PagedInputError, materialize
from pagedbench.reference.dense import gather_kv

MLA = PagedCase(kv_lens=(5, 16, 33), num_q_heads=4, num_kv_heads=1, head_dim=96,
                head_dim_v=64, block_size=16, dtype="float32", seed=3, name="mla")
MLA_ONLY = Capabilities(devices=frozenset({"cpu"}), dtypes=frozenset({"bfloat16"}),
                        head_dims=frozenset({576}), v_head_dims=frozenset({512}),
                        block_sizes=frozenset({16}), features=frozenset({"head_dim_v"}),
                        needs_latent_cache=True)


def _live(inputs, half: int) -> torch.Tensor:
    """The live tokens of one half of the cache, ``[sum(kv_lens), num_kv_heads, channels]``."""
    bs = inputs.case.block_size
    return inputs.kv_cache[inputs.slot_mapping // bs, half, inputs.slot_mapping % bs]


def test_latent_v_is_the_first_channels_of_k() -> None:
    inputs = materialize(MLA.with_(latent_cache=True))
    k, v = _live(inputs, 0), _live(inputs, 1)
    assert torch.equal(v[..., :64], k[..., :64])
    assert v[..., 64:].isnan().all()  # the canonical cache's V half ends at head_dim_v
    plain = materialize(MLA)
    assert not torch.equal(_live(plain, 1)[..., :64], _live(plain, 0)[..., :64])


def test_latent_changes_nothing_but_v() -> None:
    """Same seed: Q, K, tables and slots are the non-latent case's, so the two cases
    differ in V alone."""
    plain, latent = materialize(MLA), materialize(MLA.with_(latent_cache=True))
    for name in ("q", "block_tables", "slot_mapping", "kv_lens", "cu_seqlens_q"):
        assert torch.equal(getattr(plain, name), getattr(latent, name)), name
    assert torch.equal(_live(plain, 0), _live(latent, 0))


def test_truth_reads_the_latent_v() -> None:
    """The dense V each sequence attends is K's first channels."""
    for k, v in gather_kv(materialize(MLA.with_(latent_cache=True))):
        assert torch.equal(v, k[..., :64])


def test_latent_fp8_cache_stores_v_as_k() -> None:
    case = MLA.with_(latent_cache=True, kv_cache_dtype="fp8_e4m3", k_scale=0.5, v_scale=0.5)
    inputs = materialize(case)
    assert torch.equal(_live(inputs, 1)[..., :64].view(torch.uint8),
                       _live(inputs, 0)[..., :64].view(torch.uint8))


@pytest.mark.parametrize("changes, parameter", [
    ({"head_dim_v": None}, "head_dim_v"),
    ({"head_dim_v": 128}, "head_dim_v"),
    ({"v_magnitude": 2.0}, "v_magnitude"),
    ({"kv_cache_dtype": "fp8_e4m3", "k_scale": 0.5, "v_scale": 0.25}, "v_scale"),
    ({"latent_cache": 1}, "latent_cache"),
])
def test_latent_refuses_what_cannot_be_k_prefix(changes, parameter) -> None:
    with pytest.raises(PagedInputError) as caught:
        MLA.with_(**({"latent_cache": True} | changes))
    assert caught.value.parameter == parameter


def test_latent_in_id_and_round_trip() -> None:
    case = MLA.with_(latent_cache=True)
    assert case.case_id.endswith("-latent") and "latent" not in MLA.case_id
    assert PagedCase.from_dict(case.to_dict()) == case
    old = MLA.to_dict()
    del old["latent_cache"]  # records written before the field read as not latent
    assert PagedCase.from_dict(old) == MLA


@pytest.mark.parametrize("changes, reason", [
    ({}, "head_dim_v 96 not supported (supported: 512)"),
    ({"head_dim_v": 512}, "a separate V not supported"),
])
def test_capabilities_v_head_dims_and_latent_need(changes, reason) -> None:
    case = PagedCase(kv_lens=(3,), num_q_heads=4, num_kv_heads=1, head_dim=576, block_size=16,
                     **({"head_dim_v": 96} | changes))
    reasons = MLA_ONLY.why_unsupported(case, "cpu")
    assert any(reason in r for r in reasons), reasons
    assert not MLA_ONLY.why_unsupported(case.with_(head_dim_v=512, latent_cache=True), "cpu")
    assert MLA_ONLY.to_dict()["v_head_dims"] == [512]
    assert MLA_ONLY.to_dict()["needs_latent_cache"] is True


@settings(max_examples=30, database=None, deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(paged_cases(MLA_ONLY, edges=True, logit_regimes=True))
def test_search_draws_only_what_an_mla_kernel_takes(case: PagedCase) -> None:
    assert not MLA_ONLY.why_unsupported(case, "cpu"), case
    assert (case.head_dim, case.v_head_dim, case.latent_cache) == (576, 512, True)
