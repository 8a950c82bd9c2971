"""The fp8-poison mark (``harness/verdict/fp8_interpreter.py``) lands on exactly the
verdicts whose poison Triton's interpreter reads as a finite number, in the leaderboard's
cells."""

from __future__ import annotations

import pytest

from pagedbench.harness.verdict import fp8_interpreter
from pagedbench.harness.results import report
from pagedbench.reference import PagedCase
from pagedbench.reference.axes import KV_CACHE_DTYPES, POISONS

from ..conftest import result


@pytest.mark.parametrize("kv_cache_dtype", KV_CACHE_DTYPES)
@pytest.mark.parametrize("poison", POISONS)
def test_the_mark_is_on_interpreted_fp8_cases_with_a_non_finite_poison(kv_cache_dtype,
                                                                        poison) -> None:
    """NaN in both fp8 types and Inf in E5M2 (E4M3 "fn" has no Inf: its "inf" poison is
    448); never a compiled run or a cache that is not fp8; the leaderboard cell carries
    it only then."""
    scales = {} if kv_cache_dtype == "auto" else {"k_scale": 0.5}
    case = PagedCase(kv_lens=(3,), num_q_heads=2, num_kv_heads=1, head_dim=8, block_size=4,
                     dtype="float16", kv_cache_dtype=kv_cache_dtype, poison=poison,
                     name="c1", **scales)
    expected = kv_cache_dtype != "auto" and (
        poison == "nan" or (kv_cache_dtype == "fp8_e5m2" and poison in ("inf", "-inf")))
    assert fp8_interpreter.poison_reads_finite(case, True) is expected
    assert fp8_interpreter.poison_reads_finite(case, False) is False
    interpreted = report.cell_text(result("k", case, ms=1.0, method="interpreted"))
    compiled = report.cell_text(result("k", case, ms=1.0))
    assert (fp8_interpreter.FP8_POISON_MARK in interpreted) is expected, interpreted
    assert fp8_interpreter.FP8_POISON_MARK not in compiled, compiled
