"""The figures docs/allocator.md publishes for ``pagedbench simulate`` with no arguments.

A regression guard, not an oracle: the test reads the table of docs/allocator.md
(Llama-3.1-8B bf16, 4 GiB of KV = 32768 token slots, max context 2048, 1000 generated
requests, seed 0) and checks that the simulator still gives every figure in it. A change
to the schedule, the policies or the allocator that moves any of them must update that
table with them.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pagedbench.harness.capacity.traces import generate_trace
from pagedbench.reference.kv_policies import Policy
from pagedbench.reference.simulator import compare_policies

PAGE = Path(__file__).resolve().parents[2] / "docs" / "allocator.md"
KV_BUDGET_TOKENS = 32_768  # 4 GiB / 131072 bytes per token
NUM_REQUESTS = 1000
#: A row of the page's table: policy | tokens % | waste % (reservation + fragmentation) |
#: mean concurrency | ratio to Max.
ROW = re.compile(r"^\| (Max|Pow2|Oracle|Paged, block_size (\d+)) \| ([\d.]+)% \| [\d.]+% "
                 r"\(([\d.]+) \+ ([\d.]+)\) \| ([\d.]+) \| ([\d.]+)x \|$", re.M)


def published() -> dict[Policy, tuple[float, ...]]:
    """``Policy -> (tokens %, reservation %, fragmentation %, mean concurrency, vs Max)``,
    read from the page."""
    rows = {}
    for match in ROW.finditer(PAGE.read_text()):
        name, block_size, *figures = match.groups()
        policy = Policy("Paged", int(block_size)) if block_size else Policy(name)
        rows[policy] = tuple(map(float, figures))
    return rows


def test_published_table_has_every_policy():
    assert [p.label for p in published()] == [
        "Max", "Pow2", "Oracle", "Paged bs16", "Paged bs32"]


def test_default_simulation_reproduces_the_published_table():
    rows = published()
    policies = list(rows)
    results = compare_policies(generate_trace(NUM_REQUESTS, seed=0), policies, KV_BUDGET_TOKENS)
    for policy, result in zip(policies, results):
        got = (
            round(result.utilization_pct, 1),
            round(result.reservation_waste_pct, 1),
            round(result.fragmentation_pct, 1),
            round(result.mean_concurrency, 1),
            round(result.concurrency_ratio, 2),
        )
        assert got == pytest.approx(rows[policy]), policy.label
