"""harness/tolerance.py: the policy's arithmetic and its failure modes."""

from __future__ import annotations

import pytest
import torch

from pagedbench.harness.tolerance import ATOL_FLOOR, ERROR_RATIO, assert_close_report, compare

TRUTH = torch.tensor([[[1.0, -2.0, 0.5, 0.0]]], dtype=torch.float64)  # [1, 1, 4]
NAIVE = TRUTH + torch.tensor([0.0, 0.01, 0.0, 0.0], dtype=torch.float64)  # naive error 0.01


def out_with_error(err: float, dtype=torch.float32) -> torch.Tensor:
    return (TRUTH + torch.tensor([0.0, 0.0, err, 0.0], dtype=torch.float64)).to(dtype)


def test_passes_at_the_allowance_and_fails_just_above() -> None:
    allowed = ERROR_RATIO * 0.01 + ATOL_FLOOR  # 0.02001 with the published constants
    assert allowed == pytest.approx(0.02001)
    ok = compare(out_with_error(0.0199), TRUTH, NAIVE.float(), "float32")
    assert ok.passed and ok.reason == ""
    assert ok.max_abs_err == pytest.approx(0.0199, abs=1e-6)
    assert ok.worst_index == (0, 0, 2)
    bad = compare(out_with_error(0.0202), TRUTH, NAIVE.float(), "float32")
    assert not bad.passed
    assert "exceeds" in bad.reason and "(0, 0, 2)" in bad.reason
    assert bad.err_ratio_vs_naive == pytest.approx(2.02, rel=1e-3)


def test_any_nan_or_inf_fails_even_when_other_values_are_exact() -> None:
    out = TRUTH.float().clone()
    out[0, 0, 3] = float("nan")
    result = compare(out, TRUTH, NAIVE.float(), "float32")
    assert not result.passed and "non-finite" in result.reason and result.worst_index == (0, 0, 3)
    out[0, 0, 3] = float("inf")
    assert not compare(out, TRUTH, NAIVE.float(), "float32").passed


def test_shape_and_dtype_are_checked_before_values() -> None:
    assert "shape" in compare(TRUTH.float()[:, :, :2], TRUTH, NAIVE.float(), "float32").reason
    assert "dtype" in compare(TRUTH.half(), TRUTH, NAIVE.float(), "float32").reason


def test_floor_admits_tiny_errors_when_naive_is_exact() -> None:
    exact = TRUTH.float()
    assert compare(out_with_error(5e-6), TRUTH, exact, "float32").passed
    assert not compare(out_with_error(5e-5), TRUTH, exact, "float32").passed


def test_assert_close_report_names_the_case() -> None:
    with pytest.raises(AssertionError, match="my-case-id"):
        assert_close_report(out_with_error(1.0), TRUTH, NAIVE.float(), "float32", "my-case-id")


def test_each_sequence_is_held_to_its_own_yardstick() -> None:
    """A short sequence's large rounding noise must not buy slack for a long sequence
    (an error of 0.009 where the long sequence's own naive error is 0.002 fails even if
    the short one's naive error is 0.05)."""
    truth = torch.zeros(2, 1, 4, dtype=torch.float64)  # rows: sequence 0, sequence 1
    naive = truth.clone()
    naive[0, 0, 0] = 0.05  # short sequence: big naive error
    naive[1, 0, 0] = 0.002  # long sequence: small naive error
    out = truth.clone()
    out[1, 0, 1] = 0.009
    cu = torch.tensor([0, 1, 2], dtype=torch.int32)
    assert compare(out.float(), truth, naive.float(), "float32").passed  # one batch yardstick
    result = compare(out.float(), truth, naive.float(), "float32", cu)
    assert not result.passed
    assert "sequence 1" in result.reason and result.worst_index == (1, 0, 1)
    assert result.naive_abs_err == pytest.approx(0.002)
    assert result.allowed_abs_err == pytest.approx(2 * 0.002 + ATOL_FLOOR)


def test_a_non_tensor_output_fails_cleanly() -> None:
    result = compare((TRUTH.float(), None), TRUTH, NAIVE.float(), "float32")
    assert not result.passed and "tuple" in result.reason
