"""The feature axes of a case (alibi, sinks, kv_cache_dtype with k_scale/v_scale): the
slopes of the ALiBi paper, the values materialize() stores, validation, ids and
serialisation, and adapters that do not declare a feature reporting it unsupported."""

from __future__ import annotations

import pytest
import torch

from pagedbench.adapters import registry
from pagedbench.adapters.base import Capabilities
from pagedbench.reference import PagedCase, materialize
from pagedbench.reference.inputs import SINK_HIGH, SINK_LOW, alibi_slopes

BASE = PagedCase(kv_lens=(3, 17, 40), q_lens=(1, 4, 2), num_q_heads=8, num_kv_heads=2,
                 head_dim=32, block_size=16, dtype="float32", seed=7, name="base")

#: Press, Smith and Lewis (ICLR 2022), s. 3: "for 8 heads the slopes are
#: 1/2^1, 1/2^2, ..., 1/2^8; for 16 heads ... 1/2^0.5, 1/2^1, ..., 1/2^8". For 12 heads
#: (not a power of two), the authors' get_slopes: the 8-head slopes, then the odd
#: entries of the 16-head sequence, 2^-0.5, 2^-1.5, 2^-2.5, 2^-3.5.
PAPER_SLOPES = {
    1: [2.0 ** -8],
    8: [2.0 ** -e for e in range(1, 9)],
    16: [2.0 ** -(e / 2) for e in range(1, 17)],
    12: [2.0 ** -e for e in range(1, 9)] + [2.0 ** -0.5, 2.0 ** -1.5, 2.0 ** -2.5, 2.0 ** -3.5],
    3: [2.0 ** -4, 2.0 ** -8, 2.0 ** -2],
}


@pytest.mark.parametrize("num_heads", sorted(PAPER_SLOPES))
def test_alibi_slopes_are_the_papers(num_heads: int) -> None:
    got = alibi_slopes(num_heads)
    assert got.dtype == torch.float32 and got.shape == (num_heads,)
    expected = torch.tensor(PAPER_SLOPES[num_heads], dtype=torch.float32)
    assert torch.equal(got, expected)


def test_alibi_slopes_rejects_no_heads() -> None:
    with pytest.raises(ValueError, match="num_heads must be >= 1"):
        alibi_slopes(0)


def test_features_leave_q_k_v_of_the_case_unchanged() -> None:
    """Adding alibi or sinks changes no drawn value: the same seed gives the same Q, K,
    V and tables, so a feature's effect is measured on otherwise identical inputs."""
    plain = materialize(BASE)
    for changed in (BASE.with_(alibi=True), BASE.with_(sinks=True)):
        other = materialize(changed)
        assert torch.equal(other.q, plain.q)
        assert torch.equal(other.kv_cache.nan_to_num(), plain.kv_cache.nan_to_num())
        assert torch.equal(other.block_tables, plain.block_tables)


def test_materialize_sets_slopes_and_sinks_only_when_asked() -> None:
    plain = materialize(BASE)
    assert plain.alibi_slopes is None and plain.sinks is None
    inputs = materialize(BASE.with_(alibi=True, sinks=True))
    assert torch.equal(inputs.alibi_slopes, torch.tensor(PAPER_SLOPES[8]))
    sinks = inputs.sinks
    assert sinks.dtype == torch.float32 and sinks.shape == (BASE.num_q_heads,)
    assert bool(((sinks >= SINK_LOW) & (sinks < SINK_HIGH)).all())
    assert len(set(sinks.tolist())) == BASE.num_q_heads, "sinks are not drawn per head"
    again = materialize(BASE.with_(alibi=True, sinks=True))
    assert torch.equal(again.sinks, sinks)
    other_seed = materialize(BASE.with_(sinks=True, seed=8))
    assert not torch.equal(other_seed.sinks, sinks)


#: OCP FP8 formats (OCP 8-bit Floating Point Specification, v1.0): mantissa bits and the
#: exponent of the smallest normal number (below it the spacing stays 2^(emin - mbits)).
FP8_FORMATS = {"fp8_e4m3": (torch.float8_e4m3fn, 3, -6), "fp8_e5m2": (torch.float8_e5m2, 2, -14)}


@pytest.mark.parametrize("kv_cache_dtype, k_scale, v_scale", [
    ("fp8_e4m3", 0.5, 0.25),
    ("fp8_e5m2", 1.0, 3.0),
])
def test_fp8_cache_holds_the_scaled_values_rounded(kv_cache_dtype, k_scale, v_scale):
    """Live slots hold ``x / scale`` rounded to the nearest fp8 value (x: the float32
    values of the same case without quantization); unused slots hold the fp8 NaN byte."""
    fp8, mantissa_bits, min_exponent = FP8_FORMATS[kv_cache_dtype]
    exact = materialize(BASE)
    case = BASE.with_(kv_cache_dtype=kv_cache_dtype, k_scale=k_scale, v_scale=v_scale)
    inputs = materialize(case)
    assert inputs.kv_cache.dtype == fp8
    assert torch.equal(inputs.q, exact.q)
    live = ~exact.kv_cache.isnan()
    stored = inputs.kv_cache.double()
    assert bool(stored[~live].isnan().all())
    assert set(inputs.kv_cache.view(torch.uint8)[~live].unique().tolist()) <= {0x7F, 0xFF}
    for index, scale in ((0, k_scale), (1, v_scale)):
        x = exact.kv_cache[:, index].double() / scale
        q = stored[:, index]
        mask = live[:, index]
        # Nearest representable: the stored value is at most half a spacing from x,
        # the spacing being 2^(e - mantissa bits) for x in [2^e, 2^(e + 1)).
        exponent = torch.floor(torch.log2(x[mask].abs())).clamp_min(min_exponent)
        half_spacing = 2.0 ** (exponent - mantissa_bits - 1)
        assert bool(((q[mask] - x[mask]).abs() <= half_spacing).all())


@pytest.mark.parametrize("changes, message", [
    ({"kv_cache_dtype": "fp8"}, "kv_cache_dtype must be one of"),
    ({"kv_cache_dtype": "int8"}, "kv_cache_dtype must be one of"),
    ({"k_scale": 0.5}, "k_scale=0.5 needs an fp8 kv_cache_dtype"),
    ({"kv_cache_dtype": "fp8_e4m3", "v_scale": 0.0}, "v_scale must be a finite float > 0"),
    ({"kv_cache_dtype": "fp8_e4m3", "k_scale": float("inf")}, "k_scale must be a finite"),
    ({"alibi": 1}, "alibi must be True or False"),
    ({"sinks": "yes"}, "sinks must be True or False"),
])
def test_case_rejects_bad_feature_values(changes, message) -> None:
    with pytest.raises(ValueError, match=message):
        BASE.with_(**changes)


def test_case_id_features_and_round_trip() -> None:
    case = BASE.with_(alibi=True, sinks=True, kv_cache_dtype="fp8_e5m2", k_scale=0.5,
                      v_scale=2.0)
    assert case.case_id == "base-fp32-d32-bs16-h8x2-b3-kv3..40-q1..4-alibi-sinks-fp8e5m2-ks0.5-vs2"
    assert case.features == {"alibi", "sinks"}
    assert case.kv_torch_dtype is torch.float8_e5m2
    assert PagedCase.from_dict(case.to_dict()) == case
    assert BASE.case_id == "base-fp32-d32-bs16-h8x2-b3-kv3..40-q1..4"
    old_record = {k: v for k, v in BASE.to_dict().items()
                  if k not in ("alibi", "sinks", "kv_cache_dtype", "k_scale", "v_scale")}
    assert PagedCase.from_dict(old_record) == BASE


@pytest.mark.parametrize("changes, reason", [
    ({"alibi": True}, "feature 'alibi' not supported"),
    ({"sinks": True}, "feature 'sinks' not supported"),
    ({"kv_cache_dtype": "fp8_e4m3"}, "kv_cache_dtype 'fp8_e4m3' not in ['auto']"),
])
def test_capabilities_report_undeclared_features_and_kv_dtypes(changes, reason) -> None:
    caps = Capabilities(devices=frozenset({"cpu"}), dtypes=frozenset({"float32"}),
                        modes=frozenset({"decode", "prefill"}))
    assert caps.why_unsupported(BASE.with_(**changes), "cpu") == [reason]
    assert caps.why_unsupported(BASE, "cpu") == []


def test_registered_adapters_report_what_they_do_not_declare() -> None:
    """Every registered adapter (whatever its own limits) names each new feature and
    kv_cache_dtype it does not declare among its unsupported reasons."""
    case = BASE.with_(alibi=True, sinks=True, kv_cache_dtype="fp8_e5m2")
    for name, (_, adapter) in registry().items():
        caps = adapter.capabilities("cpu")
        reasons = adapter.why_unsupported(case, "cpu")
        for feature in ("alibi", "sinks"):
            if feature not in caps.features:
                assert f"feature {feature!r} not supported" in reasons, name
        if "fp8_e5m2" not in caps.kv_cache_dtypes:
            assert any("kv_cache_dtype 'fp8_e5m2'" in r for r in reasons), name


@pytest.mark.parametrize("field, value, message", [
    ("features", frozenset({"fp8"}), r"features \['fp8'\] unknown"),
    ("kv_cache_dtypes", frozenset({"auto", "int4"}), r"kv_cache_dtypes \['int4'\] unknown"),
])
def test_capabilities_reject_unknown_names(field, value, message) -> None:
    with pytest.raises(ValueError, match=message):
        Capabilities(devices=frozenset({"cpu"}), dtypes=frozenset({"float32"}),
                     **{field: value})
