"""The ``pagedbench-triton-split`` and ``pagedbench-triton-prefill`` adapters:
registration, availability, declared limits, the interpreter budget, and a
prepare/run round trip against the truth."""

from __future__ import annotations

import pytest
import torch

from pagedbench.adapters import BUILTIN, load
from pagedbench.harness.cases import default_cases
from pagedbench.harness.tolerance import assert_matches_truth
from pagedbench.reference import PagedCase, materialize

triton = pytest.importorskip("triton")
from pagedbench.adapters.triton_paged import (  # noqa: E402
    PREFILL_STEP_BUDGET,
    SPLIT_STEP_BUDGET,
    TritonPrefill,
    TritonSplitDecode,
)
from pagedbench.kernels.paged_prefill import plan_prefill  # noqa: E402
from pagedbench.kernels.paged_split_decode import plan_splits  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SPLIT = "pagedbench.adapters.triton_paged:TritonSplitDecode"
PREFILL = "pagedbench.adapters.triton_paged:TritonPrefill"


def test_registered_after_pagedbench_triton():
    first = BUILTIN.index("pagedbench.adapters.triton_decode:TritonPagedDecode")
    assert BUILTIN[first + 1 : first + 3] == (SPLIT, PREFILL)
    assert load(SPLIT).name == "pagedbench-triton-split"
    assert load(PREFILL).name == "pagedbench-triton-prefill"


@pytest.mark.parametrize("adapter", [TritonSplitDecode(), TritonPrefill()],
                         ids=lambda a: a.name)
def test_available_here_and_interpreted_on_the_cpu(adapter):
    availability = adapter.available(DEVICE)
    assert availability.ok, availability.reason
    assert availability.version == triton.__version__
    assert adapter.is_interpreted("cpu")


def _case(**changes) -> PagedCase:
    return PagedCase(kv_lens=(3, 9), num_q_heads=4, num_kv_heads=2, head_dim=64,
                     block_size=16).with_(**changes)


@pytest.mark.parametrize(("adapter", "change", "reason"), [
    (TritonSplitDecode(), {"q_lens": (1, 2)}, "mode 'prefill' not in ['decode']"),
    (TritonSplitDecode(), {"head_dim": 72},
     "head_dim 72 not supported (supported: 64, 80, 96, 128, 256)"),
    (TritonPrefill(), {"head_dim": 512},
     "head_dim 512 not supported (supported: 64, 80, 96, 128, 256)"),
], ids=["split-prefill", "split-hd72", "prefill-hd512"])
def test_declared_limits_give_reasons(adapter, change, reason):
    assert reason in adapter.why_unsupported(_case(**change), DEVICE)


@pytest.mark.parametrize("adapter", [TritonSplitDecode(), TritonPrefill()],
                         ids=lambda a: a.name)
def test_every_feature_and_fp8_is_declared(adapter):
    case = _case(q_lens=(1, 1), sliding_window=4, logits_soft_cap=5.0, alibi=True,
                 sinks=True, kv_cache_dtype="fp8_e5m2", k_scale=2.0)
    assert adapter.why_unsupported(case, DEVICE) == []


def test_fp8_e4m3_needs_compute_capability_8_9_on_a_gpu(monkeypatch):
    adapter = TritonSplitDecode()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(adapter, "is_interpreted", lambda device: False)
    case = _case(kv_cache_dtype="fp8_e4m3")
    for capability, refused in (((8, 0), True), ((8, 9), False), ((9, 0), False)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d, c=capability: c)
        reasons = adapter.why_unsupported(case, "cuda")
        assert any("needs compute capability 8.9" in r for r in reasons) is refused


def test_interpreter_budgets_admit_the_presets_as_documented():
    """The figures in adapters/triton_paged.py: every reduced preset but phi3-mini fits
    the split budget, every one the prefill budget; of the full presets none fits the
    split budget, and the prefill budget admits llama3.1-70b-tp8 and qwen2.5-7b at
    block_size 16 only."""
    split, prefill = TritonSplitDecode(), TritonPrefill()
    admitted = {split.name: set(), prefill.name: set()}
    for case in default_cases():
        size = torch.empty((), dtype=case.kv_torch_dtype).element_size()
        split_steps = plan_splits(case.kv_lens, case.num_kv_heads, case.head_dim,
                                  size).steps(case.kv_lens, case.num_kv_heads, None)
        prefill_steps = plan_prefill(case.q_lens_or_decode, case.kv_lens, case.gqa_ratio,
                                     case.head_dim, size).steps(case.num_kv_heads)
        for adapter, steps, budget in ((split, split_steps, SPLIT_STEP_BUDGET),
                                       (prefill, prefill_steps, PREFILL_STEP_BUDGET)):
            reasons = adapter.why_unsupported(case, "cpu")
            expected = ([] if steps <= budget else
                        [f"too large for the Triton interpreter: {steps} steps > "
                         f"budget {budget}"])
            assert reasons == expected, (adapter.name, case.case_id)
            if not reasons:
                admitted[adapter.name].add((case.name, case.block_size, case.tag))
    reduced = {(c.name, c.block_size, c.tag) for c in default_cases() if c.tag}
    assert admitted[split.name] == {r for r in reduced if r[0] != "phi3-mini"}
    assert admitted[prefill.name] == reduced | {
        ("llama3.1-70b-tp8", 16, ""), ("llama3.1-70b-tp8", 32, ""), ("qwen2.5-7b", 16, "")}


@pytest.mark.parametrize(("adapter", "q_lens", "details"), [
    (TritonSplitDecode(), None, {"num_splits", "merge", "kv_tile", "num_warps",
                                 "num_stages"}),
    (TritonPrefill(), (1, 7, 20), {"block_m", "programs", "kv_tile", "num_warps",
                                   "num_stages"}),
], ids=["split", "prefill"])
def test_prepare_then_run_matches_dense(adapter, q_lens, details):
    case = PagedCase(kv_lens=(1, 30, 49), q_lens=q_lens, num_q_heads=10, num_kv_heads=2,
                     head_dim=80, block_size=48, dtype="bfloat16", sliding_window=20,
                     logits_soft_cap=8.0, alibi=True, sinks=True, name="adapter")
    assert adapter.why_unsupported(case, DEVICE) == []
    inputs = materialize(case, DEVICE)
    prepared = adapter.prepare(inputs)
    assert bool(prepared.out.isnan().all()), "prepare must leave the NaN buffer unwritten"
    assert set(adapter.describe(prepared)) == details
    first = adapter.run(prepared).clone()
    assert_matches_truth(first, inputs, case.case_id)
    assert torch.equal(adapter.run(prepared), first)
