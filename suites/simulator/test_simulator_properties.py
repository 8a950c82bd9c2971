"""Properties of the capacity simulator over random small traces (hypothesis).

With a budget that holds every request at once, nobody waits and the schedule is known
in closed form: a request arriving at step ``a`` holds ``prompt_len + j`` tokens per
sample at step ``a + j`` for ``j = 0 .. output_len``. The reference sums below are
computed from that schedule here, independently of the simulator.
"""

from __future__ import annotations

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from pagedbench.reference.kv_policies import Policy
from pagedbench.reference.simulator import simulate
from pagedbench.reference.workload import Request

MAX_CONTEXT = 64
#: Block sizes that divide MAX_CONTEXT (so one max-context sequence is whole blocks).
BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64)


@st.composite
def requests(draw, max_n: int = 3, max_arrival: int = 20, prefixes: bool = True) -> Request:
    prompt_len = draw(st.integers(1, MAX_CONTEXT - 1))
    output_len = draw(st.integers(1, MAX_CONTEXT - prompt_len))
    prefix_id = draw(st.sampled_from([None, "a", "b"])) if prefixes else None
    prefix_len = None if prefix_id is None else draw(st.integers(1, prompt_len))
    return Request(
        prompt_len=prompt_len,
        output_len=output_len,
        arrival=draw(st.integers(0, max_arrival)),
        prefix_id=prefix_id,
        prefix_len=prefix_len,
        n=draw(st.integers(1, max_n)),
    )


TRACES = st.lists(requests(), min_size=1, max_size=8)
#: n = 1, all queued at step 0, no prefixes: where contiguous concurrency peaks at step 0.
QUEUED_TRACES = st.lists(requests(max_n=1, max_arrival=0, prefixes=False), min_size=1, max_size=12)


def _ample(trace: list[Request]) -> int:
    """A budget holding every request's Max reservation at once (token slots)."""
    return sum(r.n for r in trace) * MAX_CONTEXT


def _reservation(name: str, total_len: int) -> int:
    if name == "Max":
        return MAX_CONTEXT
    if name == "Pow2":
        size = 1
        while size < total_len:
            size *= 2
        return min(size, MAX_CONTEXT)
    return total_len


def _closed_form(trace: list[Request], policy: Policy) -> dict[str, float]:
    """Sums over the known schedule: reserved, stored, never-used slots; running counts."""
    steps = max(r.arrival + r.output_len for r in trace) + 1
    running = [0] * steps
    reserved = stored = never_used = 0
    for r in trace:
        total = r.prompt_len + r.output_len
        for j in range(r.output_len + 1):
            running[r.arrival + j] += 1
            tokens = r.prompt_len + j
            stored += r.n * tokens
            if policy.paged:
                slots = -(-tokens // policy.block_size) * policy.block_size
                reserved += r.n * slots
                never_used += r.n * (slots - tokens)
            else:
                slots = _reservation(policy.name, total)
                reserved += r.n * slots
                never_used += r.n * (slots - total)
    return {
        "steps": steps,
        "peak": max(running),
        "mean_running": sum(running) / steps,
        "reserved": reserved,
        "stored": stored,
        "never_used": never_used,
    }


ALL_UNSHARED = [Policy("Max"), Policy("Pow2"), Policy("Oracle")] + [
    Policy("Paged", bs) for bs in BLOCK_SIZES
]


@pytest.mark.parametrize("policy", ALL_UNSHARED, ids=lambda p: p.label.replace(" ", "-"))
@given(trace=TRACES)
@example(trace=[Request(prompt_len=MAX_CONTEXT - 1, output_len=1)])
@example(trace=[Request(prompt_len=16, output_len=16), Request(prompt_len=17, output_len=1)])
def test_simulator_ample_budget_matches_closed_form(policy: Policy, trace: list[Request]) -> None:
    want = _closed_form(trace, policy)
    got = simulate(trace, policy, _ample(trace), MAX_CONTEXT)
    reserved = want["reserved"]
    assert got.steps == want["steps"]
    assert got.peak_concurrency == want["peak"]
    assert got.mean_concurrency == pytest.approx(want["mean_running"])
    assert got.waited == got.preemptions == 0
    assert got.mean_reserved_tokens == pytest.approx(reserved / want["steps"])
    assert got.mean_stored_tokens == pytest.approx(want["stored"] / want["steps"])
    assert got.fragmentation_pct == pytest.approx(100 * want["never_used"] / reserved)
    if policy.paged:
        # Paging reserves nothing past the current block: all waste is fragmentation.
        assert got.reservation_waste_pct == 0
    else:
        future = reserved - want["stored"] - want["never_used"]
        assert got.reservation_waste_pct == pytest.approx(100 * future / reserved)


@pytest.mark.parametrize("name", ["Paged", "Paged+share"])
@given(trace=TRACES, data=st.data())
def test_simulator_block_size_one_has_no_fragmentation(
    name: str, trace: list[Request], data: st.DataObject
) -> None:
    # Any budget from the largest single request up: waiting and preemption may happen.
    need = max(r.n * (r.prompt_len + r.output_len) for r in trace)
    budget = data.draw(st.integers(need, max(need, _ample(trace))), label="budget")
    result = simulate(trace, Policy(name, 1), budget, MAX_CONTEXT)
    assert result.fragmentation_pct == 0
    assert result.waste_pct == 0
    assert result.utilization_pct == 100


@given(trace=QUEUED_TRACES, budget=st.integers(MAX_CONTEXT, 6 * MAX_CONTEXT),
       block_size=st.sampled_from(BLOCK_SIZES))
def test_simulator_paged_peak_concurrency_at_least_contiguous(
    trace: list[Request], budget: int, block_size: int
) -> None:
    # Max runs at most budget // MAX_CONTEXT requests and reaches that at step 0; every
    # other policy needs no more memory than Max for each prompt, so admits at least as
    # many at step 0 (FCFS over the same queue).
    baseline = simulate(trace, Policy("Max"), budget, MAX_CONTEXT)
    assert baseline.peak_concurrency == min(len(trace), budget // MAX_CONTEXT)
    for policy in (Policy("Pow2"), Policy("Oracle"), Policy("Paged", block_size),
                   Policy("Paged+share", block_size)):
        result = simulate(trace, policy, budget, MAX_CONTEXT)
        assert result.peak_concurrency >= baseline.peak_concurrency, policy.label


@given(trace=TRACES, data=st.data(), block_size=st.sampled_from(BLOCK_SIZES))
def test_simulator_paged_mean_concurrency_at_least_max(
    trace: list[Request], data: st.DataObject, block_size: int
) -> None:
    need = max(r.n for r in trace) * MAX_CONTEXT
    budget = data.draw(st.integers(need, max(need, _ample(trace))), label="budget")
    baseline = simulate(trace, Policy("Max"), budget, MAX_CONTEXT)
    for name in ("Paged", "Paged+share"):
        result = simulate(trace, Policy(name, block_size), budget, MAX_CONTEXT)
        assert result.mean_concurrency >= baseline.mean_concurrency - 1e-9, name


@given(trace=TRACES, block_size=st.sampled_from(BLOCK_SIZES))
@example(trace=[Request(prompt_len=5, output_len=3, n=3)], block_size=4)
def test_simulator_sharing_never_holds_more_memory(trace: list[Request], block_size: int) -> None:
    # Ample budget: the same schedule; forked samples and prefix hits share physical
    # blocks, and copy-on-write copies at most the block each sample writes into.
    budget = _ample(trace)
    shared = simulate(trace, Policy("Paged+share", block_size), budget, MAX_CONTEXT)
    alone = simulate(trace, Policy("Paged", block_size), budget, MAX_CONTEXT)
    assert shared.steps == alone.steps
    assert shared.mean_reserved_tokens <= alone.mean_reserved_tokens
    assert shared.mean_stored_tokens <= alone.mean_stored_tokens
    if block_size == 1 or all(r.n == 1 for r in trace):
        assert shared.cow_copies == 0


@pytest.mark.parametrize("name", ["Max", "Pow2", "Oracle"])
@given(trace=TRACES, data=st.data())
def test_simulator_contiguous_runs_each_request_once(
    name: str, trace: list[Request], data: st.DataObject
) -> None:
    # A reservation covers every future token: no preemption, and each request runs
    # exactly output_len + 1 steps, whatever the budget (the steps themselves vary).
    need = max(r.n for r in trace) * MAX_CONTEXT
    budget = data.draw(st.integers(need, max(need, _ample(trace))), label="budget")
    result = simulate(trace, Policy(name), budget, MAX_CONTEXT)
    assert result.preemptions == 0
    assert result.mean_concurrency * result.steps == pytest.approx(
        sum(r.output_len + 1 for r in trace)
    )
