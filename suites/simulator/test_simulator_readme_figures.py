"""The figures README.md publishes for ``pagedbench simulate`` with no arguments, pinned.

A regression guard, not an oracle: the values are the README's table (Llama-3.1-8B bf16,
4 GiB of KV = 32768 token slots, max context 2048, 1000 generated requests, seed 0), as
``pagedbench simulate`` printed them when they were published. A change to the schedule,
the policies or the allocator that moves any of them must update the README with them.
"""

from __future__ import annotations

import pytest

from pagedbench.harness.traces import generate_trace
from pagedbench.reference.kv_policies import Policy
from pagedbench.reference.simulator import compare_policies

KV_BUDGET_TOKENS = 32_768  # 4 GiB / 131072 bytes per token
NUM_REQUESTS = 1000

#: policy -> (tokens %, reservation %, fragmentation %, mean concurrency, vs Max), README.
README = {
    "Max": (20.5, 12.9, 66.6, 15.4, 1.00),
    "Pow2": (43.8, 27.7, 28.5, 31.8, 2.07),
    "Oracle": (61.3, 38.7, 0.0, 43.0, 2.80),
    "Paged bs16": (98.2, 0.0, 1.8, 62.4, 4.06),
    "Paged bs32": (96.4, 0.0, 3.6, 61.3, 3.99),
}


def test_default_simulation_reproduces_the_readme_table():
    trace = generate_trace(NUM_REQUESTS, seed=0)
    policies = [Policy("Max"), Policy("Pow2"), Policy("Oracle"), Policy("Paged", 16),
                Policy("Paged", 32)]
    results = compare_policies(trace, policies, KV_BUDGET_TOKENS)
    for policy, result in zip(policies, results):
        got = (
            round(result.utilization_pct, 1),
            round(result.reservation_waste_pct, 1),
            round(result.fragmentation_pct, 1),
            round(result.mean_concurrency, 1),
            round(result.concurrency_ratio, 2),
        )
        assert got == pytest.approx(README[policy.label]), policy.label
