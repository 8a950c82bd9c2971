"""SGLang's Triton kernels (``sglang-decode``, ``sglang-extend``): loading its wheel's files
without SGLang (sha256 checked, stand-ins complete, ``sys.modules`` untouched), the
token-pool conversion, and the kernels against the float64 truth on each feature they
claim, at block_size 1 (SGLang's token pool) and 16, and on MLA shapes (576 / 512, one KV
head).

On the CPU the kernel runs under Triton's interpreter (suites/conftest.py sets
``TRITON_INTERPRET=1``), so the cases are few and small. Skipped when the files are not
extracted (``make`` does it, in the venv step).
"""

from __future__ import annotations

import hashlib
import os
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from pagedbench.adapters import sglang_triton_load as load
from pagedbench.harness.verdict.tolerance import Expected, assert_close_report, compare
from pagedbench.reference import PagedCase, materialize
from pagedbench.reference.dense import gather_kv
from pagedbench.suites.feature_effect import assert_feature_matters

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = [
    pytest.mark.skipif(not (load.files_dir() / load.module_path(next(iter(load.FILES)))).exists(),
                       reason=f"SGLang's kernel files are not in {load.files_dir()} "
                              "(`make` extracts them)"),
    # The interpreter evaluates masked-out lanes too (-inf - -inf); results are masked.
    pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
]
GQA = dict(num_q_heads=8, num_kv_heads=2, head_dim=64, block_size=16)
DECODE_LENS = (1, 16, 17, 50)
#: A declared carve-out is still needed while the kernel misses the truth by this many
#: times the allowed error (far beyond any rounding).
FAULT_MARGIN = 100.0
FEATURE_OFF = {"sliding_window": {"sliding_window": None},
               "logits_soft_cap": {"logits_soft_cap": None}, "sinks": {"sinks": False}}


def _adapter(cls=None):
    from pagedbench.adapters.sglang_triton import SglangDecode

    adapter = (cls or SglangDecode)()
    if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton interpreter is off (TRITON_INTERPRET != 1) on this CPU run")
    availability = adapter.available(DEVICE)
    assert availability.ok, availability.reason
    return adapter


def _copy_files(dest: Path) -> Path:
    for module in load.FILES:
        target = dest / load.module_path(module)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes((load.files_dir() / load.module_path(module)).read_bytes())
    return dest


# --- loading -----------------------------------------------------------------------------

def test_files_load_without_importing_sglang() -> None:
    before = {name for name in sys.modules if name.partition(".")[0] == "sglang"}
    kernels = load.load_kernels()
    assert {name for name in sys.modules if name.partition(".")[0] == "sglang"} == before
    assert kernels.version == load.SGLANG_VERSION == "0.5.23"
    assert "sha256-checked" in kernels.source
    assert callable(kernels.decode.decode_attention_fwd)


def test_stand_ins_cover_every_name_the_files_use() -> None:
    assert load.unmet_names(load.read_files(load.files_dir())) == []


def test_unmet_names_sees_an_uncovered_use() -> None:
    """The check can fail: a use of a module and an env variable no stand-in has."""
    sources = {"sglang.kernels.ops.attention.score_mod":
               b"from sglang.srt.server_args import get_global_server_args\n"
               b"from sglang.srt.environ import envs\nx = envs.SGLANG_NOT_A_VARIABLE\n"}
    assert load.unmet_names(sources) == [
        "sglang/kernels/ops/attention/score_mod.py:1: module sglang.srt.server_args",
        "sglang/kernels/ops/attention/score_mod.py:3: envs.SGLANG_NOT_A_VARIABLE",
    ]


def test_a_changed_byte_is_refused_naming_the_file(tmp_path: Path) -> None:
    folder = _copy_files(tmp_path)
    target = folder / load.module_path("sglang.kernels.ops.attention.decode_attention")
    data = bytearray(target.read_bytes())
    data[-2] ^= 1
    target.write_bytes(bytes(data))
    with pytest.raises(load.SglangFilesInvalid, match="decode_attention.py: sha256 .* differs"):
        load.load_kernels(folder)


def test_a_missing_file_is_refused_naming_it(tmp_path: Path) -> None:
    folder = _copy_files(tmp_path)
    (folder / load.module_path("sglang.kernels.ops.attention.metadata")).unlink()
    with pytest.raises(load.SglangFilesInvalid, match="metadata.py"):
        load.read_files(folder)


def test_extract_checks_each_file_of_the_wheel(tmp_path: Path) -> None:
    """A wheel holding the pinned files extracts them byte for byte; one whose file
    differs is refused before anything of it is written."""
    good, bad = tmp_path / "good.whl", tmp_path / "bad.whl"
    sources = load.read_files(load.files_dir())
    for wheel, tamper in ((good, False), (bad, True)):
        with zipfile.ZipFile(wheel, "w") as archive:
            for module, data in sources.items():
                archive.writestr(load.module_path(module), data + (b"#" if tamper else b""))
    written = load.extract(good, tmp_path / "out")
    assert [hashlib.sha256(p.read_bytes()).hexdigest() for p in written] == list(load.FILES.values())
    with pytest.raises(load.SglangFilesInvalid, match="score_mod.py has sha256"):
        load.extract(bad, tmp_path / "bad-out")
    assert not (tmp_path / "bad-out").exists()


def test_env_stand_in_parses_as_sglang(monkeypatch: pytest.MonkeyPatch) -> None:
    envs = load.stand_ins()["sglang.srt.environ"].envs
    monkeypatch.delenv("SGLANG_MLA_DECODE_TUNE", raising=False)
    assert envs.SGLANG_MLA_DECODE_TUNE.get() is False
    monkeypatch.setenv("SGLANG_MLA_DECODE_TUNE", "Yes")
    assert envs.SGLANG_MLA_DECODE_TUNE.get() is True
    monkeypatch.setenv("SGLANG_MLA_DECODE_TUNE", "maybe")
    with pytest.raises(ValueError, match="SGLANG_MLA_DECODE_TUNE"):
        envs.SGLANG_MLA_DECODE_TUNE.get()
    monkeypatch.setenv("SGLANG_FORCE_LEAN_GRID_CU_MULT", "0.5")
    assert envs.SGLANG_FORCE_LEAN_GRID_CU_MULT.get() == 0.5


# --- the token pool ----------------------------------------------------------------------

@pytest.mark.parametrize("block_size, window", [(1, None), (16, None), (5, 7)])
def test_token_pool_indices_address_each_sequences_keys(block_size: int,
                                                        window: int | None) -> None:
    """``k_buffer[kv_indices]`` between ``kv_indptr`` offsets is each sequence's K (the
    last ``W`` keys with a window), gathered independently by the reference."""
    from pagedbench.adapters.sglang_triton import token_indices, token_pools

    case = PagedCase(kv_lens=(1, 17, 40), num_q_heads=4, num_kv_heads=2, head_dim=32,
                     head_dim_v=16, block_size=block_size, dtype="float32",
                     sliding_window=window)
    inputs = materialize(case, "cpu")
    k_buffer, v_buffer = token_pools(inputs)
    kv_indptr, kv_indices = token_indices(inputs)
    assert k_buffer.shape == (inputs.kv_cache.shape[0] * block_size, 2, 32)
    assert v_buffer.shape == (inputs.kv_cache.shape[0] * block_size, 2, 16)
    for b, ((k, v), kv_len) in enumerate(zip(gather_kv(inputs), case.kv_lens)):
        keep = kv_len if window is None else min(kv_len, window)
        rows = kv_indices[kv_indptr[b]:kv_indptr[b + 1]]
        assert torch.equal(k_buffer[rows], k[kv_len - keep:])
        assert torch.equal(v_buffer[rows], v[kv_len - keep:])


# --- the kernel against the truth --------------------------------------------------------

def _case(name: str, dtype: str, kv_lens: tuple[int, ...], **extra) -> PagedCase:
    return PagedCase(kv_lens=kv_lens, dtype=dtype, **{**GQA, "name": name, **extra})


DECODE = [
    (_case("decode", "float32", DECODE_LENS, sinks=True, sliding_window=9), "grouped"),
    (_case("decode-mha-bs1", "float16", DECODE_LENS, num_q_heads=4, num_kv_heads=4,
           block_size=1, logits_soft_cap=5.0), "mha"),
    (_case("decode-mla", "float16", (1, 17, 40), num_q_heads=16, num_kv_heads=1,
           head_dim=576, head_dim_v=512), "grouped"),
]


@pytest.mark.parametrize("case, kernel", DECODE, ids=[c.case_id for c, _ in DECODE])
def test_decode_matches_dense(case: PagedCase, kernel: str) -> None:
    adapter = _adapter()
    assert not adapter.why_unsupported(case, DEVICE)
    inputs, cpu_inputs = materialize(case, DEVICE), materialize(case, "cpu")
    prepared = adapter.prepare(inputs)
    out = adapter.run(prepared)
    comparison = assert_close_report(out, Expected.of(cpu_inputs), case.dtype,
                                     f"sglang-decode:{case.case_id}", cpu_inputs.cu_seqlens_q)
    for feature in sorted(case.features - {"head_dim_v"}):
        assert_feature_matters(case, FEATURE_OFF[feature], comparison.allowed_abs_err)
    assert prepared.facts == {"max_kv_splits": 8, "kernel": kernel}


EXTEND = [
    # A decode row, a chunk over a prefix, and a prefill without one (q_len == kv_len).
    _case("mixed-bs1", "float16", (17, 40, 16), q_lens=(1, 9, 16), block_size=1,
          logits_soft_cap=5.0),
    _case("mixed", "float16", (17, 40, 33), q_lens=(1, 9, 16), sinks=True, sliding_window=9),
    _case("chunk-mla", "float16", (20, 37), q_lens=(3, 5), num_q_heads=4, num_kv_heads=1,
          head_dim=576, head_dim_v=512),
]


@pytest.mark.parametrize("case", EXTEND, ids=[c.case_id for c in EXTEND])
def test_extend_matches_dense(case: PagedCase) -> None:
    from pagedbench.adapters.sglang_triton import SglangExtend

    adapter = _adapter(SglangExtend)
    assert not adapter.why_unsupported(case, DEVICE)
    inputs, cpu_inputs = materialize(case, DEVICE), materialize(case, "cpu")
    out = adapter.run(adapter.prepare(inputs))
    comparison = assert_close_report(out, Expected.of(cpu_inputs), case.dtype,
                                     f"sglang-extend:{case.case_id}", cpu_inputs.cu_seqlens_q)
    for feature in sorted(case.features - {"head_dim_v"}):
        assert_feature_matters(case, FEATURE_OFF[feature], comparison.allowed_abs_err)


def test_declared_limits_are_unsupported_with_the_reason() -> None:
    adapter = _adapter()
    reasons = adapter.why_unsupported(_case("prefill", "float32", (20,), q_lens=(4,),
                                            alibi=True), DEVICE)
    assert "mode 'prefill' not in ['decode']" in reasons
    assert "feature 'alibi' not supported" in reasons
    assert any("empty_kv" in r for r in adapter.why_unsupported(
        _case("empty", "float32", (0, 3)), DEVICE))
    if DEVICE == "cpu":
        assert any(r.startswith("dtype bfloat16 not in") and "11584" in r
                   for r in adapter.why_unsupported(_case("bf16", "bfloat16", (3,)), "cpu"))
        assert any(r.startswith("too large for Triton's interpreter") for r in
                   adapter.why_unsupported(_case("long", "float32", (60000,) * 8), "cpu"))


def test_extend_refuses_a_window_of_one() -> None:
    """extend_attention_fwd takes W - 1, and 0 there switches the window off."""
    from pagedbench.adapters.sglang_triton import SglangExtend

    adapter = _adapter(SglangExtend)
    assert adapter.why_unsupported(_case("w1", "float32", (20,), q_lens=(4,),
                                         sliding_window=1), DEVICE) == [
        "sliding_window 1 not supported: extend_attention_fwd takes W - 1, and 0 there "
        "means no window"]


#: The smallest straddling case: GQA ratio 20 over 2 KV heads (heads 20-31 share a tile
#: with heads 16-19 of KV group 0).
STRADDLE = PagedCase(kv_lens=(40,), num_q_heads=40, num_kv_heads=2, head_dim=32,
                     block_size=16, dtype="float32", name="straddle")


@pytest.mark.parametrize("name", ["sglang-decode", "vllm-decode"])
def test_declared_head_tile_straddle_really_deviates(name: str) -> None:
    """The carve-out is declared, and still needed: run anyway, the grouped kernel misses
    the truth on the query heads of the second KV group that share a tile with the first,
    by far more than the tolerance, and on no other head (if SGLang or vLLM fixes the
    tiling, lift the carve-out)."""
    from pagedbench.adapters.sglang_triton import SglangDecode

    if name == "vllm-decode":
        pytest.importorskip("vllm", reason="vllm is not installed")
        from pagedbench.adapters.vllm_triton import VllmDecode as cls
    else:
        cls = SglangDecode
    adapter = _adapter(cls)
    assert any(r.startswith("gqa ratio 20 with 2 KV heads not supported")
               for r in adapter.why_unsupported(STRADDLE, DEVICE))
    assert not adapter.why_unsupported(STRADDLE.with_(num_q_heads=32), DEVICE)
    inputs, cpu_inputs = materialize(STRADDLE, DEVICE), materialize(STRADDLE, "cpu")
    out = adapter.run(adapter.prepare(inputs)).cpu()
    expected = Expected.of(cpu_inputs)
    comparison = compare(out, expected, STRADDLE.dtype)
    assert comparison.max_abs_err > FAULT_MARGIN * comparison.allowed_abs_err
    per_head = (out.double() - expected.truth.double()).abs().amax(dim=-1)[0]  # [heads]
    wrong = (per_head > comparison.allowed_abs_err).nonzero().flatten().tolist()
    assert wrong == list(range(20, 32))
