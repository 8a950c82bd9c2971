"""The paged-decode launcher: input validation, the interpreter's bfloat16 workaround
and its selection, the step estimate, output-buffer handling, empty sequences."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from pagedbench.harness.verdict.tolerance import Expected, assert_close_report, compare
from pagedbench.reference import PagedCase, materialize

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from pagedbench.kernels import paged_decode as pd  # noqa: E402
from pagedbench.kernels import paged_features  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
INTERPRETED = pd.kernel_is_interpreted()
interpreter_only = pytest.mark.skipif(not INTERPRETED, reason="the kernel is compiled here")


@pytest.fixture(scope="module")
def inputs():
    case = PagedCase(kv_lens=(5, 17), num_q_heads=4, num_kv_heads=2, head_dim=64,
                     block_size=16, dtype="bfloat16", name="launcher")
    return materialize(case, DEVICE)


def _args(inputs):
    return dict(q=inputs.q, kv_cache=inputs.kv_cache, block_tables=inputs.block_tables,
                kv_lens=inputs.kv_lens, sm_scale=inputs.scale)


# Selection of the bfloat16 workaround ------------------------------------------------
@pytest.mark.parametrize(("dtype", "interpreted", "expected"), [
    (torch.bfloat16, True, True),
    (torch.bfloat16, False, False),
    (torch.float16, True, False),
    (torch.float16, False, False),
    (torch.float32, True, False),
    (torch.float32, False, False),
])
def test_bf16_via_fp32_only_for_interpreted_bfloat16(dtype, interpreted, expected):
    assert pd.bf16_via_fp32(dtype, interpreted) is expected


def test_kernel_is_interpreted_follows_the_environment_at_import():
    assert INTERPRETED == triton.knobs.runtime.interpret
    if not torch.cuda.is_available():
        assert INTERPRETED, "suites/conftest.py sets TRITON_INTERPRET=1 when there is no CUDA"


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_launcher_sets_bf16_via_fp32_from_the_selection(inputs, dtype):
    torch_dtype = getattr(torch, dtype)
    args = _args(inputs)
    args["q"], args["kv_cache"] = inputs.q.to(torch_dtype), inputs.kv_cache.to(torch_dtype)
    plan = pd.plan_paged_decode(**args)
    assert plan.constexprs["BF16_VIA_FP32"] is (dtype == "bfloat16" and INTERPRETED)


@interpreter_only
def test_interpreted_bfloat16_passes_and_needs_the_workaround(inputs):
    """With the workaround the interpreted bfloat16 kernel passes the policy; without it
    the interpreter's bfloat16 dot (triton-lang/triton#11584) ruins the output. If this
    second half ever passes, the interpreter was fixed and the workaround can go."""
    expected = Expected.of(inputs)
    plan = pd.plan_paged_decode(**_args(inputs))
    assert_close_report(plan(), expected, "bfloat16", inputs.case.case_id, inputs.cu_seqlens_q)
    raw = dataclasses.replace(plan, constexprs={**plan.constexprs, "BF16_VIA_FP32": False})
    assert not compare(raw(), expected, "bfloat16").passed


@triton.jit
def _round_kernel(x_ptr, y_ptr, N: tl.constexpr):
    offsets = tl.arange(0, N)
    tl.store(y_ptr + offsets, paged_features._round_to_bf16(tl.load(x_ptr + offsets)))


def test_round_to_bf16_matches_torch_bit_for_bit():
    """Ties to even, carries into the exponent (1.99...), signs, tiny and huge values,
    against torch's float32 -> bfloat16 conversion (round to nearest even)."""
    special = torch.tensor([1.0 + 2**-8, 1.0 + 3 * 2**-8, 2.0 - 2**-9, 2.0 - 2**-20,
                            -(4.0 - 2**-20), 1.0 + 2**-8 + 2**-20, 3.0e-39, -1.0e-40,
                            3.0e38, 0.0, -0.0], dtype=torch.float32)
    noise = torch.randn(1024 - len(special), generator=torch.Generator().manual_seed(3))
    x = torch.cat([special, noise * 10.0 ** torch.randint(-6, 6, noise.shape).float()])
    x = x.to(DEVICE)
    y = torch.empty(x.shape, dtype=torch.bfloat16, device=DEVICE)
    _round_kernel[(1,)](x, y, N=x.numel())
    expected = x.to(torch.bfloat16)
    assert torch.equal(y.view(torch.int16), expected.view(torch.int16))


# Validation ------------------------------------------------------------------------
@pytest.mark.parametrize(("mutate", "message"), [
    (lambda a: a.update(q=a["q"][0]), "q must be [batch, num_q_heads, head_dim]"),
    (lambda a: a.update(q=a["q"].to(torch.float64), kv_cache=a["kv_cache"].double()),
     "q.dtype must be one of"),
    (lambda a: a.update(kv_cache=a["kv_cache"].half()), "kv_cache.dtype"),
    (lambda a: a.update(kv_cache=a["kv_cache"][:, 0]), "kv_cache must be [num_blocks, 2,"),
    (lambda a: a.update(kv_cache=a["kv_cache"][..., :32]), "kv_cache head_dim (32)"),
    (lambda a: a.update(q=a["q"][:, :3]), "num_q_heads (3) must be a multiple"),
    (lambda a: a.update(block_tables=a["block_tables"].long()),
     "block_tables.dtype must be torch.int32"),
    (lambda a: a.update(block_tables=a["block_tables"][:1]), "block_tables must be [batch=2"),
    (lambda a: a.update(kv_lens=a["kv_lens"].long()), "kv_lens.dtype must be torch.int32"),
    (lambda a: a.update(kv_lens=a["kv_lens"][:1]), "kv_lens must be [batch=2]"),
    (lambda a: a.update(sm_scale=0.0), "sm_scale must be finite and > 0"),
    (lambda a: a.update(sm_scale=math.nan), "sm_scale must be finite and > 0"),
    (lambda a: a.update(sliding_window=0), "sliding_window must be None or an int >= 1"),
    (lambda a: a.update(logits_soft_cap=-1.0), "logits_soft_cap must be None or finite"),
    (lambda a: a.update(out=torch.empty_like(a["q"], dtype=torch.float32)),
     "out must be a tensor of q's shape"),
    (lambda a: a.update(out=a["q"][:1].clone()), "out must be a tensor of q's shape"),
], ids=["q-2d", "q-float64", "kv-dtype", "kv-4d", "kv-head-dim", "heads", "tables-int64",
        "tables-batch", "kv-lens-int64", "kv-lens-shape", "scale-0", "scale-nan", "window-0",
        "cap-negative", "out-dtype", "out-shape"])
def test_launcher_rejects_bad_inputs_naming_them(inputs, mutate, message):
    args = _args(inputs)
    mutate(args)
    with pytest.raises(ValueError) as info:
        pd.paged_decode(**args)
    assert message in str(info.value)


def test_launcher_refuses_an_fp8_cache(inputs):
    """The shared check (``paged_args.check_paged_args``) admits fp8 caches for the
    newer kernels only; this kernel's message offers no fp8 type."""
    args = _args(inputs)
    args["kv_cache"] = args["kv_cache"].to(torch.float8_e5m2)
    with pytest.raises(ValueError) as info:
        pd.paged_decode(**args)
    assert str(info.value) == ("kv_cache.dtype (torch.float8_e5m2) must equal q.dtype "
                               "(torch.bfloat16)")


def test_launcher_rejects_non_tensors(inputs):
    args = _args(inputs)
    args["kv_lens"] = [5, 17]
    with pytest.raises(TypeError, match="kv_lens must be a torch.Tensor, got list"):
        pd.paged_decode(**args)


@pytest.mark.parametrize("feature, value", [
    ("alibi_slopes", "slopes"), ("sinks", "slopes"), ("k_scale", 2.0), ("windows", 4)])
def test_launcher_refuses_a_feature_it_does_not_have(inputs, feature, value):
    """This kernel takes the window and the soft cap only; ALiBi, sinks and fp8 scales are
    the split-KV and prefill kernels' (one declaration, ``paged_args.PagedFeatures``),
    and a misspelt feature is never silently ignored."""
    if value == "slopes":
        value = torch.ones(inputs.q.shape[1], dtype=torch.float32)
    with pytest.raises(TypeError) as info:
        pd.paged_decode(**_args(inputs), **{feature: value})
    assert str(info.value) == (f"paged_decode() got unexpected keyword argument(s) "
                               f"['{feature}']; its features are ['logits_soft_cap', "
                               f"'sliding_window']")


# Output buffer and empty sequences ------------------------------------------------
def test_launcher_writes_every_element_of_the_given_out(inputs):
    out = torch.full_like(inputs.q, float("nan"))
    result = pd.paged_decode(**_args(inputs), out=out)
    assert result is out
    assert bool(torch.isfinite(out).all())


def test_decode_of_an_empty_sequence_is_zero(inputs):
    """kv_len 0: no key, the row is all zeros (FlashAttention's convention, as
    reference.dense.attention documents); the other sequence is unaffected."""
    kv_lens = torch.tensor([0, 17], dtype=torch.int32, device=DEVICE)
    out = pd.paged_decode(**{**_args(inputs), "kv_lens": kv_lens})
    assert bool((out[0] == 0).all())
    assert torch.equal(out[1], pd.paged_decode(**_args(inputs))[1])


# Step estimate -------------------------------------------------------------------
@given(kv_lens=st.lists(st.integers(1, 300), min_size=1, max_size=5),
       num_kv_heads=st.integers(1, 8),
       sliding_window=st.one_of(st.none(), st.integers(1, 300)))
def test_program_steps_counts_the_tiles_each_program_visits(kv_lens, num_kv_heads,
                                                            sliding_window):
    expected = 0
    for kv_len in kv_lens:
        first = 0 if sliding_window is None else max(0, kv_len - sliding_window)
        expected += len({pos // pd.KV_TILE for pos in range(first, kv_len)})
    assert pd.program_steps(kv_lens, num_kv_heads, sliding_window) == expected * num_kv_heads
