"""Budgets and the worker channel blame the right party: the implementation's timeout covers
only what its worker does (import, ``available``, ``prepare``, ``run``, timing);
pagedbench's own work (truth and comparison, in the judging parent) has its own budget and
status, so a timeout never blames the implementation for the harness's work; a plug-in that
writes into the worker's message pipe costs only its own case."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from pagedbench.harness.results.record import Environment, ResultRecord
from pagedbench.harness.results.store import environment
from pagedbench.harness.run import runner
from pagedbench.harness.run.runner import RunConfig, run_target
from pagedbench.harness.verdict.status import Status
from pagedbench.reference import PagedCase

from ..conftest import FAULTS

CASES = [PagedCase(kv_lens=(5, 17), num_q_heads=4, num_kv_heads=2, head_dim=32,
                   block_size=16, dtype="float32", name=n) for n in ("b1", "b2")]


def _run(impl: str, config: RunConfig) -> tuple[list[ResultRecord], float]:
    env = Environment.model_validate(environment("cpu"))
    records: list[ResultRecord] = []
    start = time.monotonic()
    target = FAULTS.get(impl, "pagedbench.adapters.torch_sdpa:TorchGather")
    run_target(impl, target, CASES, config, "t", env, records.append)
    return records, time.monotonic() - start


def test_a_slow_available_times_out_after_the_case_timeout(tmp_path) -> None:
    config = RunConfig(timing=False, case_timeout_s=2, cache_dir=tmp_path, threads=1)
    records, seconds = _run("slow-available", config)
    assert [(r.status, r.step) for r in records] == [(Status.TIMEOUT, "available")] * 2
    assert records[0].reason == "available took longer than 2 s (--case-timeout)"
    assert seconds < 60  # one worker start-up and 2 s, not 125 s


#: Seconds the slowed truth takes more than it should.
TRUTH_DELAY_S = 3.0


@pytest.fixture
def slow_truth(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every truth the judge (this process) computes takes :data:`TRUTH_DELAY_S` more."""
    original = runner.truth_for

    def slowed(case, cache_dir, logits_precision="float32", **variant):
        time.sleep(TRUTH_DELAY_S)
        return original(case, cache_dir, logits_precision, **variant)

    monkeypatch.setattr(runner, "truth_for", slowed)


def test_the_truth_is_not_charged_to_the_implementation(tmp_path, slow_truth) -> None:
    """Each truth takes 3 s more than it should, the case timeout is 2 s: the correct
    implementation passes."""
    config = RunConfig(timing=False, case_timeout_s=2, harness_timeout_s=120,
                       cache_dir=tmp_path, threads=1)
    records, _ = _run("torch-gather", config)
    assert [r.status for r in records] == [Status.PASS] * 2, [r.reason for r in records]


def test_a_truth_past_the_harness_budget_is_a_harness_error(tmp_path, slow_truth) -> None:
    config = RunConfig(timing=False, case_timeout_s=120, harness_timeout_s=1.5,
                       cache_dir=tmp_path, threads=1)
    records, _ = _run("torch-gather", config)
    assert [(r.status, r.step) for r in records] == [(Status.HARNESS_ERROR, "truth")] * 2
    assert records[0].reason == ("pagedbench's truth: took longer than 1.5 s "
                                 "(--harness-timeout); not the implementation's fault")


def _threads_of_a_new_thread() -> int:
    """The intra-op thread count a thread started now takes (torch's process-wide one)."""
    seen: list[int] = []
    thread = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
    thread.start()
    thread.join()
    return seen[0]


def _join_judge_threads() -> None:
    """Wait for the judge threads still running past their budget (each is at most two
    slowed truths from its end)."""
    for thread in threading.enumerate():
        if thread.name.startswith("judge-"):
            thread.join(4 * TRUTH_DELAY_S)


def test_judge_threads_left_past_their_budget_restore_the_callers_torch_state(
        tmp_path, slow_truth) -> None:
    """Two judge threads overlap here (the first is still in its truth when the second
    case's begins). Once both have ended, the caller has its own default dtype and thread
    counts back: the judge once set the thread count from its threads, and the overlap left
    the process at its ``threads=1`` (a compiled flex-paged kernel in this process then
    failed its ``GLOBAL_STATE`` guard)."""
    _join_judge_threads()  # the previous test's, past their budget too
    before = torch.get_num_threads()
    torch.set_num_threads(2)  # a count other than the job's 1, whatever OMP_NUM_THREADS says
    caller_threads, process_threads = torch.get_num_threads(), _threads_of_a_new_thread()
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        config = RunConfig(timing=False, case_timeout_s=120, harness_timeout_s=1.0,
                           cache_dir=tmp_path, threads=1)
        records, _ = _run("torch-gather", config)
        _join_judge_threads()
        assert [(r.status, r.step) for r in records] == [(Status.HARNESS_ERROR, "truth")] * 2
        assert torch.get_default_dtype() == torch.float64
    finally:
        torch.set_default_dtype(default)
        after = torch.get_num_threads(), _threads_of_a_new_thread()
        torch.set_num_threads(before)
    assert after == (caller_threads, process_threads) == (2, 2)


def test_a_plugin_writing_into_the_channel_costs_its_case_an_error(tmp_path) -> None:
    config = RunConfig(timing=False, cache_dir=tmp_path, threads=1)
    records, _ = _run("writes-into-the-channel", config)
    assert [(r.status, r.step) for r in records] == [(Status.ERROR, "run")] * 2
    assert records[0].reason == ("worker sent a line that is not a message: "
                                 "b'not a message' during run")
