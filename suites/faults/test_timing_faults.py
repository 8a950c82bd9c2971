"""The timing cheats of ``suites/faults/timing.py`` as ``pagedbench run`` meets them: each
ends as a ``fail`` of step ``timing`` (a judged call's output, or the idle check after
the timing), with no time, never ranked; the catalogue's correct kernel beside them in the
same run passes with its time, as does a correct one whose declarations take a while (the
work of its next case is not the timing's). A cheat that new inputs before every timed call defeat
(``defeated.py``) does the work of every timed call."""

from __future__ import annotations

from pagedbench.harness.results.store import ResultsFile
from pagedbench.harness.run.runner import RunConfig, make_plan, run
from pagedbench.harness.run.summary import ranked
from pagedbench.harness.verdict import conformance
from pagedbench.harness.verdict.status import Status
from pagedbench.reference import PagedCase
from pagedbench.suites.faults.defeated import SentinelMemo
from pagedbench.suites.faults.kernel import FAULT_LOG

TARGETS = {
    "catalogue-control": "pagedbench.suites.faults.kernel:PagedKernel",
    "fault-memo-per-input": "pagedbench.suites.faults.timing:MemoPerInput",
    "fault-memo-sampled-cache": "pagedbench.suites.faults.timing:SampledCacheMemo",
    "fault-work-in-prepare": "pagedbench.suites.faults.timing:WorkInPrepare",
    "fault-deferred-to-thread": "pagedbench.suites.faults.timing:DeferredToThread",
    "fault-lazy-output": "pagedbench.suites.faults.timing:LazyOutput",
    "slow-declarations": "pagedbench.suites.harness.plugins.misbehaving:SlowDeclarations",
}
#: Correct implementations of :data:`TARGETS`: each passes with its time.
CORRECT = ("catalogue-control", "slow-declarations")
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
    for record in (r for impl in CORRECT for r in by_impl.pop(impl)):
        assert record.status is Status.PASS and record.time_ms is not None, record.reason
        assert ranked(record)
    for impl, mine in by_impl.items():
        for record in mine:
            assert (record.status, record.step) == (Status.FAIL, "timing"), (impl, record.reason)
            # A judged call's stale output, an output whose work waits until it is read,
            # or (a thread queued earlier may happen to compute on the new inputs in
            # time) the CPU it used beside the timed calls or still used after them:
            # which one comes first depends on how the host schedules that thread.
            assert ("run on new inputs written into its buffers" in record.reason
                    or "not a torch.Tensor: a tensor subclass" in record.reason
                    or "more than the 1 thread(s) the run grants" in record.reason
                    or "work still running after run() returned" in record.reason), \
                record.reason
            assert record.time_ms is None and not ranked(record)
            assert record.reason.endswith(f"--impl {impl} --timed"), record.reason


def test_a_memo_checked_against_sampled_inputs_does_the_work_of_every_call(
        tmp_path, monkeypatch) -> None:
    """New Q before every timed call: :class:`~.defeated.SentinelMemo`, which returns its
    stored output while 8 values of Q and 64 cache slots are unchanged (it did 0.0128 ms
    against 5.045 ms when new inputs came before three samples only), never returns it in a
    timed run, so its time is its work's; on inputs left as they were it does return it,
    and logs that."""
    log = tmp_path / "fired.log"
    monkeypatch.setenv(FAULT_LOG, str(log))
    memo = SentinelMemo()
    prepared = memo.prepare(conformance.inputs_for(memo, CASES[0], "cpu"))
    first = prepared.call()
    assert prepared.call() is first and log.read_text() == f"{memo.name}\n"
    log.unlink()

    targets = {memo.name: "pagedbench.suites.faults.defeated:SentinelMemo"}
    config = RunConfig(timing=True, warmup=1, repetitions=4, time_budget_s=0.05,
                       time_limit_s=1.0, threads=1, cache_dir=tmp_path / "build")
    records = run(make_plan(targets, CASES), config, ResultsFile(tmp_path / "r.jsonl"), "t")
    memo_records = [r for r in records if r.impl == memo.name]
    assert len(memo_records) == len(CASES)
    for record in memo_records:
        assert record.status is Status.PASS and record.time_ms is not None, record.reason
        assert record.time_ms.n >= 4, record.time_ms
    assert not log.exists(), "a timed call returned the output kept from an earlier call"
