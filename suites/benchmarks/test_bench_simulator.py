"""Benchmark: the capacity simulator on a 10,000-request trace (pytest-benchmark).

One round per policy (a paged policy drives the reference allocator for every decoded
token, so a round takes seconds): ``Max`` (slot arithmetic only) and ``Paged`` at
block_size 16. ``extra_info`` carries the tokens decoded, so
tokens per second = ``decode_tokens / time``.
"""

from __future__ import annotations

import pytest

from pagedbench.harness.capacity.traces import generate_trace
from pagedbench.reference.kv_policies import Policy
from pagedbench.reference.simulator import simulate
from pagedbench.reference.workload import DEFAULT_MAX_CONTEXT, Request

pytestmark = pytest.mark.bench

NUM_REQUESTS = 10_000
#: 4 GiB of K/V at llama3.1-8b bfloat16 (131072 bytes per token): `pagedbench simulate`'s default.
KV_BUDGET_TOKENS = 32_768


@pytest.fixture(scope="module")
def trace() -> list[Request]:
    return generate_trace(NUM_REQUESTS, DEFAULT_MAX_CONTEXT, seed=0)


@pytest.mark.parametrize(
    "policy",
    [Policy("Max"), Policy("Paged", 16)],
    ids=lambda p: p.label.replace(" ", "-"),
)
def test_bench_simulator_10k_requests(benchmark, trace: list[Request], policy: Policy) -> None:
    benchmark.group = "simulator-10k"
    result = benchmark.pedantic(
        simulate, args=(trace, policy, KV_BUDGET_TOKENS, DEFAULT_MAX_CONTEXT), rounds=1,
        iterations=1,
    )
    decode_tokens = sum(r.n * r.output_len for r in trace)
    benchmark.extra_info.update(
        requests=NUM_REQUESTS, steps=result.steps, decode_tokens=decode_tokens,
        preemptions=result.preemptions,
    )
    # Every request ran to the end: output_len + 1 steps each, more after a preemption.
    request_steps = sum(r.output_len + 1 for r in trace)
    if policy.paged:
        assert result.mean_concurrency * result.steps >= request_steps
    else:
        assert result.mean_concurrency * result.steps == pytest.approx(request_steps)
