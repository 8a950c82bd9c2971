"""The logit-rounding term of the tolerance policy (``reference.logit_rounding``): its
values, computed here again with scalar Python loops in float64; that it vanishes where
one key is seen and stays far below an output that is off by 10% under a soft cap far
below large logits (where the cap's derivative vanishes); and what it is for: a correct
kernel with float32 logits that scales them after the Q.K product (as FlashAttention-style
kernels do) is not failed when its rounding draw falls outside twice the yardstick's, in
float32 and in float16 with logits near 1e4, while a float32 kernel that rounds its
probabilities to bfloat16, or a float16 one whose logits are float16, still fails. Every kernel here is written with elementwise
float32 operations in a fixed order (``ordered_sum``) and exp computed in float64, so
every figure is the same on any host."""

from __future__ import annotations

import math

import pytest
import torch

from pagedbench.harness.verdict.tolerance import Expected, compare
from pagedbench.reference import PagedCase, PagedInputError, gather_kv, logit_rounding, \
    materialize, reference_attention
from pagedbench.reference.dense import visible_keys
from pagedbench.reference.yardstick import UNIT_ROUNDOFF_FP32, ordered_sum


def _by_hand(inputs) -> torch.Tensor:
    """``3 u sqrt(sum_j (p_j e_j)^2 (v_jc - o_c)^2)``, ``e_j = sqrt(d) a_j sech^2(x_j / cap)
    + |s_j|``, with scalar loops (math.fsum, math.exp, math.tanh)."""
    case = inputs.case
    d, group = case.head_dim, case.gqa_ratio
    cu = inputs.cu_seqlens_q.tolist()
    out = torch.zeros(case.total_q, case.num_q_heads, case.v_head_dim, dtype=torch.float64)
    for i, (k, v) in enumerate(gather_kv(inputs)):
        q = inputs.q[cu[i]:cu[i + 1]].double().tolist()
        k, v = k.double().tolist(), v.double().tolist()
        q_len, kv_len = len(q), len(k)
        for r in range(q_len):
            position = kv_len - q_len + r
            for h in range(case.num_q_heads):
                kh = h // group
                keys = [j for j in range(kv_len) if j <= position and
                        (case.sliding_window is None or j > position - case.sliding_window)]
                if not keys:
                    continue
                logits, error = {}, {}
                for j in keys:
                    x = math.fsum(q[r][h][c] * case.scale * k[j][kh][c] for c in range(d))
                    a = math.fsum(abs(q[r][h][c] * case.scale * k[j][kh][c]) for c in range(d))
                    s, slope = x, math.sqrt(d) * a
                    if case.logits_soft_cap is not None:
                        s = case.logits_soft_cap * math.tanh(x / case.logits_soft_cap)
                        slope *= 1 - math.tanh(x / case.logits_soft_cap) ** 2
                    if case.alibi:
                        s -= float(inputs.alibi_slopes[h]) * (position - j)
                    logits[j], error[j] = s, slope + abs(s)
                peak = max(logits.values())
                sink = float(inputs.sinks[h]) if case.sinks else None
                if sink is not None:
                    peak = max(peak, sink)
                e = {j: math.exp(s - peak) for j, s in logits.items()}
                total = math.fsum(e.values()) + (math.exp(sink - peak) if sink is not None else 0)
                p = {j: e[j] / total for j in keys}
                for c in range(case.v_head_dim):
                    o = math.fsum(p[j] * v[j][kh][c] for j in keys)
                    out[cu[i] + r, h, c] = math.sqrt(math.fsum(
                        (p[j] * error[j] * (v[j][kh][c] - o)) ** 2 for j in keys))
    return out * 3 * UNIT_ROUNDOFF_FP32


@pytest.mark.parametrize("case", [
    PagedCase(kv_lens=(5, 9), q_lens=(2, 3), num_q_heads=4, num_kv_heads=2, head_dim=64,
              block_size=4, dtype="float32", sm_scale=3.0, sliding_window=4, name="window"),
    PagedCase(kv_lens=(6,), q_lens=(2,), num_q_heads=2, num_kv_heads=1, head_dim=64,
              block_size=16, dtype="bfloat16", alibi=True, sinks=True, logits_soft_cap=2.0,
              name="alibi-sinks-cap"),
    PagedCase(kv_lens=(3, 4), num_q_heads=2, num_kv_heads=1, head_dim=64, head_dim_v=32,
              block_size=16, dtype="float16", logit_offset=300.0, name="offset-dv32"),
], ids=lambda c: c.name)
def test_logit_rounding_is_its_formula(case: PagedCase) -> None:
    inputs = materialize(case)
    got = logit_rounding(inputs, reference_attention(inputs))
    assert float(got.max()) > 0
    # v_j - o cancels where o is near v_j: o's last float64 bit, not the formula, there
    torch.testing.assert_close(got, _by_hand(inputs), rtol=1e-7, atol=1e-7 * float(got.max()))


def test_logit_rounding_refuses_a_truth_not_of_its_output() -> None:
    """A truth of another shape or dtype is refused naming ``truth``, never broadcast into
    a term of the wrong rows."""
    inputs = materialize(PagedCase(kv_lens=(5, 9), num_q_heads=4, num_kv_heads=2,
                                   head_dim=64, block_size=4, dtype="float32"))
    truth = reference_attention(inputs)  # [2, 4, 64], float64
    for wrong in (truth[:1], truth.float(), truth[:, :, :1], truth.tolist()):
        with pytest.raises(PagedInputError, match=r"^truth must be a float64 tensor of "
                                                  r"shape \[2, 4, 64\]"):
            logit_rounding(inputs, wrong)


def test_logit_rounding_vanishes_where_one_key_is_seen() -> None:
    """One key (kv_len 1, a window of 1): the output is that key's V whatever its logit, so
    the term is 0 up to float64 rounding of its expanded sum (below 1e-3 float32 ulps)."""
    for case in (PagedCase(kv_lens=(1, 1), num_q_heads=2, num_kv_heads=1, head_dim=64,
                           block_size=16, dtype="float32", sm_scale=10.0),
                 PagedCase(kv_lens=(40,), q_lens=(5,), num_q_heads=2, num_kv_heads=2,
                           head_dim=64, block_size=16, dtype="float32", sliding_window=1)):
        inputs = materialize(case)
        truth = reference_attention(inputs)
        term = logit_rounding(inputs, truth)
        assert float(term.max()) < 1e-3 * UNIT_ROUNDOFF_FP32 * float(truth.abs().max())


def test_a_soft_cap_far_below_the_logits_leaves_no_room_for_a_wrong_output() -> None:
    """Logits near 1e6 under a cap of 30: the capped logits barely move with the raw ones
    (the cap's derivative is about 0), so the term stays near 0 and an output of zeros, or
    one 10% off, fails by far (a term taken before the cap let both pass)."""
    case = PagedCase(kv_lens=(40, 200), num_q_heads=4, num_kv_heads=2, head_dim=128,
                     block_size=16, dtype="float32", sm_scale=1e3, qk_magnitude=30.0,
                     logits_soft_cap=30.0)
    inputs = materialize(case)
    expected = Expected.of(inputs)
    assert float(expected.logit_rounding.max()) < 1e-5 * float(expected.truth.abs().max())
    for wrong in (torch.zeros_like(expected.truth), 0.9 * expected.truth):
        verdict = compare(wrong.float(), expected, "float32", inputs.cu_seqlens_q)
        assert not verdict.passed and verdict.err_over_allowance > 1000


def _scale_after_product(inputs, probabilities_dtype: torch.dtype = torch.float32,
                         logits_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A kernel that forms ``(sum_d q_d k_d) * sm_scale`` in float32 (channels in order,
    one accumulator), rounds it to ``logits_dtype`` (float16: a fault in a float16
    kernel), then ``exp`` (float64, rounded once), the sum over keys and P.V in key order;
    ``probabilities_dtype`` rounds P before P.V (bfloat16: a fault in a float32 kernel).
    Returns ``Tensor[total_q, num_q_heads, v_head_dim]``, float32."""
    case = inputs.case
    cu = inputs.cu_seqlens_q.tolist()
    out = torch.zeros(case.total_q, case.num_q_heads, case.v_head_dim)
    scale = torch.tensor(case.scale, dtype=torch.float32)
    for i, (k, v) in enumerate(gather_kv(inputs)):
        q = inputs.q[cu[i]:cu[i + 1]].float().permute(1, 0, 2)  # [hq, q_len, d]
        k = k.float().repeat_interleave(case.gqa_ratio, 1).permute(1, 0, 2)  # [hq, kv, d]
        v = v.float().repeat_interleave(case.gqa_ratio, 1).permute(1, 0, 2)  # [hq, kv, dv]
        kv_len = k.shape[1]
        s = ordered_sum(lambda c: q[:, :, c, None] * k[:, None, :, c], case.head_dim,
                        "sequential") * scale  # [hq, q_len, kv]
        s = s.to(logits_dtype).float()
        s = s.masked_fill(~visible_keys(q.shape[1], kv_len, case), float("-inf"))
        e = torch.exp((s - s.amax(-1, keepdim=True)).double()).float()
        total = ordered_sum(lambda j: e[..., j].clone(), kv_len, "sequential")
        p = (e / total[..., None]).to(probabilities_dtype).float()
        rows = ordered_sum(lambda j: p[..., j, None] * v[:, None, j, :], kv_len, "sequential")
        out[cu[i]:cu[i + 1]] = rows.permute(1, 0, 2)
    return out


def test_a_correct_float32_kernel_that_scales_after_the_product_passes() -> None:
    """The newcomer's kernel (``(q @ k^T) * scale``) in a fixed order, on a case found by
    drawing float32 cases at ``sm_scale`` 10: the yardstick's two draws of the logits'
    rounding fall short of this kernel's third (over 1x the allowance without the term),
    the term covers it; P rounded to bfloat16 still fails by far."""
    case = PagedCase(kv_lens=(13, 11, 48), num_q_heads=2, num_kv_heads=1, head_dim=64,
                     block_size=16, dtype="float32", sm_scale=10.0, seed=206139)
    inputs = materialize(case)
    expected = Expected.of(inputs)
    cu = inputs.cu_seqlens_q
    correct = _scale_after_product(inputs)
    without_term = compare(correct, Expected(expected.truth, expected.naive), "float32", cu)
    assert not without_term.passed and without_term.err_over_allowance > 1.2
    assert compare(correct, expected, "float32", cu).err_over_allowance < 0.2
    faulty = compare(_scale_after_product(inputs, torch.bfloat16), expected, "float32", cu)
    assert not faulty.passed and faulty.err_over_allowance > 20


def test_a_correct_float16_kernel_with_logits_near_1e4_passes() -> None:
    """Float16 with logits near 1e4 (head_dim 192, three sequences of 38 keys): float32's
    rounding of the logits, an ulp of 2**-10 there, outweighs the output's, and without
    the term the same kernel, its output rounded to float16, fails 43 of seeds 0-149
    (seed 127: 3.46x); with it, at most 0.53 of the allowance. A kernel whose logits are
    float16 (an ulp of 8 there) still fails by far, and so does an output of zeros."""
    case = PagedCase(kv_lens=(38, 38, 38), num_q_heads=1, num_kv_heads=1, head_dim=192,
                     block_size=64, dtype="float16", logit_offset=1e4, seed=127)
    inputs = materialize(case)
    expected = Expected.of(inputs)
    cu = inputs.cu_seqlens_q
    correct = _scale_after_product(inputs).half()
    without_term = compare(correct, Expected(expected.truth, expected.naive), "float16", cu)
    assert not without_term.passed and without_term.err_over_allowance > 3
    assert compare(correct, expected, "float16", cu).err_over_allowance < 0.6
    for wrong in (_scale_after_product(inputs, logits_dtype=torch.float16).half(),
                  torch.zeros_like(correct)):
        verdict = compare(wrong, expected, "float16", cu)
        assert not verdict.passed and verdict.err_over_allowance > 50, verdict.reason
