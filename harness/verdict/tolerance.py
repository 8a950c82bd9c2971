"""The tolerance policy: when is an implementation's output correct? (The one place.)

An output at dtype T passes when every element ``e`` of every sequence ``i`` satisfies

    |out_e - truth_e| <= ERROR_RATIO * yardstick_i + ULP_FLOOR[T] * ulp_T(max(|truth_e|, rms_i))
                         + logit_rounding_e

- ``truth``: float64 dense attention on the same (already rounded) inputs;
- ``yardstick_i``: the largest error on sequence ``i`` of naive attention at T with its
  logits in float32, every sum in a fixed order so that no host's BLAS moves it, the worse
  of two single-accumulator channel orders (:func:`~pagedbench.reference.yardstick_attention`,
  ``reference/yardstick.py``): FlashAttention's
  "at most twice the error of a same-precision PyTorch implementation"
  (``tests/test_flash_attn.py``), except that FlashAttention's reference also rounds the
  logits to T, which hides a low-precision accumulator (docs/tolerance.md has the
  measurement); an implementation that declares it computes its logits in T
  (``Capabilities.logits_precision = "case"``) is held to that yardstick instead. A
  sequence whose yardstick is not finite is held to the floor alone: NaN never widens an
  allowance;
- the floor: ``ULP_FLOOR[T]`` units in the last place of T at the truth's magnitude, floored
  at the sequence's RMS ``rms_i``, so that an exact yardstick (kv_len 1, window 1) still
  admits the rounding of the result every kernel makes (a truncating one included), and
  elements near zero get an absolute floor at the sequence's scale. It plays the part of
  FlashAttention-3's dtype-scaled ``fwd_atol = 2 * |(ref + 0.3) - 0.3 - ref|``
  (``hopper/test_flash_attn.py``) without vanishing for large outputs;
- ``logit_rounding_e``: what float32 rounding of the logits typically does to element
  ``e`` (:func:`~pagedbench.reference.logit_rounding`, three standard deviations): about 0
  unless the logits are large and the softmax spread, where the yardstick's two draws of
  that rounding and a correct kernel's third are random draws, and the third can fall
  outside twice the larger (docs/tolerance.md, "Large logits"). Every dtype gets it: a
  16-bit case's logits are float32 too, and near 1e4 their rounding outweighs the
  output's;
- in float32 and bfloat16, at least ``FLUSH_FLOOR`` (the smallest normal number, 2**-126):
  a result below it flushed to zero, as x86's AVX512_BF16 conversion and CUDA's ``-ftz``
  do, passes on every host;
- any NaN or Inf in the output fails; wrong shape or dtype fails before any value.

Errors are also reported in ulps of T at the same magnitude: the largest, and the mean
signed error toward larger magnitude (``sign(truth) * (out - truth)``), whose sign shows a
rounding mode (truncation toward zero: about -0.3 to -0.5; round to nearest: about 0).
The constants are calibrated by ``python -m pagedbench.harness.calibration.tolerance``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from pagedbench.reference import (DTYPES, PagedInputs, logit_rounding, reference_attention,
                                  yardstick_attention)
from pagedbench.reference.lse import reference_lse
from pagedbench.reference.yardstick import UNIT_ROUNDOFF_FP32

from pagedbench.harness.verdict.comparison import Checked, Comparison

#: k in ``k * yardstick + floor``: FlashAttention's factor for the forward output.
ERROR_RATIO = 2.0
#: Units in the last place of the output dtype added to every element's allowance. In
#: float16 and bfloat16 the output's own rounding dominates a correct kernel's error, so two
#: ulps cover a truncating conversion. In float32 nothing dominates: a kernel's float32
#: arithmetic (its exp, tanh and summation order) and the yardstick's differ by up to a few
#: hundred float32 ulps at the sequence's scale, 2**-15 of it (docs/tolerance.md).
ULP_FLOOR = {"float32": 256.0, "float16": 2.0, "bfloat16": 2.0}
#: Mantissa bits and smallest normal exponent of each output dtype (IEEE 754; bfloat16
#: has float32's exponent range).
_FORMAT = {"float32": (23, -126), "float16": (10, -14), "bfloat16": (7, -126)}
#: The least allowance of any element: float32's and bfloat16's smallest normal number
#: (2**-126), so that a result below it flushed to zero passes. Hardware does that: x86's
#: AVX512_BF16 conversion (VCVTNE2PS2BF16) flushes subnormal results, CUDA's ``-ftz``
#: float32 arithmetic too, so without it a verdict would depend on the host. float16's
#: subnormals (below 2**-14, 6.1e-5) are kept by its conversions and hold real values: none.
FLUSH_FLOOR = {"float32": 2.0**-126, "float16": 0.0, "bfloat16": 2.0**-126}


@dataclass(frozen=True)
class Expected:
    """What an output of one case is judged against, each ``Tensor[total_q, num_q_heads,
    v_head_dim]`` on the CPU: ``truth`` (float64), ``naive`` (the yardstick, case dtype) and
    ``logit_rounding`` (float64, :func:`~pagedbench.reference.logit_rounding`; None adds
    nothing); for an implementation that returns its log-sum-exp,
    ``lse`` and ``lse_scale`` (``Tensor[total_q, num_q_heads]``, float64,
    :func:`~pagedbench.reference.lse.reference_lse`; None otherwise)."""

    truth: torch.Tensor
    naive: torch.Tensor
    logit_rounding: torch.Tensor | None = None
    lse: torch.Tensor | None = None
    lse_scale: torch.Tensor | None = None

    @classmethod
    def of(cls, inputs: PagedInputs, logits_precision: str = "float32", *,
           where_they_are: bool = False, with_lse: bool = False) -> Expected:
        """Compute both from ``inputs``, moved to the CPU first or, with
        ``where_they_are``, on their own device (results brought to the CPU); the
        yardstick's logits in ``logits_precision`` (``reference.yardstick_attention``:
        ``"float32"``, or ``"case"`` for an implementation that declares it computes them
        in the case dtype); ``with_lse``: the log-sum-exp's truth too."""
        there = inputs if where_they_are else inputs.to("cpu")
        truth = reference_attention(there)
        rounding = logit_rounding(there, truth).cpu()
        lse, lse_scale = reference_lse(there) if with_lse else (None, None)
        return cls(truth.cpu(), yardstick_attention(there, truth, logits_precision).cpu(),
                   rounding, lse, lse_scale)


def ulp(magnitude: torch.Tensor, dtype: str) -> torch.Tensor:
    """Spacing of ``dtype`` at ``|magnitude|``, elementwise, float64 (subnormal spacing
    below the smallest normal; ``magnitude`` is any float tensor).

    Raises
    ------
    ValueError
        If ``dtype`` is not one of :data:`~pagedbench.reference.DTYPES`.
    """
    if dtype not in _FORMAT:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    mantissa_bits, min_exponent = _FORMAT[dtype]
    magnitude = magnitude.double().abs()
    _, exponent = torch.frexp(magnitude)  # |x| = m * 2**exponent, m in [0.5, 1); 0 gives 0
    exponent = torch.where(magnitude > 0, exponent - 1, min_exponent)  # floor(log2|x|)
    exponent = torch.clamp(exponent, min=min_exponent)  # subnormals: the normal min
    return torch.ldexp(torch.ones_like(magnitude, dtype=torch.float64),
                       exponent - mantissa_bits)


def _sequence_of(row: int, bounds: list[int]) -> int:
    """The sequence whose rows ``bounds[s]:bounds[s + 1]`` (``cu_seqlens_q``) hold ``row``."""
    return max(s for s in range(len(bounds) - 1) if bounds[s] <= row < bounds[s + 1])


def compare(
    out: object,
    expected: Expected,
    dtype: str,
    cu_seqlens_q: torch.Tensor | None = None,
) -> Comparison:
    """Judge ``out`` against ``expected`` under the policy above, sequence by sequence.

    Parameters
    ----------
    out : Tensor[total_q, num_q_heads, head_dim], case dtype
        Anything else (a tuple, None) fails as a wrong output type.
    expected : Expected
    dtype : str
        The case dtype name; the output must have it.
    cu_seqlens_q : Tensor[batch + 1], int, or None
        Row ranges of the sequences; ``None`` judges all rows as one sequence.
    """
    truth = expected.truth.double().cpu()
    nan = float("nan")

    def fail(reason: str, index: tuple[int, ...] | None = None) -> Comparison:
        return Comparison(False, reason, nan, nan, nan, index, max_rel_err=nan,
                          max_err_ulps=nan, mean_err_ulps=nan, naive_abs_err=nan,
                          err_ratio_vs_naive=nan)

    if not isinstance(out, torch.Tensor):
        return fail(f"output is a {type(out).__name__}, not a tensor")
    if tuple(out.shape) != tuple(truth.shape):
        return fail(f"output shape {tuple(out.shape)} != expected {tuple(truth.shape)}")
    if str(out.dtype).removeprefix("torch.") != dtype:
        return fail(f"output dtype {out.dtype} != case dtype {dtype}")
    if truth.numel() == 0:  # no query rows at all: nothing to get wrong
        return Comparison(True, "", 0.0, nan, 0.0, None, max_rel_err=0.0, max_err_ulps=0.0,
                          mean_err_ulps=0.0, naive_abs_err=nan, err_ratio_vs_naive=0.0)
    bounds = [0, truth.shape[0]] if cu_seqlens_q is None else [int(b) for b in cu_seqlens_q]
    out64 = out.detach().double().cpu()
    finite = torch.isfinite(out64)
    if not bool(finite.all()):
        row, head, channel = (int(i) for i in (~finite).nonzero()[0])
        seq = _sequence_of(row, bounds)
        index = (seq, row - bounds[seq], head, channel)
        count = int((~finite).sum())
        return fail(f"{count} non-finite output elements (first at sequence {index[0]}, "
                    f"row {index[1]}, head {index[2]}, channel {index[3]})", index)

    diff = out64 - truth  # [total_q, hq, d]
    naive_diff = (expected.naive.double().cpu() - truth).abs()  # NaN where not finite
    units = torch.empty_like(truth)  # ulp of each element at its policy magnitude
    allowed = (torch.zeros_like(truth) if expected.logit_rounding is None
               else expected.logit_rounding.double().cpu().clone())
    worst_ratio, yards = 0.0, {}
    for seq, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
        if hi == lo:
            continue
        t = truth[lo:hi]
        rms = float(t.pow(2).mean().sqrt())
        units[lo:hi] = ulp(torch.clamp(t.abs(), min=rms), dtype)
        yard = float(naive_diff[lo:hi].max())
        yards[seq] = yard
        yard = yard if math.isfinite(yard) else 0.0  # no finite yardstick: the floor alone
        allowed[lo:hi] += ERROR_RATIO * yard + ULP_FLOOR[dtype] * units[lo:hi]
        err = float(diff[lo:hi].abs().max())
        ratio = err / yard if yard > 0 else (0.0 if err == 0 else float("inf"))
        worst_ratio = max(worst_ratio, ratio)
    allowed.clamp_(min=FLUSH_FLOOR[dtype])
    over = diff.abs() / allowed  # [total_q, hq, d]
    flat = int(over.argmax())
    row, rest = divmod(flat, over.shape[1] * over.shape[2])
    head, channel = divmod(rest, over.shape[2])
    seq = _sequence_of(row, bounds)
    index = (seq, row - bounds[seq], head, channel)
    yard = yards[seq]
    err, allowance, ratio = (float(x.flatten()[flat]) for x in (diff.abs(), allowed, over))
    rounding = (0.0 if expected.logit_rounding is None
                else float(expected.logit_rounding.flatten()[flat]))
    signed_ulps = torch.sign(truth) * diff / units
    passed = ratio <= 1.0
    reason = "" if passed else (
        f"sequence {seq}: error {err:.3g} ({err / float(units.flatten()[flat]):.1f} ulps) at "
        f"row {index[1]}, head {head}, channel {channel} exceeds its allowance "
        f"{allowance:.3g} = {ERROR_RATIO:g} x its naive {dtype} error {yard:.3g} + "
        f"{ULP_FLOOR[dtype]:g} ulps + its logits' float32 rounding {rounding:.3g}"
        + (f", at least {FLUSH_FLOOR[dtype]:.3g}" if FLUSH_FLOOR[dtype] else "")
    )
    return Comparison(
        passed=passed,
        reason=reason,
        max_abs_err=float(diff.abs().max()),
        max_rel_err=float((diff.abs() / (truth.abs() + 1e-6)).max()),
        max_err_ulps=float((diff.abs() / units).max()),
        mean_err_ulps=float(signed_ulps.mean()),
        naive_abs_err=yard,
        err_ratio_vs_naive=worst_ratio,
        allowed_abs_err=allowance,
        err_over_allowance=ratio,
        worst_index=index,
    )


#: Float32 ulps every row is allowed at the larger of its LSE's magnitude and 1 (its own
#: rounding, the exp and log of a kernel's online softmax: ``lse = m + log(l)``, where the
#: largest term of ``l`` is ``e^0 = 1``, so ``l``'s relative rounding is an absolute
#: error of ``log(l)``, whatever ``lse``), and how many times the logits' rounding
#: (``Expected.lse_scale`` units of roundoff) on top.
LSE_ULP_FLOOR = 16.0
LSE_ROUNDING_FACTOR = 4.0
#: Unit roundoff of logits computed in each dtype (an implementation declaring
#: ``logits_precision="case"`` forms them in the case dtype).
_LOGITS_ROUNDOFF = {"float32": UNIT_ROUNDOFF_FP32, "float16": 2.0**-11, "bfloat16": 2.0**-8}


def compare_lse(lse: object, expected: Expected, dtype: str, logits_precision: str,
                cu_seqlens_q: torch.Tensor) -> Checked:
    """Judge a returned log-sum-exp (``Tensor[total_q, num_q_heads]``, float32, natural
    log) against ``expected.lse``: every row that sees a key within ``LSE_ULP_FLOOR``
    float32 ulps of the truth's magnitude (at least 1) plus ``LSE_ROUNDING_FACTOR`` times
    the logits' rounding (``u * expected.lse_scale``, ``u`` of float32, or of the case dtype for
    ``logits_precision="case"``). Rows that see no key are not judged (libraries return
    ``-inf``, ``+inf`` or 0 there). The :class:`Checked`'s ``worst_index`` is
    ``(sequence, query row, head)``, ``None`` when it passed.

    Raises
    ------
    ValueError
        If ``expected`` holds no LSE truth.
    """
    if expected.lse is None or expected.lse_scale is None:
        raise ValueError("expected has no LSE truth (Expected.of(..., with_lse=True))")
    nan = float("nan")
    truth = expected.lse
    if not isinstance(lse, torch.Tensor) or tuple(lse.shape) != tuple(truth.shape):
        shape = tuple(lse.shape) if isinstance(lse, torch.Tensor) else type(lse).__name__
        return Checked(False, f"log-sum-exp is {shape}, not a tensor of shape "
                       f"{tuple(truth.shape)}", nan, nan, nan, None)
    seen = torch.isfinite(truth)
    found = lse.detach().double().cpu()
    bad = seen & ~torch.isfinite(found)
    bounds = [int(b) for b in cu_seqlens_q]

    def where(row: int, head: int) -> tuple[int, int, int]:
        seq = _sequence_of(row, bounds)
        return (seq, row - bounds[seq], head)

    if bool(bad.any()):
        row, head = (int(i) for i in bad.nonzero()[0])
        return Checked(False, f"{int(bad.sum())} non-finite log-sum-exp values where "
                       f"the row sees a key (first at sequence, row, head "
                       f"{where(row, head)})", nan, nan, nan, where(row, head))
    if not bool(seen.any()):
        return Checked(True, "", 0.0, nan, 0.0, None)  # no row binds
    roundoff = _LOGITS_ROUNDOFF[dtype if logits_precision == "case" else "float32"]
    allowed = (LSE_ULP_FLOOR * ulp(truth.abs().clamp(min=1.0), "float32")
               + LSE_ROUNDING_FACTOR * roundoff * expected.lse_scale)
    error = torch.where(seen, (found - truth).abs(), 0.0)
    over = torch.where(seen, error / allowed, 0.0)
    flat = int(over.argmax())
    row, head = divmod(flat, over.shape[1])
    ratio, err = float(over[row, head]), float(error[row, head])
    passed = ratio <= 1.0
    reason = "" if passed else (
        f"log-sum-exp at sequence, row, head {where(row, head)}: {float(found[row, head]):.9g} "
        f"against {float(truth[row, head]):.9g}, error {err:.3g} over its allowance "
        f"{float(allowed[row, head]):.3g} ({ratio:.3g}x)")
    return Checked(passed, reason, float(error.max()), float(allowed[row, head]), ratio,
                   where(row, head) if not passed else None)


def assert_close_report(out: object, expected: Expected, dtype: str, label: str,
                        cu_seqlens_q: torch.Tensor | None = None) -> Comparison:
    """:func:`compare`, raising ``AssertionError`` with ``label`` and the figures on
    failure; returns the comparison otherwise."""
    result = compare(out, expected, dtype, cu_seqlens_q)
    if not result.passed:
        raise AssertionError(
            f"{label}: {result.reason} (max rel error {result.max_rel_err:.3g}, "
            f"ratio vs naive {result.err_ratio_vs_naive:.3g})"
        )
    return result


def assert_matches_truth(out: torch.Tensor, inputs: PagedInputs, label: str) -> Comparison:
    """Judge ``out`` against the truth and yardstick of ``inputs`` (computed on the CPU),
    sequence by sequence; everything is derived from the inputs, so no caller can forget
    the per-sequence row ranges.

    Raises
    ------
    AssertionError
        With ``label`` and the figures, when the output fails the policy.
    """
    return assert_close_report(out, Expected.of(inputs), inputs.case.dtype, label,
                               inputs.cu_seqlens_q.cpu())
