"""The naive yardstick: attention at the case dtype the way a plain kernel computes it, with
every reduction in a fixed, explicit order, so that its rounding is the same on every host.

The tolerance policy (``harness/verdict/tolerance.py``) allows an implementation a multiple of the
error this naive computation makes. If it called a matmul or ``torch.softmax``, its float32
sums would run in whatever order the host's BLAS and vector units take (blocked by 8 with
AVX2, by 16 with AVX-512, tiles with AMX), and the allowance, hence the verdict, would move
with the host. Here every sum is a chain of elementwise ``torch.add`` calls on float32
tensors, each rounded once to nearest (IEEE 754), in an order written below; ``exp`` and
``tanh`` are computed in float64 and rounded to float32 once, since vectorised float32
libraries differ between ISAs in the last bit. No call reaches a host matmul kernel, and
splitting the work into chunks of query rows never changes an order.

The arithmetic, per sequence and query row (a scalar kernel's):

- logits: ``q * sm_scale`` rounded to float32, then ``sum_d q_d k_d`` with the products and
  the running sum in float32, over the channels in :data:`SUM_ORDERS` order; soft cap,
  ALiBi and masking in float32 (``logits_precision="case"``: the logits then rounded to the
  case dtype, as FlashAttention's same-precision reference rounds them);
- softmax: ``exp(s - max)`` in float32, its sum over the keys pairwise within tiles of
  :data:`KEY_TILE` keys and tile after tile; probabilities ``e / sum`` in float32, rounded
  to the case dtype;
- output: ``sum_j p_j v_j`` over the keys, products (exact for 16-bit inputs) and sums in
  float32 in the same key order, rounded once to the case dtype.

The yardstick is the larger error of :data:`YARDSTICK_ORDERS` (:func:`yardstick_attention`).
Beside it, :func:`logit_rounding` gives what float32 rounding of the logits typically does
to each output element, which two yardstick draws do not always cover when the logits
are large (in float32, and in float16 and bfloat16 near 1e4).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from .case import PagedCase
from .dense import (_checked, attention_weights, dequantize, gather_kv, masked_logits,
                    visible_keys)
from .errors import PagedTypeError, PagedValueError
from .inputs import PagedInputs

#: Orders of the float32 sum over the head_dim channels of a logit: ``sequential`` (one
#: accumulator, channel 0 first), ``reversed`` (last channel first), ``pairwise`` (a
#: balanced tree), ``blocked8`` / ``blocked16`` (8 or 16 accumulators taking channels
#: round-robin, as a SIMD loop's lanes do with AVX2 / AVX-512, then summed by halving).
SUM_ORDERS = ("sequential", "reversed", "pairwise", "blocked8", "blocked16")
#: The orders whose larger error is the yardstick: single-accumulator sums, the orders
#: whose partial sums (hence roundings) are largest, from either end of the channels, so
#: that an outlier channel (``logit_offset`` sits in channel 0) is added first once.
YARDSTICK_ORDERS = ("sequential", "reversed")
#: Keys per tile of the sums over keys (pairwise inside a tile, tiles in key order).
KEY_TILE = 64
#: Elements per float32 work tensor (32 MiB); query rows are taken in chunks that stay
#: below it. Chunking rows never changes an order (every row is summed alone).
_CHUNK_ELEMENTS = 1 << 23
#: float32's unit roundoff (IEEE 754 round to nearest: half an ulp of 1).
UNIT_ROUNDOFF_FP32 = 2.0**-24
#: Standard deviations of the logits' rounding that :func:`logit_rounding` allows.
LOGIT_ROUNDING_SIGMAS = 3.0
#: Where the yardstick computes its logits and softmax: ``"float32"`` (as a kernel's
#: Q.K^T accumulates) or ``"case"`` (rounded to the case dtype, as FlashAttention's
#: reference does).
LOGITS_PRECISIONS = ("float32", "case")


def _check_order(order: str) -> None:
    if order not in SUM_ORDERS:
        raise PagedValueError("order", order, f"one of {SUM_ORDERS}")


def ordered_sum(term: Callable[[int], torch.Tensor], n: int, order: str) -> torch.Tensor:
    """``term(0) + ... + term(n - 1)`` in float32, added in ``order`` (:data:`SUM_ORDERS`),
    elementwise, each addition rounded once. ``term(j)`` returns a new float32 tensor (all
    of one shape), which the sum may overwrite; ``n >= 1``.

    Raises
    ------
    PagedValueError
        If ``order`` is not one of :data:`SUM_ORDERS` or ``n < 1``.
    """
    _check_order(order)
    if n < 1:
        raise PagedValueError("n", n, "at least 1")
    if order in ("sequential", "reversed"):
        indices = range(n) if order == "sequential" else range(n - 1, -1, -1)
        it = iter(indices)
        acc = term(next(it))
        for j in it:
            acc.add_(term(j))
        return acc
    if order == "pairwise":  # a binary counter: merge equal-sized partial sums
        stack: list[tuple[int, torch.Tensor]] = []
        for j in range(n):
            size, acc = 1, term(j)
            while stack and stack[-1][0] == size:
                left_size, left = stack.pop()
                size, acc = size + left_size, left.add_(acc)
            stack.append((size, acc))
        acc = stack.pop()[1]
        while stack:
            acc = stack.pop()[1].add_(acc)
        return acc
    lanes = 8 if order == "blocked8" else 16
    partial: list[torch.Tensor] = []
    for j in range(n):
        if j < lanes:
            partial.append(term(j))
        else:
            partial[j % lanes].add_(term(j))
    while len(partial) > 1:  # horizontal sum: the upper half onto the lower half
        half = (len(partial) + 1) // 2
        partial = [partial[i].add_(partial[i + half]) if i + half < len(partial) else partial[i]
                   for i in range(half)]
    return partial[0]


def _key_sum(tile: Callable[[int, int], torch.Tensor], kv_len: int) -> torch.Tensor:
    """Sum over the keys of float32 terms, ``tile(start, stop)`` giving those of keys
    ``start .. stop - 1`` along dim 2 (a new tensor, summed in place): pairwise by halving
    inside each tile of :data:`KEY_TILE` keys (of ``w`` keys, key ``i < w // 2`` takes key
    ``i + w - w // 2``; an odd middle key waits for the next level), the tiles added in
    key order."""
    total = None
    for start in range(0, kv_len, KEY_TILE):
        part = tile(start, min(kv_len, start + KEY_TILE))
        width = part.shape[2]
        while width > 1:
            half = width // 2
            part[:, :, :half] += part[:, :, width - half : width]  # key i with i + width - half
            width -= half
        part = part[:, :, 0]
        total = part if total is None else total.add_(part)
    return total


def _via_float64(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """``fn`` of float32 ``x`` computed in float64 and rounded to float32 once."""
    return fn(x.double()).float()


def naive_logits(q: torch.Tensor, k: torch.Tensor, case: PagedCase,
                 alibi_slopes: torch.Tensor | None = None, order: str = "sequential", *,
                 first_row: int = 0, q_len: int | None = None) -> torch.Tensor:
    """Float32 logits of query rows of one sequence as the yardstick computes them
    (module docstring), channel sums in ``order``: scaled, soft-capped, ALiBi-biased and
    ``-inf`` where the causal mask or the window hides a key.

    Parameters
    ----------
    q : Tensor[rows, num_q_heads, head_dim], float32
        Rows ``first_row .. first_row + rows - 1`` of a sequence of ``q_len`` queries
        (``q_len`` defaults to ``rows``).
    k : Tensor[kv_len, num_kv_heads, head_dim], float32 (dequantized)
    case : PagedCase
    alibi_slopes : Tensor[num_q_heads] or None
    order : str
        One of :data:`SUM_ORDERS`.

    Returns
    -------
    Tensor[num_q_heads, rows, kv_len], float32

    Raises
    ------
    PagedValueError
        If ``order`` is not one of :data:`SUM_ORDERS`.
    """
    _check_order(order)
    rows, kv_len = q.shape[0], k.shape[0]
    q_len = rows if q_len is None else q_len
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)  # [kv_len, hq, d]
    q_scaled = (q * case.scale).permute(1, 2, 0).contiguous()  # [hq, d, rows], float32
    k_heads = k.permute(1, 2, 0).contiguous()  # [hq, d, kv_len]
    scores = ordered_sum(lambda j: q_scaled[:, j, :, None] * k_heads[:, j, None, :],
                         case.head_dim, order)  # [hq, rows, kv_len]
    if case.logits_soft_cap is not None:
        cap = case.logits_soft_cap
        scores = cap * _via_float64(torch.tanh, scores / cap)
    if alibi_slopes is not None:
        pos_q = torch.arange(kv_len - q_len + first_row, kv_len - q_len + first_row + rows,
                             device=q.device)[:, None]  # [rows, 1]
        pos_k = torch.arange(kv_len, device=q.device)[None, :]  # [1, kv_len]
        distance = (pos_q - pos_k).float()  # [rows, kv_len]
        scores = scores - alibi_slopes.float()[:, None, None] * distance
    visible = visible_keys(q_len, kv_len, case, q.device)[first_row : first_row + rows]
    return scores.masked_fill(~visible, float("-inf"))


def _naive_rows(scores: torch.Tensor, v: torch.Tensor, case: PagedCase,
                sinks: torch.Tensor | None) -> torch.Tensor:
    """The yardstick's softmax and P.V for masked float32 ``scores [hq, rows, kv_len]``
    (:func:`naive_logits`, rounded already for ``logits_precision="case"``) and float32
    ``v [kv_len, hq, dv]`` (heads repeated): ``Tensor[hq, rows, dv]``, float32 before the
    output's rounding; a row that sees no key gives 0."""
    kv_len = v.shape[0]
    peak = scores.amax(-1, keepdim=True)  # [hq, rows, 1]
    sink = None
    if sinks is not None:
        sink = sinks.float()[:, None, None].expand_as(peak)  # [hq, rows, 1]
        peak = torch.maximum(peak, sink)
    seen = (scores != float("-inf")).any(-1, keepdim=True)  # [hq, rows, 1]; NaN is seen
    peak = torch.where(seen, peak, torch.zeros_like(peak))
    weights = _via_float64(torch.exp, scores - peak)  # [hq, rows, kv_len]; hidden keys 0
    total = _key_sum(lambda a, b: weights[:, :, a:b].clone(), kv_len)  # [hq, rows]
    if sink is not None:
        total = total + _via_float64(torch.exp, sink - peak).squeeze(-1)
    probs = (weights / total[..., None]).to(case.torch_dtype).float()  # rounded to T
    probs = probs.masked_fill(~seen, 0.0)
    v_heads = v.permute(1, 0, 2)  # [hq, kv_len, dv]
    hq, rows, dv = probs.shape[0], probs.shape[1], v.shape[-1]
    step = max(1, _CHUNK_ELEMENTS // (hq * KEY_TILE * dv))  # rows per product tile
    out = torch.empty(hq, rows, dv, device=probs.device)
    for lo in range(0, rows, step):
        p = probs[:, lo : lo + step]  # [hq, step, kv_len]
        out[:, lo : lo + step] = _key_sum(
            lambda a, b: p[:, :, a:b, None] * v_heads[:, None, a:b, :], kv_len)
    return out  # [hq, rows, dv]; the products are exact for 16-bit p and v


def naive_attention(inputs: PagedInputs, logits_precision: str = "float32",
                    order: str = "sequential") -> torch.Tensor:
    """The same math done naively at the case dtype (module docstring), its channel sums
    in ``order``. ``Tensor[total_q, num_q_heads, v_head_dim]``, case dtype. An fp8 cache
    is dequantized into the case dtype first, so that the yardstick, like the truth,
    measures attention on the values the cache stands for.

    Parameters
    ----------
    inputs : PagedInputs
    logits_precision : str
        ``"float32"``, or ``"case"`` for implementations that declare they compute their
        logits in the case dtype (``Capabilities.logits_precision``).
    order : str
        One of :data:`SUM_ORDERS`.

    Raises
    ------
    PagedTypeError, PagedValueError
        If ``inputs`` is not a consistent :class:`PagedInputs`, or ``logits_precision`` or
        ``order`` is not one of the allowed values.
    """
    if logits_precision not in LOGITS_PRECISIONS:
        raise PagedValueError("logits_precision", logits_precision,
                              f"one of {LOGITS_PRECISIONS}")
    _check_order(order)
    inputs = _checked(inputs)
    case = inputs.case
    dtype = case.torch_dtype
    logits_dtype = None if logits_precision == "float32" else dtype
    cu = inputs.cu_seqlens_q.tolist()
    out = torch.zeros(case.total_q, case.num_q_heads, case.v_head_dim, dtype=dtype,
                      device=inputs.device)
    for i, (k, v) in enumerate(gather_kv(inputs)):
        q = inputs.q[cu[i] : cu[i + 1]].float()  # [q_len, hq, d]
        q_len, kv_len = q.shape[0], k.shape[0]
        if q_len == 0 or kv_len == 0:
            continue  # no rows, or rows that see no key: 0
        k = dequantize(k, case.k_scale, dtype).float()
        v = dequantize(v, case.v_scale, dtype).float().repeat_interleave(case.gqa_ratio, 1)
        chunk = max(1, _CHUNK_ELEMENTS // (case.num_q_heads * kv_len))  # rows of logits
        for lo in range(0, q_len, chunk):
            hi = min(q_len, lo + chunk)
            scores = naive_logits(q[lo:hi], k, case, inputs.alibi_slopes, order,
                                  first_row=lo, q_len=q_len)  # [hq, rows, kv_len]
            if logits_dtype is not None:
                scores = scores.to(logits_dtype).float()
            rows = _naive_rows(scores, v, case, inputs.sinks)  # [hq, rows, dv]
            out[cu[i] + lo : cu[i] + hi] = rows.permute(1, 0, 2).to(dtype)
    return out


def yardstick_attention(inputs: PagedInputs, truth: torch.Tensor,
                        logits_precision: str = "float32") -> torch.Tensor:
    """The yardstick of the tolerance policy: per sequence, the rows of whichever of
    :data:`YARDSTICK_ORDERS` is further from ``truth`` (its largest finite error), as
    :func:`naive_attention`'s ``Tensor[total_q, num_q_heads, v_head_dim]``, case dtype.

    ``truth`` is :func:`~pagedbench.reference.reference_attention` of ``inputs``
    (float64, same shape). Raises as :func:`naive_attention`.
    """
    outputs = [naive_attention(inputs, logits_precision, order) for order in YARDSTICK_ORDERS]
    chosen = outputs[0].clone()
    cu = inputs.cu_seqlens_q.tolist()
    for lo, hi in zip(cu, cu[1:]):
        errors = [(out[lo:hi].double() - truth[lo:hi].to(out.device)).abs()
                  .nan_to_num(nan=-1.0, posinf=-1.0).amax().item() if hi > lo else 0.0
                  for out in outputs]
        chosen[lo:hi] = outputs[max(range(len(outputs)), key=errors.__getitem__)][lo:hi]
    return chosen


def logit_rounding(inputs: PagedInputs, truth: torch.Tensor) -> torch.Tensor:
    """What float32 rounding of the logits does to each output element, typically:
    ``LOGIT_ROUNDING_SIGMAS * u * sqrt(sum_j (p_j e_j)^2 (v_j - o)^2)`` per (row, head,
    channel), ``e_j = sqrt(head_dim) a_j (1 - tanh^2(x_j / cap)) + |s_j|``.

    ``dO/ds_j = p_j (v_j - o)`` (the softmax's derivative; a sink takes a share of the
    denominator and gives no value, which keeps the form). A float32 logit formed as a
    ``head_dim``-term dot product in any order is off by about ``sqrt(head_dim) * u *
    a_j``, ``a_j = sm_scale * sum_d |q_d k_jd|`` (Higham and Mary, "A new approach to
    probabilistic rounding error analysis", SIAM J. Sci. Comput. 41(5), 2019; the worst case
    is ``head_dim * u * a_j``); a soft cap scales that by its derivative ``1 - tanh^2(x_j /
    cap)`` (``x_j`` the logit before it), and the few roundings after the sum (a scale
    applied after the product, the cap's tanh and product, ALiBi's addition) add ``u
    |s_j|``, ``s_j`` the final logit. The logits' errors are independent draws, so they add
    in quadrature over the keys; ``LOGIT_ROUNDING_SIGMAS`` standard deviations are allowed.
    ``u`` is :data:`UNIT_ROUNDOFF_FP32`; ``p_j`` are the float64 weights, ``o`` is
    ``truth``. One key seen gives 0 (up to float64 rounding of the expanded sum), a peaked
    softmax about 0, logits spread far from 0 the most (docs/tolerance.md has the
    measurement).

    Parameters
    ----------
    inputs : PagedInputs
    truth : Tensor[total_q, num_q_heads, v_head_dim], float64
        :func:`~pagedbench.reference.reference_attention` of ``inputs``.

    Returns
    -------
    Tensor[total_q, num_q_heads, v_head_dim], float64, on ``truth``'s device

    Raises
    ------
    PagedTypeError, PagedValueError
        If ``inputs`` is not a consistent :class:`PagedInputs`, or ``truth`` is not a
        float64 tensor of its output's shape.
    """
    inputs = _checked(inputs)
    case = inputs.case
    f64 = torch.float64
    shape = (case.total_q, case.num_q_heads, case.v_head_dim)
    if not isinstance(truth, torch.Tensor):
        raise PagedTypeError("truth", truth, f"a float64 tensor of shape {list(shape)}")
    if truth.dtype != f64 or tuple(truth.shape) != shape:
        raise PagedValueError("truth", f"{truth.dtype} {list(truth.shape)}",
                              f"a float64 tensor of shape {list(shape)} (total_q, "
                              "num_q_heads, v_head_dim)")
    cu = inputs.cu_seqlens_q.tolist()
    variance = torch.zeros(case.total_q, case.num_q_heads, case.v_head_dim, dtype=f64,
                           device=truth.device)
    group = case.gqa_ratio
    for i, (k, v) in enumerate(gather_kv(inputs)):
        q = inputs.q[cu[i] : cu[i + 1]].to(f64)  # [q_len, hq, d]
        q_len, kv_len = q.shape[0], k.shape[0]
        if q_len == 0 or kv_len == 0:
            continue
        k = dequantize(k, case.k_scale, f64)  # [kv_len, hkv, d]
        v = dequantize(v, case.v_scale, f64).permute(1, 0, 2)  # [hkv, kv_len, dv]
        final = masked_logits(q, k, case, inputs.alibi_slopes)  # [hq, q_len, kv_len]
        weights = attention_weights(final, case, inputs.sinks)
        # each logit's error in units of u: sqrt(d) a_j through the cap, then |s_j|; the
        # query heads of a KV head side by side ([hkv, group, ...]), K never repeated
        q_groups = (q * case.scale).reshape(q_len, case.num_kv_heads, group, case.head_dim)
        error = torch.einsum("qhgd,khd->hgqk", q_groups.abs(), k.abs())
        error *= math.sqrt(case.head_dim)
        if case.logits_soft_cap is not None:
            raw = torch.einsum("qhgd,khd->hgqk", q_groups, k) / case.logits_soft_cap
            error *= 1 - torch.tanh(raw).square_()
            del raw
        error = error.view_as(final).add_(final.abs().nan_to_num_(posinf=0.0))  # -inf: hidden
        del final
        weights = weights.mul_(error).square_().view(case.num_kv_heads, group * q_len, kv_len)
        del error  # weights: (p_j error_j)^2, the rows of a KV head's query heads together
        o = truth[cu[i] : cu[i + 1]].to(q.device).permute(1, 0, 2).reshape(
            case.num_kv_heads, group * q_len, case.v_head_dim)
        # sum_j w_j (v_j - o)^2 = w @ v^2 - 2 o (w @ v) + o^2 sum_j w_j
        spread = (weights @ v.square() - 2 * o * (weights @ v)
                  + o.square() * weights.sum(-1, keepdim=True))
        spread = spread.view(case.num_q_heads, q_len, case.v_head_dim)
        variance[cu[i] : cu[i + 1]] = spread.clamp_(min=0.0).permute(1, 0, 2).to(truth.device)
    return variance.sqrt_() * (LOGIT_ROUNDING_SIGMAS * UNIT_ROUNDOFF_FP32)


__all__ = ["KEY_TILE", "LOGITS_PRECISIONS", "LOGIT_ROUNDING_SIGMAS", "SUM_ORDERS",
           "UNIT_ROUNDOFF_FP32", "YARDSTICK_ORDERS", "logit_rounding", "naive_attention",
           "naive_logits", "ordered_sum", "yardstick_attention"]
