"""The device truth (``harness/verdict/truth.py``): a point whose truth the host cannot hold is
drawn on the run's device and its float64 reference computed there. Forced on small cases
on the CPU it gives the host truth's verdicts and figures for correct implementations and
fails wrong ones; a point whose truth fits neither the host budget nor the device is left
out with why, and the started record says so."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from pagedbench.adapters import entries, load
from pagedbench.harness import cli
from pagedbench.harness.cases.workloads import grid_workload
from pagedbench.harness.verdict import conformance, judging, truth
from pagedbench.harness.verdict.status import Status
from pagedbench.reference import PagedCase, PagedValueError, materialize

from ..conftest import BROKEN

#: Llama-3-8B decode heads (32 q / 8 KV, head_dim 128) at bf16, kv_len 200 (not a
#: multiple of the block size: a partly filled last block), three sequences.
DECODE = grid_workload("decode", "llama3.1-8b", 3, 200).case(16, "bfloat16")
#: Ragged prefill chunks and a decode row, float16, GQA 4.
RAGGED = PagedCase(kv_lens=(17, 40, 5), q_lens=(1, 7, 5), num_q_heads=8, num_kv_heads=2,
                   head_dim=64, block_size=16, dtype="float16", name="ragged")
#: 2**20 tokens (the longest sequence a batch spec takes) of 8 KV heads x 128, in a batch of
#: HUGE_BATCH (2**24 tokens, the most a batch takes): 128 GiB of float32 K/V, which fits
#: neither the host budget nor the memory of any CI host (never materialized).
HUGE_CONTEXT = 2**20
HUGE_BATCH = 16
CORRECT = ("sdpa-contiguous", "torch-gather")
WRONG = {"fault-last-block-unmasked": "pagedbench.suites.faults.addressing:LastBlockUnmasked",
         "broken-perturbs-last-sequence": f"{BROKEN}:PerturbsLastSequence"}


def _target(name: str) -> str:
    return {e.name: e.target for e in entries()}[name]


def _figures(verdict: judging.Verdict) -> dict:
    """The comparison's fields, NaN as None (so that equal figures compare equal)."""
    return {k: None if isinstance(v, float) and math.isnan(v) else v
            for k, v in dataclasses.asdict(verdict.comparison).items()}


@pytest.mark.parametrize("case", [DECODE, RAGGED], ids=lambda c: c.case_id)
def test_inputs_drawn_on_the_cpu_device_are_the_hosts(case: PagedCase) -> None:
    host, device = materialize(case, "cpu"), materialize(case, "cpu", on_device=True)
    for name in ("q", "kv_cache", "block_tables", "kv_lens", "cu_seqlens_q", "slot_mapping"):
        torch.testing.assert_close(getattr(device, name), getattr(host, name), rtol=0,
                                   atol=0, equal_nan=True, msg=name)


@pytest.mark.parametrize("name", CORRECT)
@pytest.mark.parametrize("case", [DECODE, RAGGED], ids=lambda c: c.case_id)
def test_device_truth_gives_the_host_verdict_and_figures(name: str, case: PagedCase) -> None:
    adapter = load(_target(name))
    host = conformance.check(adapter, case, "cpu")
    device = conformance.check(adapter, case, "cpu", truth_site="device")
    assert (host.status, device.status) == (Status.PASS, Status.PASS), (host, device)
    assert (host.truth_site, device.truth_site) == ("host", "device")
    assert _figures(device) == _figures(host)
    assert 0 < device.comparison.max_err_ulps <= 4  # the rounding of a correct bf16/fp16 output


@pytest.mark.parametrize("name", list(WRONG))
def test_device_truth_fails_a_wrong_implementation(name: str) -> None:
    adapter = load(WRONG[name])
    host = conformance.check(adapter, DECODE, "cpu")
    device = conformance.check(adapter, DECODE, "cpu", truth_site="device")
    assert (host.status, device.status) == (Status.FAIL, Status.FAIL), (host, device)
    assert device.step == "compare" and device.reason == host.reason
    assert _figures(device) == _figures(host)
    assert device.comparison.err_over_allowance > 1 or "non-finite" in device.reason
    if name == "broken-perturbs-last-sequence":  # only its last sequence is wrong
        assert device.reason.startswith(f"sequence {DECODE.batch_size - 1}:"), device.reason


def test_device_truth_is_cached_and_checked_by_q(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    inputs = materialize(DECODE, "cpu", on_device=True)
    first = truth.device_truth_for(inputs, tmp_path)
    expected = truth.compute_device_truth(inputs)
    assert torch.equal(first.truth, expected.truth) and torch.equal(first.naive, expected.naive)
    (stored,) = (tmp_path / "truth").glob("device-*.npz")

    def recompute(*args: object, **kwargs: object) -> None:
        raise AssertionError("recomputed although a valid file is cached")

    with monkeypatch.context() as patch:
        patch.setattr(truth, "compute_device_truth", recompute)
        again = truth.device_truth_for(inputs, tmp_path)
    assert torch.equal(again.truth, first.truth)
    with np.load(stored) as saved:  # a device that drew other values: another Q
        data = dict(saved)
    np.savez(stored, **data | {"q": data["q"] + 1})
    with pytest.warns(UserWarning, match="Q is not these inputs'"):
        replaced = truth.device_truth_for(inputs, tmp_path)
    assert torch.equal(replaced.truth, expected.truth)
    np.savez(stored, **data | {"truth": np.zeros_like(data["truth"])})  # the original Q
    with pytest.warns(UserWarning, match="HMAC does not match"):
        replaced = truth.device_truth_for(inputs, tmp_path)
    assert torch.equal(replaced.truth, expected.truth)


def test_truth_site_by_size() -> None:
    assert truth.truth_site(DECODE, "cpu") == "host"
    assert truth.truth_site(DECODE, "cpu", host_bytes=truth.truth_bytes(DECODE)) == "host"
    assert truth.truth_site(DECODE, "cpu", host_bytes=truth.truth_bytes(DECODE) - 1) == "device"
    huge = DECODE.with_(kv_lens=(HUGE_CONTEXT,) * 2, q_lens=None, num_blocks=None)
    assert truth.truth_bytes(huge) > 2 * HUGE_CONTEXT * 8 * 128 * 2  # K and V of both
    with pytest.raises(PagedValueError, match=r"needs .* GB, more than the host budget") as e:
        truth.truth_site(huge, "cpu", host_bytes=0)
    assert e.value.parameter == "kv_lens"


def _bench(out: Path, *extra: str) -> tuple[list[dict], dict]:
    code = cli.main(["bench", "--quick", "--mode", "decode", "--impl", "torch-gather",
                     "--baseline", "torch-gather", "--batch-size", str(HUGE_BATCH),
                     "--context", "64", "--context", str(HUGE_CONTEXT), "--no-peaks", "--results-dir", str(out),
                     "--cache-dir", str(out / "cache"), *extra])
    assert code == 0
    (path,) = out.glob("*.jsonl")
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    return ([r for r in lines if r["kind"] == "result"],
            next(r for r in lines if r.get("event") == "started"))


def test_bench_leaves_out_what_fits_nowhere_and_records_the_truth(tmp_path: Path) -> None:
    """Forced device truths give the host truths' verdicts and figures through the whole
    bench path (workers, records); the huge context's points are left out with why."""
    host, host_start = _bench(tmp_path / "host")
    device, device_start = _bench(tmp_path / "device", "--host-truth-bytes", "0")
    assert {r["truth"] for r in host} == {"host"} and {r["truth"] for r in device} == {"device"}
    assert [r["case_id"] for r in device] == [r["case_id"] for r in host]
    assert len(host) == 3 and all("-kv64" in r["case_id"] for r in host)
    figures = ("status", "max_abs_err", "max_err_ulps", "mean_err_ulps", "naive_abs_err",
               "err_over_allowance", "worst_index")
    for h, d in zip(host, device):
        assert {k: d[k] for k in figures} == {k: h[k] for k in figures}
        assert h["status"] == "pass"
    for start in (host_start, device_start):
        assert len(start["left_out"]) == 3, start["left_out"]
        assert all(f"-kv{HUGE_CONTEXT}" in note for note in start["left_out"]), (
            start["left_out"])
        assert all("GB" in note for note in start["left_out"])
