"""Timed calls are judged calls: new Q before every call, new K/V before calls the
implementation cannot predict, the judged calls spread over the whole timing, and the
judge's truth of a judged call built from the seed alone."""

from __future__ import annotations

import random
import sys
import time

import pytest
import torch

from pagedbench.harness.measure.samples import Timing
from pagedbench.harness.verdict import judging
from pagedbench.harness.verdict.conformance import check
from pagedbench.harness.verdict.judging import JUDGED, MOST_KV_CALLS, Reservoir, kv_calls
from pagedbench.harness.verdict.status import Status
from pagedbench.reference import PagedCase, materialize
from pagedbench.reference.refresh import MIN_POOL, TimedInputs, pool_size

from pagedbench.adapters.base import Prepared
from pagedbench.suites.faults.kernel import PagedKernel

CASE = PagedCase(kv_lens=(19, 40), num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16,
                 dtype="float16", name="judged")


def test_new_kv_comes_before_call_zero_and_one_of_the_first_calls() -> None:
    rng = random.Random(1)
    for _ in range(2000):
        calls = kv_calls(rng, first_calls=4)
        assert calls[0] == 0 and any(1 <= c <= 4 for c in calls)
        assert calls == sorted(set(calls)) and 2 <= len(calls) <= MOST_KV_CALLS


def test_new_kv_comes_before_a_later_call_with_probability_one_over_its_number() -> None:
    """Call ``k`` past the first calls gets new K/V with probability ``1 / (k + 1)`` (no
    cap, 20000 draws: 5 standard deviations of the empirical rate)."""
    rng = random.Random(2)
    draws = [set(kv_calls(rng, first_calls=4, most=64)) for _ in range(20000)]
    for k in (9, 24, 99):
        p = 1 / (k + 1)
        rate = sum(k in d for d in draws) / len(draws)
        assert abs(rate - p) < 5 * (p * (1 - p) / len(draws)) ** 0.5, (k, rate, p)


def test_the_judged_calls_are_a_uniform_sample_of_all_calls() -> None:
    """Each of 50 calls is judged with probability JUDGED / 50, the last as often as the
    first (20000 timings: 5 standard deviations), and the judge's replay of a seed gives
    the worker's sample."""
    calls, timings = 50, 20000
    counts = [0] * calls
    for seed in range(timings):
        sample = Reservoir(JUDGED, seed)
        for call in range(calls):
            sample.offer(call)
        assert len(set(sample.calls)) == JUDGED
        for call in sample.calls:
            counts[call] += 1
    p = JUDGED / calls
    for call in (0, 1, 25, 48, 49):
        rate = counts[call] / timings
        assert abs(rate - p) < 5 * (p * (1 - p) / timings) ** 0.5, (call, rate, p)
    again = Reservoir(JUDGED, timings - 1)
    for call in range(calls):
        again.offer(call)
    assert again.calls == sample.calls


#: A prefill whose Q (29 query rows x 8 heads) needs a pool past MIN_POOL.
PREFILL = PagedCase(kv_lens=(9, 20), q_lens=(9, 20), num_q_heads=8, num_kv_heads=2,
                    head_dim=128, block_size=16, dtype="bfloat16", name="prefill")
#: One query vector: the pool's start moves by one each call.
ONE_VECTOR = PagedCase(kv_lens=(9,), num_q_heads=1, num_kv_heads=1, head_dim=16,
                       block_size=16, dtype="float32", name="one-vector")


@pytest.mark.parametrize("case", [CASE, PREFILL, ONE_VECTOR], ids=lambda c: c.name)
def test_the_inputs_of_a_judged_call_are_rebuilt_from_the_seed_alone(case) -> None:
    """What the worker writes call by call (new Q each, new K/V before ``kv``) equals what
    the judge rebuilds for one call from fresh inputs; Q is new at every call, and K/V
    change exactly at the calls ``kv``."""
    seed, kv = 12345, [0, 3, 7]
    worker, drawn = materialize(case), materialize(case)
    fresh = TimedInputs(case, seed, kv)
    seen_q: list[torch.Tensor] = []
    cache = worker.kv_cache.nan_to_num()
    for call in range(10):
        fresh.write(worker, call)
        judge = materialize(case)
        TimedInputs(case, seed, kv).rebuild(judge, call)
        assert torch.equal(worker.q, judge.q), call
        assert torch.equal(worker.kv_cache.nan_to_num(), judge.kv_cache.nan_to_num()), call
        assert not any(torch.equal(worker.q, q) for q in [drawn.q, *seen_q]), call
        seen_q.append(worker.q.clone())
        now = worker.kv_cache.nan_to_num()
        assert torch.equal(now, cache) is (call not in kv), call
        cache = now


@pytest.mark.parametrize("case", [CASE, PREFILL, ONE_VECTOR], ids=lambda c: c.name)
def test_no_two_calls_of_a_timing_get_the_same_query(case) -> None:
    """Each call's query vectors are distinct, and 1000 calls get 1000 different Q (a memo
    keyed by the query never hits); the pool is a power of two at least twice the vectors
    and MIN_POOL."""
    inputs = materialize(case)
    fresh = TimedInputs(case, 7, [0])
    vectors = case.total_q * case.num_q_heads
    size = fresh.pool.shape[0]
    assert size == pool_size(case) >= max(2 * vectors, MIN_POOL) and size & (size - 1) == 0
    seen = set()
    for call in range(1000):
        fresh.write(inputs, call)
        q = inputs.q.float().reshape(vectors, -1).numpy()
        assert len({row.tobytes() for row in q}) == vectors
        seen.add(q.tobytes())
    assert len(seen) == 1000


#: Decode with one KV head and eight query heads: every query vector attends the same
#: keys, so a memo needs only the vector.
MQA_DECODE = PagedCase(kv_lens=(40,), num_q_heads=8, num_kv_heads=1, head_dim=128,
                       block_size=16, dtype="bfloat16", name="mqa-decode")


@pytest.mark.parametrize("case", [MQA_DECODE, ONE_VECTOR], ids=lambda c: c.name)
def test_a_memo_keyed_by_one_query_vector_never_hits(case) -> None:
    """4000 calls of the MQA decode write 32000 query vectors picked from a pool of 4096:
    without each call's permutation and signs of the channels, 27904 of them came back bit
    for bit, so a memo of each vector's output row (one sequence and KV head here) did an
    eighth of the work. Also at head_dim 16, the fewest channels to permute."""
    inputs = materialize(case)
    fresh = TimedInputs(case, 11, [0])
    seen, hits, picks = set(), 0, 0
    for call in range(4000):
        fresh.write(inputs, call)
        for row in inputs.q.float().reshape(-1, case.head_dim).numpy():
            key = row.tobytes()
            hits += key in seen
            picks += 1
            seen.add(key)
    assert hits == 0, f"{hits} of {picks} query vectors came back"


class LseOnFirstCallOnly(PagedKernel):
    """Its output on every call, its LSE on the first only (a kernel whose LSE costs
    extra work, skipped where no one reads it)."""

    name = "lse-on-first-call-only"

    def prepare(self, inputs):
        inner = super().prepare(inputs)
        calls = [0]

        def call() -> torch.Tensor:
            calls[0] += 1
            return self.attend(inputs) if calls[0] > 1 else inner.call()
        return Prepared(call, lse=inner.lse)


def test_a_timed_call_is_judged_on_its_lse_too() -> None:
    verdict = check(LseOnFirstCallOnly(), CASE, "cpu", timer=_every_call_timed, samples=4)
    assert (verdict.status, verdict.step) == (Status.FAIL, "timing"), verdict.reason
    assert "returned an output that fails: its LSE:" in verdict.reason, verdict.reason


class WorkWhileInputsAreWritten(PagedKernel):
    """Sets a profile function in ``prepare`` that computes the output as soon as
    pagedbench's write of a call's new Q returns; ``run`` then hands that output back:
    right on every call, its work done in pagedbench's untimed step."""

    name = "work-while-inputs-are-written"

    def prepare(self, inputs):
        inner = super().prepare(inputs)
        ready: list[torch.Tensor] = []

        def profile(frame, event, arg) -> None:
            if event == "return" and frame.f_code.co_name == "_write_q":
                ready[:] = [inner.call()]

        sys.setprofile(profile)
        return Prepared(lambda: ready.pop() if ready else inner.call(), lse=inner.lse)


class OwnQuery(PagedKernel):
    """Puts a tensor of its own in place of the inputs' Q in ``prepare`` (one whose writes
    it could intercept)."""

    name = "own-query"

    def prepare(self, inputs):
        object.__setattr__(inputs, "q", inputs.q.clone())
        return super().prepare(inputs)


class MoreThreads(PagedKernel):
    """Raises torch's intra-op thread count in its first call (to use more cores than the
    run grants it), and keeps it."""

    name = "more-threads"

    def prepare(self, inputs):
        inner = super().prepare(inputs)

        def call() -> torch.Tensor:
            torch.set_num_threads(torch.get_num_threads() + 1)
            return inner.call()
        return Prepared(call, lse=inner.lse)


@pytest.mark.parametrize("kernel, words", [
    (WorkWhileInputsAreWritten, "ran with a trace or profile function set"),
    (OwnQuery, "found the inputs' q or kv_cache replaced"),
    (MoreThreads, "changed torch's intra-op threads from")],
    ids=lambda x: getattr(x, "name", ""))
def test_work_outside_the_timed_call_or_more_threads_are_refused(kernel, words) -> None:
    before, threads = sys.getprofile(), torch.get_num_threads()
    try:
        verdict = check(kernel(), CASE, "cpu", timer=_every_call_timed, samples=4)
    finally:
        sys.setprofile(before)
        torch.set_num_threads(threads)
    assert (verdict.status, verdict.step) == (Status.FAIL, "timing"), verdict.reason
    assert words in verdict.reason, verdict.reason


@pytest.mark.parametrize("cores, threads, refused", [
    (5.0, 2, True), (1.0, 1, False), (2.0, 2, False)])
def test_a_cpu_timing_that_used_more_cores_than_its_threads_is_refused(
        monkeypatch, cores, threads, refused) -> None:
    """The CPU the implementation's process used over the timing's wall time is at most its
    threads, a tenth more and a few clock ticks' reading: 5 cores with 2 threads is
    refused; 1 core with 1 thread and 2 with 2 are within. The fake process reports
    ``cores`` times the wall time since the judge's first reading, whatever the host's
    speed."""
    began: list[float] = []
    used = [0.0]

    def reading() -> dict[str, float]:
        began[:] = began or [time.monotonic()]
        return {"worker": used[0]}
    monkeypatch.setattr(judging, "_own_cpu_seconds", reading)

    def timer(call, before, after, case, copy) -> Timing:
        timing = _every_call_timed(call, before, after, case, copy)
        time.sleep(0.2)
        used[0] = cores * (time.monotonic() - began[0])
        return timing
    verdict = check(PagedKernel(), CASE, "cpu", timer=timer, samples=4, threads=threads)
    if refused:
        assert (verdict.status, verdict.step) == (Status.FAIL, "timing"), verdict.reason
        assert f"more than the {threads} thread(s) the run grants" in verdict.reason, \
            verdict.reason
    else:
        assert verdict.status is Status.PASS, verdict.reason


@pytest.mark.parametrize("readings", [
    # A helper alive at the start, gone at the end: its 3 s before the timing are no credit.
    [{"worker": 0.0, "helper": 3.0}, {"worker": 0.4}],
    # A helper that used 0.1 s in the timing, then ended: refused, however little it used.
    [{"worker": 0.0, "helper": 0.0}, {"worker": 0.1}]], ids=["credit", "ended"])
def test_a_process_that_ends_during_a_cpu_timing_is_refused(monkeypatch, readings) -> None:
    """Each process's CPU counts from the first reading it is in; one that ended is
    refused, so that a descendant reaped where no one counts it cannot hide the cores it
    used, nor its past CPU offset the worker's."""
    clock = iter(readings + [readings[-1]] * 8)
    monkeypatch.setattr(judging, "_own_cpu_seconds", lambda: next(clock))
    verdict = check(PagedKernel(), CASE, "cpu", timer=_every_call_timed, samples=4, threads=1)
    assert (verdict.status, verdict.step) == (Status.FAIL, "timing"), verdict.reason
    assert "1 process(es) of the implementation ended during its timing" in verdict.reason


def _every_call_timed(call, before, after, case, copy) -> Timing:
    """Twelve calls, each on new inputs, as the CPU timer makes them."""
    for k in range(12):
        before(k)
        after(k, call())
    return Timing((0.001,) * 12, "torch_timer", calls=(1,) * 12)


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
