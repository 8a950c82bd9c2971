"""A case crosses to the worker once, as JSON data in its job, and is never parsed back in
the parent: the plan keeps the ``PagedCase`` objects it was made of and every record the
one it was made for (docs/ARCHITECTURE.md, "One case, from the runner to the results
file"). Reading a results file parses each case once."""

from __future__ import annotations

from collections import Counter

from pagedbench.harness.results.record import Plan
from pagedbench.harness.results.store import ResultsFile, results_of
from pagedbench.harness.run.runner import RunConfig, make_plan, run
from pagedbench.harness.verdict.status import Status
from pagedbench.reference import PagedCase

CASES = [PagedCase(kv_lens=(3, 9), num_q_heads=2, num_kv_heads=1, head_dim=8, block_size=4,
                   dtype="float32", name=f"crossing{i}", seed=i) for i in range(2)]


def _counted(monkeypatch) -> Counter:
    """Count ``PagedCase.from_dict`` calls in this process."""
    calls: Counter = Counter()
    parse = PagedCase.from_dict.__func__

    def from_dict(cls, data):
        calls["from_dict"] += 1
        return parse(cls, data)

    monkeypatch.setattr(PagedCase, "from_dict", classmethod(from_dict))
    return calls


def test_the_parent_parses_no_case_of_a_run(tmp_path, monkeypatch) -> None:
    calls = _counted(monkeypatch)
    plan = make_plan({"torch-gather": "pagedbench.adapters.torch_sdpa:TorchGather"}, CASES)
    assert all(a is b for a, b in zip(plan.paged_cases(), CASES))
    results = ResultsFile(tmp_path / "r1.jsonl")
    records = run(plan, RunConfig(timing=False, cache_dir=tmp_path / "cache"), results, "r1")
    assert [r.status for r in records] == [Status.PASS, Status.PASS]
    assert [r.paged_case() for r in records] == CASES
    assert all(r.paged_case() is c for r, c in zip(records, CASES))
    assert calls["from_dict"] == 0, "the parent parsed a case it had serialised"
    # Read back: each case of the started line's plan and of each result parsed once,
    # however often it is asked for.
    read = results_of(results.lines())
    assert calls["from_dict"] == 2 * len(CASES)
    assert [r.paged_case() for r in read for _ in range(3)] == [c for c in CASES for _ in range(3)]
    assert calls["from_dict"] == 2 * len(CASES)


def test_a_plan_read_from_json_parses_each_case_once(monkeypatch) -> None:
    plan = make_plan({"a": "x:A"}, CASES)
    calls = _counted(monkeypatch)
    again = Plan.model_validate_json(plan.model_dump_json())
    assert again.paged_cases() == CASES and again.paged_cases() == CASES
    assert calls["from_dict"] == len(CASES)
