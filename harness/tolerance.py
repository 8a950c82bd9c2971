"""The tolerance policy: when is an implementation's output correct? (The one place.)

Policy (FlashAttention's test policy, ``tests/test_flash_attn.py``: "the error of our
output is at most twice the error of a same-precision PyTorch implementation"; FA3's
``hopper/test_flash_attn.py`` adds the absolute floor; see
shared/research/anchors.md s. 4.2 and b.2):

- ground truth is float64 dense attention on the same (already rounded) inputs
  (:func:`pagedbench.reference.reference_attention`);
- the yardstick is naive attention computed in the case dtype on the same inputs
  (:func:`pagedbench.reference.naive_attention`);
- an output passes when, for every sequence of the batch,
  ``max|out - truth| <= ERROR_RATIO * max|naive - truth| + ATOL_FLOOR`` over that
  sequence's rows (each sequence is held to its own yardstick);
- any NaN or Inf in the output fails (outputs are poisoned with NaN before the run and
  unused KV slots hold NaN, so a missed write or an out-of-bounds read fails here);
- wrong shape or dtype fails before any value is compared.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedbench.reference import PagedInputs, naive_attention, reference_attention

#: k in ``max_err <= k * naive_err + floor``: FlashAttention uses 2 for plain attention.
ERROR_RATIO = 2.0
#: Absolute floor added to the allowance (FlashAttention's ``+ 1e-5``); it matters when the
#: naive error is ~0, e.g. float32, or kv_len 1 where the output is V itself.
ATOL_FLOOR = 1e-5


@dataclass(frozen=True)
class Comparison:
    """The outcome of comparing one output with the truth.

    Attributes
    ----------
    passed : bool
    reason : str
        Empty when passed; otherwise what failed, with the figures.
    max_abs_err, max_rel_err : float
        Against the float64 truth; ``nan`` when the output is not finite or misshaped.
        Relative error is ``|out - truth| / (|truth| + 1e-6)``.
    naive_abs_err : float
        ``max|naive - truth|`` over the binding sequence (the one with the least margin):
        its yardstick.
    err_ratio_vs_naive : float
        The largest per-sequence ``max|out - truth| / max|naive - truth|`` (``inf`` when a
        yardstick is 0 and the error isn't).
    allowed_abs_err : float
        ``ERROR_RATIO * naive_abs_err + ATOL_FLOOR``, the binding sequence's allowance.
    worst_index : tuple[int, int, int] or None
        ``(token, head, channel)`` of the largest error in the binding sequence, or of
        the first non-finite value.
    """

    passed: bool
    reason: str
    max_abs_err: float
    max_rel_err: float
    naive_abs_err: float
    err_ratio_vs_naive: float
    allowed_abs_err: float
    worst_index: tuple[int, ...] | None


def compare(
    out: object,
    truth: torch.Tensor,
    naive: torch.Tensor,
    dtype: str,
    cu_seqlens_q: torch.Tensor | None = None,
) -> Comparison:
    """Judge ``out`` against ``truth`` under the policy above, sequence by sequence.

    Each sequence is held to its own yardstick: ``max|out_i - truth_i| <= ERROR_RATIO *
    max|naive_i - truth_i| + ATOL_FLOOR``. (One allowance for the whole batch would let
    the rounding noise of a short sequence, whose outputs are large, hide an error on a
    long one, whose outputs average many values and are small.)

    Parameters
    ----------
    out : Tensor[total_q, num_q_heads, head_dim], case dtype
        Anything else (a tuple, None) fails as a wrong output type.
    truth : Tensor[total_q, num_q_heads, head_dim], float64
    naive : Tensor[total_q, num_q_heads, head_dim], case dtype
    dtype : str
        The case dtype name; the output must have it.
    cu_seqlens_q : Tensor[batch + 1], int, or None
        Row ranges of the sequences; ``None`` judges all rows as one sequence.

    Returns
    -------
    Comparison
        ``max_abs_err`` and ``max_rel_err`` over all rows; ``naive_abs_err`` and
        ``allowed_abs_err`` of the binding sequence (the one with the least margin);
        ``err_ratio_vs_naive`` the largest per-sequence ratio.
    """
    truth = truth.double().cpu()
    nan = float("nan")

    def fail(reason: str, index: tuple[int, ...] | None = None) -> Comparison:
        return Comparison(False, reason, nan, nan, nan, nan, nan, index)

    if not isinstance(out, torch.Tensor):
        return fail(f"output is a {type(out).__name__}, not a tensor")
    if tuple(out.shape) != tuple(truth.shape):
        return fail(f"output shape {tuple(out.shape)} != expected {tuple(truth.shape)}")
    if str(out.dtype).removeprefix("torch.") != dtype:
        return fail(f"output dtype {out.dtype} != case dtype {dtype}")
    out64 = out.detach().double().cpu()
    finite = torch.isfinite(out64)
    if not bool(finite.all()):
        index = tuple(int(i) for i in (~finite).nonzero()[0])
        count = int((~finite).sum())
        return fail(f"{count} non-finite output elements (first at {index})", index)
    diff = (out64 - truth).abs()
    naive_diff = (naive.double().cpu() - truth).abs()
    bounds = [0, truth.shape[0]] if cu_seqlens_q is None else [int(b) for b in cu_seqlens_q]
    binding = None  # (margin, seq, err, naive_err, allowed)
    worst_ratio = 0.0
    for seq, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
        if hi == lo:
            continue
        err, naive_err = float(diff[lo:hi].max()), float(naive_diff[lo:hi].max())
        allowed = ERROR_RATIO * naive_err + ATOL_FLOOR
        ratio = err / naive_err if naive_err > 0 else (0.0 if err == 0 else float("inf"))
        worst_ratio = max(worst_ratio, ratio)
        if binding is None or allowed - err < binding[0]:
            binding = (allowed - err, seq, err, naive_err, allowed)
    _, seq, err, naive_err, allowed = binding
    max_err = float(diff.max())
    lo = bounds[seq]
    local = torch.unravel_index(diff[lo : bounds[seq + 1]].argmax(), diff[lo:].shape)
    index = (lo + int(local[0]), int(local[1]), int(local[2]))
    rel = float((diff / (truth.abs() + 1e-6)).max())
    passed = err <= allowed
    reason = "" if passed else (
        f"sequence {seq}: max abs error {err:.3g} at {index} exceeds {allowed:.3g} "
        f"({ERROR_RATIO:g} x its naive {dtype} error {naive_err:.3g} + {ATOL_FLOOR:g})"
    )
    return Comparison(passed, reason, max_err, rel, naive_err, worst_ratio, allowed, index)


def assert_close_report(
    out: torch.Tensor,
    truth: torch.Tensor,
    naive: torch.Tensor,
    dtype: str,
    case_id: str,
    cu_seqlens_q: torch.Tensor | None = None,
) -> Comparison:
    """:func:`compare`, raising ``AssertionError`` with the case id and figures on failure."""
    result = compare(out, truth, naive, dtype, cu_seqlens_q)
    if not result.passed:
        raise AssertionError(
            f"{case_id}: {result.reason} (max rel error {result.max_rel_err:.3g}, "
            f"ratio vs naive {result.err_ratio_vs_naive:.3g})"
        )
    return result


def assert_matches_truth(out: torch.Tensor, inputs: PagedInputs, label: str) -> Comparison:
    """Judge ``out`` against the float64 truth and naive yardstick of ``inputs`` (computed
    on the CPU), sequence by sequence; :func:`assert_close_report` with everything derived
    from the inputs, so no caller can forget the per-sequence row ranges.

    Raises
    ------
    AssertionError
        With ``label`` and the figures, when the output fails the policy.
    """
    cpu = inputs.to("cpu")
    return assert_close_report(out, reference_attention(cpu), naive_attention(cpu),
                               inputs.case.dtype, label, cpu.cu_seqlens_q)
