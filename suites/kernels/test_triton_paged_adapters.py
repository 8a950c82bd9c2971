"""The ``pagedbench-triton-split`` and ``pagedbench-triton-prefill`` adapters:
registration, availability, declared limits, the interpreter budget, and a
prepare/run round trip against the truth."""

from __future__ import annotations

import pytest
import torch

from pagedbench.adapters import BUILTIN, load
from pagedbench.harness.cases.presets import default_cases
from pagedbench.harness.verdict.tolerance import assert_matches_truth
from pagedbench.reference import PagedCase, materialize

triton = pytest.importorskip("triton")
from pagedbench.adapters.triton_paged import (  # noqa: E402
    PREFILL_STEP_BUDGET,
    SPLIT_STEP_BUDGET,
    TritonPrefill,
    TritonSplitDecode,
)
from pagedbench.kernels.paged_prefill import plan_prefill  # noqa: E402
from pagedbench.kernels.paged_split_plan import plan_splits  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
#: Interpreted on the CPU, and on CUDA only when Triton's interpreter was switched on.
INTERPRETED = DEVICE == "cpu" or triton.knobs.runtime.interpret
#: SMs the split count plans for: the device's, or on the CPU an H100/H200's 132.
NUM_SMS = (torch.cuda.get_device_properties(0).multi_processor_count if DEVICE == "cuda"
           else 132)


@pytest.mark.parametrize(("name", "adapter_cls"), [
    ("pagedbench-triton-split", TritonSplitDecode),
    ("pagedbench-triton-prefill", TritonPrefill),
])
def test_registered_name_loads_this_adapter(name, adapter_cls):
    assert isinstance(load(BUILTIN[name]), adapter_cls)


@pytest.mark.parametrize(("adapter", "facts"), [
    (TritonSplitDecode(), {"num_sms": NUM_SMS}),
    (TritonPrefill(), {}),
], ids=["split", "prefill"])
def test_available_here_and_interpreted_on_the_cpu(adapter, facts):
    """``interpreted`` is a JSON boolean that follows the device; the split adapter
    records the SM count its split count plans for."""
    availability = adapter.available(DEVICE)
    assert availability.ok, availability.reason
    assert availability.version == triton.__version__
    assert availability.details == {"interpreted": INTERPRETED, **facts}
    assert type(availability.details["interpreted"]) is bool
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


@pytest.mark.parametrize("adapter", [TritonSplitDecode(), TritonPrefill()],
                         ids=lambda a: a.name)
def test_fp8_e4m3_needs_compute_capability_8_9_on_a_gpu(monkeypatch, adapter):
    """On a (faked) compiled GPU, ``capabilities(device)`` drops fp8_e4m3 below 8.9 and
    says why; compute capability 7.5 is below the kernels' 8.0 altogether; interpreted,
    nothing is compiled and every fp8 type stays."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: "Fake GPU")
    monkeypatch.setattr(adapter, "is_interpreted", lambda device: False)
    case = _case(kv_cache_dtype="fp8_e4m3")
    for capability, reasons in (
        ((7, 5), ["compute capability 7.5 of Fake GPU not supported (supported: >= 8.0)",
                  "kv_cache_dtype 'fp8_e4m3' not in ['auto', 'fp8_e5m2'] (fp8_e4m3 needs "
                  "compute capability 8.9 (Triton has no E4M3 below), this GPU has 7.5)"]),
        ((8, 0), ["kv_cache_dtype 'fp8_e4m3' not in ['auto', 'fp8_e5m2'] (fp8_e4m3 needs "
                  "compute capability 8.9 (Triton has no E4M3 below), this GPU has 8.0)"]),
        ((8, 9), []),
        ((9, 0), []),
    ):
        monkeypatch.setattr(torch.cuda, "get_device_capability",
                            lambda index=None, c=capability: c)
        assert sorted(adapter.why_unsupported(case, "cuda")) == reasons, capability
        assert adapter.why_unsupported(case.with_(kv_cache_dtype="fp8_e5m2"),
                                       "cuda") == reasons[:1 if capability < (8, 0) else 0]
    monkeypatch.setattr(adapter, "is_interpreted", lambda device: True)
    assert "fp8_e4m3" in adapter.capabilities("cuda").kv_cache_dtypes


def test_interpreter_budgets_admit_the_presets_as_documented():
    """The figures in adapters/triton_paged.py: every reduced preset but phi3-mini fits
    the split budget, every one the prefill budget; of the full presets none fits the
    split budget, and the prefill budget admits llama3.1-70b-tp8 and qwen2.5-7b at
    block_size 16 only."""
    split, prefill = TritonSplitDecode(), TritonPrefill()
    admitted = {split.name: set(), prefill.name: set()}
    # The MLA preset's head_dim 576 is outside the kernels' head dims (unsupported there).
    cases = [c for c in default_cases() if c.head_dim_v is None]
    for case in cases:
        size = torch.empty((), dtype=case.kv_torch_dtype).element_size()
        split_steps = plan_splits(case.kv_lens, case.num_kv_heads, case.head_dim,
                                  size).steps(case.kv_lens, case.num_kv_heads, None)
        prefill_steps = plan_prefill(case.q_lens_or_decode, case.kv_lens, case.gqa_ratio,
                                     case.head_dim, size).steps(case.num_kv_heads)
        for adapter, steps, budget in ((split, split_steps, SPLIT_STEP_BUDGET),
                                       (prefill, prefill_steps, PREFILL_STEP_BUDGET)):
            reasons = adapter.why_unsupported(case, "cpu")
            if steps <= budget:
                assert reasons == [], (adapter.name, case.case_id)
            else:
                assert len(reasons) == 1, (adapter.name, case.case_id, reasons)
                assert reasons[0].startswith("too large for Triton's interpreter"), reasons
                assert f"{steps} key-loop steps" in reasons[0], reasons
            if not reasons:
                admitted[adapter.name].add((case.name, case.block_size, case.tag))
    reduced = {(c.name, c.block_size, c.tag) for c in cases if c.tag}
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
    facts = adapter.describe(prepared)
    assert set(facts) == details
    assert all(type(v) is (bool if k == "merge" else int) for k, v in facts.items()), facts
    first = adapter.run(prepared).clone()
    assert_matches_truth(first, inputs, case.case_id)
    assert torch.equal(adapter.run(prepared), first)
