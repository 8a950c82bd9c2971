"""A catalogue of hostile plug-ins: each tries to forge its own verdict, its timing or
another implementation's verdict from inside its worker; each ends as a ``fail``, ``error``
or ``timeout`` of its own, and the correct built-in beside it in the same run gets exactly
the verdicts and figures it gets alone."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from pagedbench.harness.results.record import ResultRecord
from pagedbench.harness.results.store import ResultsFile
from pagedbench.harness.run.runner import RunConfig, make_plan, run
from pagedbench.harness.verdict.status import ExitCode, Status, exit_code
from pagedbench.harness.verdict.truth import compute_truth
from pagedbench.reference import PagedCase

HOSTILE = "pagedbench.suites.harness.plugins.hostile"
BUILTIN = {"sdpa-contiguous": "pagedbench.adapters.torch_sdpa:SdpaContiguous"}
#: Two tiny cases (bf16, GQA 2, partly filled last blocks).
CASES = [PagedCase(kv_lens=(5, 19), num_q_heads=4, num_kv_heads=2, head_dim=16,
                   block_size=8, dtype="bfloat16", name=n) for n in ("h1", "h2")]
#: Expected (status, step, words of the reason) of each hostile plug-in, on every case.
EXPECTED = {
    "patches-compare": ("fail", "compare", "exceeds its allowance"),
    "patches-expected-of": ("fail", "compare", "exceeds its allowance"),
    "patches-result-record": ("fail", "compare", "exceeds its allowance"),
    "zeroes-the-truth": ("fail", "compare", "exceeds its allowance"),
    "returns-its-first-output": ("fail", "timing", "run on new inputs written into its buffers"),
    "forges-the-compare-step": ("error", "run", "sent a step the job has not"),
    "alternates-items": ("error", "run", "sent a step of item"),
    "changes-torch-state": ("fail", "compare", "exceeds its allowance"),
    "poisons-the-cache": ("fail", "compare", "exceeds its allowance"),
    "meta-output": ("error", "run", "its output cannot be read"),
    "refusing-subclass-output": ("error", "run", "its output cannot be read"),
    "leaves-the-worker-tree": ("error", "prepare", "flag was refused"),
}
TARGETS = {
    "patches-compare": "PatchesCompare", "patches-expected-of": "PatchesExpectedOf",
    "patches-result-record": "PatchesResultRecord", "zeroes-the-truth": "ZeroesTheTruth",
    "returns-its-first-output": "ReturnsItsFirstOutput",
    "forges-the-compare-step": "ForgesTheCompareStep", "alternates-items": "AlternatesItems",
    "changes-torch-state": "ChangesTorchState", "poisons-the-cache": "PoisonsTheCache",
    "meta-output": "MetaOutput", "refusing-subclass-output": "RefusingSubclassOutput",
    "leaves-the-worker-tree": "LeavesTheWorkerTree",
}
FIGURES = ("status", "step", "max_abs_err", "max_err_ulps", "mean_err_ulps", "naive_abs_err",
           "err_over_allowance", "worst_index")
#: A case budget no loaded host reaches (no plug-in here hangs: the forged messages are
#: refused, not timed out).
CONFIG = dict(timing=True, warmup=1, repetitions=3, time_budget_s=0.05, time_limit_s=0.5,
              case_timeout_s=120, threads=1)


def _run(impls: dict[str, str], tmp_path, name: str) -> list[ResultRecord]:
    config = RunConfig(**CONFIG, cache_dir=tmp_path / "build")
    return run(make_plan(impls, CASES), config, ResultsFile(tmp_path / f"{name}.jsonl"), name)


def _figures(record: ResultRecord) -> dict:
    data = record.model_dump()
    return {k: None if isinstance(data[k], float) and math.isnan(data[k]) else data[k]
            for k in FIGURES}


@pytest.fixture(scope="module")
def alone(tmp_path_factory) -> list[ResultRecord]:
    """The built-in alone, in a cache folder of its own."""
    return _run(BUILTIN, tmp_path_factory.mktemp("alone"), "alone")


def test_hostile_plugins_end_as_their_own_failures(alone, tmp_path, monkeypatch) -> None:
    """The poisoner runs before the built-in, whose truths it overwrote: they are refused
    (their HMAC does not match), recomputed, and reported."""
    monkeypatch.setenv("PAGEDBENCH_TEST_CACHE_DIR", str(tmp_path / "build"))
    impls = {name: f"{HOSTILE}:{cls}" for name, cls in TARGETS.items()} | BUILTIN
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        records = _run(impls, tmp_path, "hostile")
    got = {}
    for record in records:
        got.setdefault(record.impl, []).append(record)
    assert set(got) == set(impls)
    for name, (status, step, words) in EXPECTED.items():
        for record in got[name]:
            assert (str(record.status), record.step) == (status, step), (name, record.reason)
            assert words in record.reason, (name, record.reason)
            assert record.time_ms is None  # never ranked
    assert [_figures(r) for r in got["sdpa-contiguous"]] == [_figures(r) for r in alone]
    assert all(r.status is Status.PASS and r.time_ms for r in got["sdpa-contiguous"])
    assert exit_code(r.status for r in records) == ExitCode.CONFORMANCE_FAILURE
    assert any("HMAC does not match" in str(w.message) for w in caught)


def test_the_yardstick_is_the_judges_whatever_the_implementation_sets(alone, tmp_path) -> None:
    """``changes-torch-state`` sets float32 matmul precision, default dtype and flush of
    denormals at load: the yardstick it is judged against is the one computed here with
    torch's defaults (its zeros are off by the truth itself: error = |truth|)."""
    records = _run({"changes-torch-state": f"{HOSTILE}:ChangesTorchState"}, tmp_path, "state")
    for record, case in zip(records, CASES):
        expected = compute_truth(case)
        seq = record.worst_index[0]
        lo, hi = sum(case.q_lens_or_decode[:seq]), sum(case.q_lens_or_decode[:seq + 1])
        yardstick = float((expected.naive[lo:hi].double() - expected.truth[lo:hi]).abs().max())
        assert record.naive_abs_err == yardstick
        assert record.max_abs_err == float(expected.truth.abs().max())
    assert torch.get_default_dtype() == torch.float32
