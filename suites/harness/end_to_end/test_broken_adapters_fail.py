"""The suite can fail: broken implementations are reported ``fail``/``crash``/``timeout``,
and the other implementations' results survive in the same results file. (``pagedbench
run`` with a broken plug-in registered exits 1 in ``results/test_junit.py``, whose run
holds one.)"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from pagedbench.adapters import Adapter, Availability, Capabilities, load
from pagedbench.harness.results.record import ResultRecord
from pagedbench.harness.results.store import ResultsFile, read_lines
from pagedbench.harness.run.runner import RunConfig, make_plan, run
from pagedbench.harness.verdict import conformance
from pagedbench.harness.verdict.status import ExitCode, Status
from pagedbench.reference import PagedCase

from ..conftest import BROKEN

CASE = PagedCase(kv_lens=(1, 16, 17, 40), num_q_heads=4, num_kv_heads=2, head_dim=64,
                 block_size=16, dtype="float32", sm_scale=0.2, name="neg")


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("cls", ["ReadsPastKvLen", "IgnoresBlockTable", "IgnoresSmScale",
                                 "ReadsPastKvLenDeclaredNanUnsafe"])
def test_broken_adapter_is_reported_fail(cls, seed) -> None:
    adapter = load(f"{BROKEN}:{cls}")
    verdict = conformance.check(adapter, CASE.with_(seed=seed), "cpu")
    assert verdict.status is Status.FAIL, verdict
    assert verdict.reason and verdict.step == "compare"
    assert verdict.tail_poison == conformance.tail_poison(adapter.capabilities("cpu"))


class _ZeroWeightsTail(Adapter):
    """Correct attention that, like vLLM's CPU op, multiplies the tail V rows of each last
    block by zero weights (so NaN there propagates) and declares it."""

    name = "zero-weights-tail"

    def capabilities(self, device: str) -> Capabilities:
        return Capabilities(devices=frozenset({"cpu"}), dtypes=frozenset({"float32"}),
                            nan_safe_tail=False)

    def available(self, device: str = "cpu") -> Availability:
        return Availability(True, version="test")

    def prepare(self, inputs):
        return inputs

    def run(self, inputs):
        bs = inputs.case.block_size
        out = torch.empty_like(inputs.q)
        for i, kv_len in enumerate(inputs.kv_lens.tolist()):
            n = -(-kv_len // bs) * bs  # whole blocks, tail included
            pos = torch.arange(n)
            blocks = inputs.block_tables[i, pos // bs].long()
            k, v = inputs.kv_cache[blocks, 0, pos % bs], inputs.kv_cache[blocks, 1, pos % bs]
            k = k.repeat_interleave(inputs.case.gqa_ratio, dim=1)  # [n, hq, d]
            v = v.repeat_interleave(inputs.case.gqa_ratio, dim=1)
            scores = torch.einsum("hd,khd->hk", inputs.q[i] * inputs.case.scale, k)
            weights = torch.softmax(scores.masked_fill(pos >= kv_len, float("-inf")), dim=-1)
            out[i] = torch.einsum("hk,khd->hd", weights, v)  # 0 * NaN in the tail
        return out


def test_declared_nan_unsafe_adapter_passes_on_stale_tails_and_the_probe_is_recorded() -> None:
    verdict = conformance.check(_ZeroWeightsTail(), CASE, "cpu")
    assert verdict.status is Status.PASS, verdict
    assert verdict.tail_poison == "stale"
    assert verdict.nan_tail_output_finite is False


def test_resolved_sub_kernel_is_described() -> None:
    """``describe(prepared)`` reaches the verdict (and so the record's ``impl_details``)."""
    from pagedbench.adapters.vllm_cpu import VllmCpu

    adapter = VllmCpu()
    availability = adapter.available("cpu")
    if not availability.ok:
        pytest.skip(f"vllm-cpu unavailable: {availability.reason}")
    case = CASE.with_(head_dim=80)  # head_dim % 32 != 0: vLLM takes the vec16 kernel
    verdict = conformance.check(adapter, case, "cpu")
    assert verdict.status is Status.PASS, verdict
    assert verdict.details["isa"] == "vec16"


def test_crash_and_hang_are_isolated(tmp_path) -> None:
    """A worker that aborts or hangs costs only its own case; the good implementation's
    results and the remaining cases are all there."""
    cases = [CASE, CASE.with_(kv_lens=(5,), name="neg2")]
    results = ResultsFile(tmp_path / "run.jsonl")
    plan = make_plan({"broken-aborts": f"{BROKEN}:Aborts", "broken-hangs": f"{BROKEN}:Hangs",
                      "torch-gather": "pagedbench.adapters.torch_sdpa:TorchGather"}, cases)
    config = RunConfig(timing=False, case_timeout_s=5, cache_dir=tmp_path, threads=1)
    records = run(plan, config, results, "t")
    got = {(r.impl, r.case_id): (r.status, r.step) for r in records}
    assert got == {
        ("broken-aborts", cases[0].case_id): (Status.CRASH, "run"),
        ("broken-aborts", cases[1].case_id): (Status.CRASH, "run"),
        ("broken-hangs", cases[0].case_id): (Status.TIMEOUT, "run"),
        ("broken-hangs", cases[1].case_id): (Status.TIMEOUT, "run"),
        ("torch-gather", cases[0].case_id): (Status.PASS, None),
        ("torch-gather", cases[1].case_id): (Status.PASS, None),
    }
    assert "SIGABRT" in records[0].reason and "5 s" in records[2].reason
    on_disk = [r for r in read_lines([results.path]) if isinstance(r, ResultRecord)]
    assert on_disk == records


def test_a_crash_right_after_a_result_blames_the_right_case(tmp_path) -> None:
    """The result sent just before the crash is kept, and the crash is recorded against
    the case that was running (a queue with a feeder thread lost both)."""
    names = ["a", "b", "abort", "d"]
    cases = [CASE.with_(name=n, kv_lens=(5,)) for n in names]
    records = run(make_plan({"early": f"{BROKEN}:AbortsBeforeCaseNamedAbort"}, cases),
                  RunConfig(timing=False, cache_dir=tmp_path, threads=1),
                  ResultsFile(tmp_path / "r.jsonl"), "t")
    assert [(r.case["name"], r.status) for r in records] == [
        ("a", Status.PASS), ("b", Status.PASS), ("abort", Status.CRASH), ("d", Status.PASS)]


CLI = [sys.executable, "-m", "pagedbench.harness.cli"]
ONE_PRESET = ["--preset", "llama3.1-70b-tp8", "--block-size", "16", "--no-timing"]


def test_pagedbench_run_exits_0_when_all_pass(tmp_path) -> None:
    # Timed, at COLUMNS=120, in a folder of its own as `make run` runs in the checkout
    # (its results/ and build/ relative, as the paths it prints): what follows the
    # progress lines fits in 120 columns and names the fastest pass of each case.
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"} | {"COLUMNS": "120"}
    proc = subprocess.run(
        [*CLI, "run", *ONE_PRESET[:-1], "--repetitions", "1", "--impl", "torch-gather",
         "--results-dir", "results", "--cache-dir", "build"],
        capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path,
    )
    assert proc.returncode == ExitCode.CLEAN, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    (done,) = (i for i, line in enumerate(lines) if line.startswith("[2/2 "))
    after = lines[done + 1:]
    assert after and max(map(len, after)) <= 120, [line for line in after if len(line) > 120]
    assert any(line.split()[:2] == ["llama3.1-70b-tp8", "bf16"] and "torch-gather" in line
               for line in after), after
    assert after[-1].startswith("report: ") and after[-1].endswith(".md")
    (jsonl,) = (tmp_path / "results").glob("*.jsonl")
    statuses = [r.status for r in read_lines([jsonl]) if isinstance(r, ResultRecord)]
    assert statuses == [Status.PASS, Status.PASS]  # the full and the reduced case at bs 16
