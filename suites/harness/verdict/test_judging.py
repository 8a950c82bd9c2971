"""Timed calls are judged calls: new Q before every call, new K/V before calls the
implementation cannot predict, the judged calls spread over the whole timing, and the
judge's truth of a judged call built from the seed alone."""

from __future__ import annotations

import random

import torch

from pagedbench.harness.measure.samples import Timing
from pagedbench.harness.verdict.conformance import check
from pagedbench.harness.verdict.judging import MOST_JUDGED, judged_calls, kv_calls
from pagedbench.harness.verdict.status import Status
from pagedbench.reference import PagedCase, materialize
from pagedbench.reference.refresh import call_refreshes, call_seed, refresh_live

from pagedbench.suites.faults.kernel import PagedKernel

CASE = PagedCase(kv_lens=(19, 40), num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16,
                 dtype="float16", name="judged")


def test_call_zero_and_one_of_the_first_calls_are_always_judged() -> None:
    rng = random.Random(1)
    for _ in range(2000):
        calls = judged_calls(rng, first_calls=4)
        assert calls[0] == 0 and any(1 <= c <= 4 for c in calls)
        assert calls == sorted(set(calls)) and 2 <= len(calls) <= MOST_JUDGED


def test_a_later_call_is_judged_with_probability_one_over_its_number() -> None:
    """Call ``k`` past the first calls is judged with probability ``1 / (k + 1)`` (no cap,
    20000 draws: 5 standard deviations of the empirical rate)."""
    rng = random.Random(2)
    draws = [set(judged_calls(rng, first_calls=4, most=64)) for _ in range(20000)]
    for k in (9, 24, 99):
        p = 1 / (k + 1)
        rate = sum(k in d for d in draws) / len(draws)
        assert abs(rate - p) < 5 * (p * (1 - p) / len(draws)) ** 0.5, (k, rate, p)


def test_new_kv_comes_strictly_between_judged_calls() -> None:
    rng = random.Random(3)
    for _ in range(2000):
        judged = judged_calls(rng, first_calls=4)
        kv = kv_calls(rng, judged)
        assert kv[0] == 0 and set(kv[1:]).isdisjoint(judged)
        gaps = [(a, b) for a, b in zip(judged, judged[1:]) if b - a >= 2]
        assert len(kv) == 1 + len(gaps)
        assert all(a < c < b for c, (a, b) in zip(kv[1:], gaps))


def test_the_inputs_of_a_judged_call_are_rebuilt_from_the_seed_alone() -> None:
    """What the worker writes call by call (new Q each, new K/V before ``kv``) equals what
    the judge rebuilds for one call from fresh inputs and :func:`call_refreshes`."""
    seed, kv = 12345, [0, 3, 7]
    worker = materialize(CASE)
    for call in range(10):
        refresh_live(worker, call_seed(seed, call), kv=call in kv)
        judge = materialize(CASE)
        for write_seed, with_kv in call_refreshes(seed, call, kv):
            refresh_live(judge, write_seed, kv=with_kv)
        assert torch.equal(worker.q, judge.q), call
        assert torch.equal(worker.kv_cache.nan_to_num(), judge.kv_cache.nan_to_num()), call
        if call in (3, 4):  # new K/V at 3 changed the cache the first materialize drew
            assert not torch.equal(worker.kv_cache.nan_to_num(),
                                   materialize(CASE).kv_cache.nan_to_num())


def _one_new_input_then_five_calls(call, before, after, case, copy) -> Timing:
    """A timer that writes new inputs before its first call only, then times five."""
    before(0)
    after(0, call())
    for _ in range(5):
        call()
    return Timing((0.001,), "torch_timer", calls=(5,))


def test_a_timing_whose_timed_calls_did_not_all_get_new_inputs_is_refused() -> None:
    verdict = check(PagedKernel(), CASE, "cpu", timer=_one_new_input_then_five_calls, samples=4)
    assert (verdict.status, verdict.step) == (Status.FAIL, "timing"), verdict.reason
    assert "only 1 calls of the timing came on new inputs, fewer than its 5 timed calls" \
        in verdict.reason
