"""harness/verdict/tolerance.py: the policy's arithmetic and its failure modes. Expected values
come from numpy's float32/float16 spacing and from hand-computed bfloat16 ulps."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedbench.harness.verdict.tolerance import (ERROR_RATIO, ULP_FLOOR, Expected,
                                                  assert_close_report, compare, compare_lse,
                                                  ulp)

TRUTH = torch.tensor([[[1.0, -2.0, 0.5, 0.25]]], dtype=torch.float64)  # [1, 1, 4]
NAIVE = TRUTH + torch.tensor([0.0, 0.01, 0.0, 0.0], dtype=torch.float64)  # naive error 0.01
EXPECTED = Expected(TRUTH, NAIVE.float())


def out_with_error(err: float, dtype=torch.float32, channel: int = 2) -> torch.Tensor:
    shift = torch.zeros(4, dtype=torch.float64)
    shift[channel] = err
    return (TRUTH + shift).to(dtype)


def test_ulp_matches_numpy_spacing_for_float32_and_float16() -> None:
    values = np.array([1.0, 0.75, 3.0, 1e-3, 60000.0, 2.0**-20, 1e-30, 0.0], dtype=np.float64)
    for name, np_dtype in (("float32", np.float32), ("float16", np.float16)):
        expected = np.spacing(values.astype(np_dtype)).astype(np.float64)
        got = ulp(torch.from_numpy(values), name).numpy()
        np.testing.assert_array_equal(got, expected)


def test_ulp_of_bfloat16_by_hand() -> None:
    # bfloat16: 8 significant bits, float32's exponent range (smallest normal 2**-126).
    got = ulp(torch.tensor([1.0, 1.5, 3.0, 0.3, 2.0**-130, 0.0], dtype=torch.float64), "bfloat16")
    assert got.tolist() == [2.0**-7, 2.0**-7, 2.0**-6, 2.0**-9, 2.0**-133, 2.0**-133]
    with pytest.raises(ValueError, match="dtype must be one of"):
        ulp(torch.ones(1), "float64")


def test_passes_at_the_allowance_and_fails_just_above() -> None:
    # channel 2 holds 0.5; the sequence's RMS is sqrt((1 + 4 + 0.25 + 0.0625) / 4) = 1.152,
    # so the floor is ULP_FLOOR float32 ulps at 1.152: ULP_FLOOR * 2**-23.
    yardstick = float(np.float32(-1.99)) + 2.0  # the naive error, as float32 holds it
    floor = ULP_FLOOR["float32"] * float(np.spacing(np.float32(1.152)))
    assert floor == ULP_FLOOR["float32"] * 2.0**-23
    allowed = ERROR_RATIO * yardstick + floor
    ok = compare(out_with_error(allowed * 0.99), EXPECTED, "float32")
    assert ok.passed and ok.reason == ""
    assert ok.allowed_abs_err == pytest.approx(allowed, rel=1e-12)
    assert ok.worst_index == (0, 0, 0, 2)
    bad = compare(out_with_error(allowed * 1.02), EXPECTED, "float32")
    assert not bad.passed
    assert "exceeds its allowance" in bad.reason and "row 0, head 0, channel 2" in bad.reason
    assert bad.err_over_allowance == pytest.approx(1.02, rel=1e-3)
    assert bad.err_ratio_vs_naive == pytest.approx(allowed * 1.02 / yardstick, rel=1e-3)


@pytest.mark.parametrize("dtype, flushed_passes", [
    ("bfloat16", True), ("float32", True), ("float16", False)])
def test_results_flushed_to_zero_below_the_smallest_normal(dtype: str,
                                                           flushed_passes: bool) -> None:
    """A sequence whose outputs are all near float32's smallest normal, 2**-126 (a sink
    taking nearly all the weight): a result below it flushed to zero, the rest exact,
    passes in bfloat16 and float32 (vllm-cpu-mla-extend's bfloat16 output does that) and
    one off by twice it does not; float16's subnormals (6e-8 to 6.1e-5) are held to their
    ulps."""
    tiny = 2.0**-126 if dtype != "float16" else 2.0**-14
    truth = torch.tensor([[[1.25, 0.6, -0.9, 1.5]]], dtype=torch.float64) * tiny
    truth = truth.to(getattr(torch, dtype)).double()  # representable in the dtype
    expected = Expected(truth, truth.to(getattr(torch, dtype)))  # an exact yardstick
    flushed = truth.clone()
    flushed[0, 0, 1:3] = 0.0  # the two values below the smallest normal
    verdict = compare(flushed.to(getattr(torch, dtype)), expected, dtype)
    assert verdict.passed == flushed_passes, verdict.reason
    off = truth.clone()
    off[0, 0, 1] += 2 * tiny
    assert not compare(off.to(getattr(torch, dtype)), expected, dtype).passed


def test_any_nan_or_inf_fails_even_when_other_values_are_exact() -> None:
    out = TRUTH.float().clone()
    out[0, 0, 3] = float("nan")
    result = compare(out, EXPECTED, "float32")
    assert not result.passed and "non-finite" in result.reason
    assert result.worst_index == (0, 0, 0, 3)
    out[0, 0, 3] = float("inf")
    assert not compare(out, EXPECTED, "float32").passed


def test_shape_dtype_and_type_are_checked_before_values() -> None:
    assert "shape" in compare(TRUTH.float()[:, :, :2], EXPECTED, "float32").reason
    assert "dtype" in compare(TRUTH.half(), EXPECTED, "float32").reason
    assert "tuple" in compare((TRUTH.float(), None), EXPECTED, "float32").reason


def test_exact_yardstick_admits_one_rounding_and_no_more() -> None:
    """kv_len 1: the naive output is V itself, error 0. One bfloat16 ulp off (what a
    truncating conversion gives) passes; three ulps fail."""
    truth = torch.tensor([[[1.0, 1.0, 1.0, 1.0]]], dtype=torch.float64)
    exact = Expected(truth, truth.bfloat16())
    one_ulp = torch.full((1, 1, 4), 1.0 - 2.0**-8, dtype=torch.float64).bfloat16()
    assert float(one_ulp[0, 0, 0]) == 1.0 - 2.0**-8  # one ulp below 1.0 in bfloat16
    assert compare(one_ulp, exact, "bfloat16").passed
    three_ulps = torch.full((1, 1, 4), 1.0 + 3 * 2.0**-7, dtype=torch.float64).bfloat16()
    result = compare(three_ulps, exact, "bfloat16")
    assert not result.passed and result.max_err_ulps == pytest.approx(3.0)


def test_a_non_finite_yardstick_never_widens_an_allowance() -> None:
    """Sequence 0's naive result overflowed (NaN). An output off by 1000 there fails, and
    a bit-exact output passes, wherever that sequence sits in the batch."""
    truth = torch.rand(3, 2, 8, dtype=torch.float64)
    naive = truth.clone()
    for first in (0, 2):
        naive_nan = naive.clone()
        naive_nan[first] = float("nan")
        expected = Expected(truth, naive_nan.float())
        cu = torch.tensor([0, 1, 2, 3])
        assert compare(truth.float(), expected, "float32", cu).passed
        wrong = truth.clone()
        wrong[first, 1, 3] += 1000.0
        result = compare(wrong.float(), expected, "float32", cu)
        assert not result.passed and result.worst_index == (first, 0, 1, 3)


def test_each_sequence_is_held_to_its_own_yardstick() -> None:
    """A short sequence's large rounding noise must not buy slack for a long sequence
    (an error of 0.009 where the long sequence's own naive error is 0.002 fails even if
    the short one's naive error is 0.05)."""
    truth = torch.full((2, 1, 4), 0.5, dtype=torch.float64)  # rows: sequence 0, sequence 1
    naive = truth.clone()
    naive[0, 0, 0] += 0.05  # short sequence: big naive error
    naive[1, 0, 0] += 0.002  # long sequence: small naive error
    out = truth.clone()
    out[1, 0, 1] += 0.009
    expected = Expected(truth, naive.float())
    assert compare(out.float(), expected, "float32").passed  # one batch-wide yardstick
    result = compare(out.float(), expected, "float32", torch.tensor([0, 1, 2]))
    assert not result.passed
    assert "sequence 1" in result.reason and result.worst_index == (1, 0, 0, 1)
    assert result.naive_abs_err == pytest.approx(0.002, rel=1e-4)


def test_bias_in_ulps_shows_the_rounding_mode() -> None:
    """Truncation toward zero of random values is biased by about -0.5 ulp toward smaller
    magnitude; rounding to nearest is not."""
    gen = torch.Generator().manual_seed(0)
    truth = (torch.randn(64, 4, 32, generator=gen, dtype=torch.float64) + 3.0)  # |t| ~ 3
    nearest = truth.bfloat16()
    truncated = (truth.float().view(torch.int32) & -65536).view(torch.float32).bfloat16()
    expected = Expected(truth, nearest)
    assert abs(compare(nearest, expected, "bfloat16").mean_err_ulps) < 0.05
    bias = compare(truncated, expected, "bfloat16").mean_err_ulps
    assert -0.55 < bias < -0.4


def test_assert_close_report_names_the_case() -> None:
    with pytest.raises(AssertionError, match="my-case-id"):
        assert_close_report(out_with_error(1.0), EXPECTED, "float32", "my-case-id")


#: A row whose only key's logit is the soft cap's -5 beside a sink of 0.0244 (a case the
#: ci search drew for the fault catalogue's control): log(e^-5 + e^0.0244), in float64.
SMALL_LSE = float(np.logaddexp(np.float64(-5.0), np.float64(0.0244)))


def _lse_expected(truth: float) -> Expected:
    empty = torch.zeros(1, 1, 1, dtype=torch.float64)
    return Expected(empty, empty, None, torch.tensor([[truth]], dtype=torch.float64),
                    torch.zeros(1, 1, dtype=torch.float64))


def test_a_log_sum_exp_near_0_is_allowed_the_rounding_of_its_sum_near_1() -> None:
    """An online softmax forms ``m + log(l)`` with ``l`` near 1 here (the sink's term,
    e^0, and e^-5.02): in float32, ``l`` is off by up to half an ulp of 1, and ``log(l)``
    by as much, whatever the LSE's own magnitude (0.031, whose 16 ulps are 3e-8)."""
    m = np.float32(0.0244)
    l_sum = np.float32(1.0) + np.exp(np.float32(-5.0) - m)  # each step rounded to float32
    online = float(m + np.log(l_sum))
    assert online != SMALL_LSE
    cu = torch.tensor([0, 1])
    kernel = compare_lse(torch.tensor([[online]]), _lse_expected(SMALL_LSE), "float32",
                         "float32", cu)
    assert kernel.passed, kernel.reason
    # The allowance: 16 float32 ulps of 1 (2**-19), not of 0.031 (2**-25).
    for error, passed in ((2.0**-19 * 0.99, True), (2.0**-19 * 1.01, False)):
        found = torch.tensor([[SMALL_LSE + error]], dtype=torch.float64)
        assert compare_lse(found, _lse_expected(SMALL_LSE), "float32", "float32",
                           cu).passed is passed, error


def test_a_log_sum_exp_above_1_is_allowed_ulps_of_its_own_magnitude() -> None:
    cu = torch.tensor([0, 1])
    for error, passed in ((16 * 2.0**-20 * 0.99, True), (16 * 2.0**-20 * 1.01, False)):
        found = torch.tensor([[12.5 + error]], dtype=torch.float64)  # ulp(12.5) = 2**-20
        assert compare_lse(found, _lse_expected(12.5), "float32", "float32",
                           cu).passed is passed, error
