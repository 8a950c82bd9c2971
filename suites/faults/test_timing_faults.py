"""The timing cheats of ``suites/faults/timing.py`` as ``pagedbench run`` meets them: each
ends as a ``fail`` of step ``timing`` (a refreshed call's output, or the idle check after
the timing), with no time, never ranked; the catalogue's correct kernel beside them in the
same run passes with its time. A cheat still open (``open_gaps.py``) passes, ranked: the
test that says so fails the day it is caught."""

from __future__ import annotations

from pagedbench.harness.results.store import ResultsFile
from pagedbench.harness.run.runner import RunConfig, make_plan, run
from pagedbench.harness.run.summary import ranked
from pagedbench.harness.verdict.status import Status
from pagedbench.reference import PagedCase

TARGETS = {
    "catalogue-control": "pagedbench.suites.faults.kernel:PagedKernel",
    "fault-memo-per-input": "pagedbench.suites.faults.timing:MemoPerInput",
    "fault-work-in-prepare": "pagedbench.suites.faults.timing:WorkInPrepare",
    "fault-deferred-to-thread": "pagedbench.suites.faults.timing:DeferredToThread",
}
#: Two small decode cases, partly filled last blocks.
CASES = [PagedCase(kv_lens=(19, 40), num_q_heads=4, num_kv_heads=2, head_dim=64,
                   block_size=16, dtype="float16", name=n) for n in ("t1", "t2")]


def test_timing_cheats_fail_step_timing_and_are_never_ranked(tmp_path) -> None:
    config = RunConfig(timing=True, warmup=1, repetitions=4, time_budget_s=0.05,
                       time_limit_s=1.0, threads=1, cache_dir=tmp_path / "build")
    records = run(make_plan(TARGETS, CASES), config, ResultsFile(tmp_path / "r.jsonl"), "t")
    by_impl: dict[str, list] = {}
    for record in records:
        by_impl.setdefault(record.impl, []).append(record)
    assert set(by_impl) == set(TARGETS) and all(len(v) == len(CASES) for v in by_impl.values())
    for record in by_impl.pop("catalogue-control"):
        assert record.status is Status.PASS and record.time_ms is not None, record.reason
        assert ranked(record)
    for impl, mine in by_impl.items():
        for record in mine:
            assert (record.status, record.step) == (Status.FAIL, "timing"), (impl, record.reason)
            # A refreshed call's stale output, or (a thread queued earlier may happen to
            # compute on the new inputs in time) the CPU it still used after the timing.
            assert ("new inputs were written into its buffers" in record.reason
                    or "work still running after run() returned" in record.reason), \
                record.reason
            assert record.time_ms is None and not ranked(record)
            assert record.reason.endswith(f"--impl {impl} --timed"), record.reason


def test_open_gap_a_memo_checked_against_sampled_inputs_passes_and_is_ranked(tmp_path) -> None:
    """The hole docs/trust.md names: a CPU sample is a block of calls and new inputs come
    before only a few of them, so :class:`~.open_gaps.SentinelMemo` is right on every
    call and timed at its comparison. The day a defence catches it, this fails: move the
    kernel into the catalogue (``timing.py``, ``site/``) and assert the catch instead."""
    targets = {"catalogue-control": TARGETS["catalogue-control"],
               "open-sentinel-memo": "pagedbench.suites.faults.open_gaps:SentinelMemo"}
    config = RunConfig(timing=True, warmup=1, repetitions=4, time_budget_s=0.05,
                       time_limit_s=1.0, threads=1, cache_dir=tmp_path / "build")
    records = run(make_plan(targets, CASES), config, ResultsFile(tmp_path / "r.jsonl"), "t")
    control = {r.case_id: r for r in records if r.impl == "catalogue-control"}
    memo = [r for r in records if r.impl == "open-sentinel-memo"]
    assert len(memo) == len(CASES)
    for record in memo:
        assert record.status is Status.PASS and ranked(record), record.reason
        assert record.time_ms.median < control[record.case_id].time_ms.median, \
            (record.time_ms, control[record.case_id].time_ms)
