"""reference.logit_bound: no scaled logit of materialize()'s inputs reaches past it, for
every magnitude and offset the search draws, and it is not so loose that it declares the
everyday cases (a bound adapters declare unsupported cases by)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given

from pagedbench.harness.cases.strategies import paged_cases
from pagedbench.reference import PagedCase, gather_kv, logit_bound, materialize
from pagedbench.reference.dense import dequantize


def largest_logit(case: PagedCase) -> float:
    """max |q . k| * scale over every (query row, key, head) of the case's inputs, in
    float64, K dequantized as the truth reads it."""
    inputs = materialize(case)
    ratio = case.num_q_heads // case.num_kv_heads
    q = inputs.q.double()
    largest, start = 0.0, 0
    for q_len, (k, _) in zip(case.q_lens_or_decode, gather_kv(inputs)):
        k = dequantize(k, case.k_scale, torch.float64).repeat_interleave(ratio, dim=1)
        rows = q[start:start + q_len]  # [q_len, hq, d]
        start += q_len
        if len(k) and q_len:
            logits = torch.einsum("qhd,khd->hqk", rows, k) * case.scale
            largest = max(largest, logits.abs().max().item())
    return largest


@given(paged_cases(max_batch=3, max_kv_len=120, edges=True, logit_range=True))
def test_no_logit_passes_the_bound(case: PagedCase) -> None:
    assert largest_logit(case) <= logit_bound(case)


def test_the_offset_is_reached_and_the_bound_is_tight_for_unit_draws() -> None:
    case = PagedCase(kv_lens=(40, 7), num_q_heads=4, num_kv_heads=2, head_dim=64,
                     block_size=16, dtype="float32", logit_offset=1e4, name="offset")
    # q0 * k0 * scale is the offset exactly; the drawn channels add a few units.
    assert abs(largest_logit(case) - 1e4) < 20
    assert logit_bound(case) == pytest.approx(1e4 + 8 * 4, rel=1e-6)
    everyday = PagedCase(kv_lens=(300,), num_q_heads=8, num_kv_heads=2, head_dim=128,
                         block_size=16, dtype="float32", name="everyday")
    # Unit draws: logits of a few units; the bound, 8 * 4 = 32, within 10x of them.
    assert largest_logit(everyday) <= logit_bound(everyday) < 10 * largest_logit(everyday)
