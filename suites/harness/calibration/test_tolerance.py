"""A sample of the tolerance calibration (``python -m pagedbench.harness.calibration.tolerance``
runs the full one): implementations that are correct up to rounding always pass, one that
keeps its softmax sum and accumulator in bf16/fp16 fails on long contexts."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from pagedbench.harness.calibration.tolerance import (FAULTY, compare_variants, random_case,
                                                      truncate_toward_zero, variants_for)

#: Random cases per dtype in `make test` (the documented command draws 1000).
SAMPLE = 20
#: Long-context cases per 16-bit dtype on which the faulty variant must fail.
LONG_SAMPLE = 3


def test_truncation_toward_zero_matches_numpy() -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(4096, generator=gen) * torch.logspace(-6, 4, 4096)  # both signs, 10 decades
    # float16: numpy's nearest value, stepped one ulp toward zero where it overshot.
    nearest = x.numpy().astype(np.float16)
    overshot = np.abs(nearest.astype(np.float32)) > np.abs(x.numpy())
    expected = np.where(overshot, np.nextafter(nearest, np.float16(0)), nearest)
    got = truncate_toward_zero(x, torch.float16).numpy()
    np.testing.assert_array_equal(got, expected)
    # bfloat16: dropping the low 16 bits of the float32 pattern is truncation toward zero.
    dropped = (x.view(torch.int32) & -65536).view(torch.float32).bfloat16()
    assert torch.equal(truncate_toward_zero(x, torch.bfloat16), dropped)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_correct_variants_pass_random_cases(dtype: str) -> None:
    rng = random.Random(f"calibration-{dtype}")
    for _ in range(SAMPLE):
        case = random_case(rng, dtype, seed=rng.randrange(2**31))
        correct = tuple(v for v in variants_for(dtype) if v != FAULTY)
        for (variant, order), comparison in compare_variants(case, correct).items():
            assert comparison.passed, (f"{variant} ({order}) on {case.to_dict()}: "
                                       f"{comparison.reason}")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_low_precision_accumulator_fails_long_contexts(dtype: str) -> None:
    rng = random.Random(f"long-{dtype}")
    for _ in range(LONG_SAMPLE):
        case = random_case(rng, dtype, (4096, 8192), rng.randrange(2**31), spread=True)
        comparison = compare_variants(case, (FAULTY,))[FAULTY, "blocked16"]
        assert not comparison.passed, f"{FAULTY} passed {case.to_dict()}"
        assert comparison.max_err_ulps > 4
