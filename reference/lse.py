"""The log-sum-exp of each query row's logits, and how far float32 logits move it.

Split-KV kernels, FlashAttention and FlashInfer return, beside the output, the natural
logarithm of each row's softmax denominator, ``lse = log(sum_j exp(s_j))`` over the keys
the row sees (plus ``exp(sink)`` with sinks), so that partial states can be merged
(FlashInfer's ``merge_state``: ``o = (o_a e^{lse_a} + o_b e^{lse_b}) / (e^{lse_a} +
e^{lse_b})``). :func:`reference_lse` computes it in float64 from the same logits as the
truth (``reference/dense.py``); a row that sees no key has no denominator (``-inf``;
libraries disagree on what to return there, so such rows are not judged).

``dlse/ds_j = p_j``, so the logits' float32 rounding (each ``s_j`` off by about ``u e_j``,
``e_j`` as in :func:`~.yardstick.logit_rounding`) moves the LSE by at most ``u sum_j p_j
e_j``: :func:`reference_lse` returns that sum as the error scale the tolerance policy
(``harness/verdict/tolerance.py``) allows a multiple of.
"""

from __future__ import annotations

import math

import torch

from .dense import _checked, attention_weights, dequantize, gather_kv, masked_logits
from .inputs import PagedInputs


def reference_lse(inputs: PagedInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """The float64 log-sum-exp of every query row and head, and its error scale.

    Returns
    -------
    lse : Tensor[total_q, num_q_heads], float64, CPU
        Natural log of the softmax denominator (the sink included); ``-inf`` for a row
        that sees no key.
    scale : Tensor[total_q, num_q_heads], float64, CPU
        ``sum_j p_j e_j`` with ``e_j = sqrt(head_dim) a_j (1 - tanh^2(x_j / cap)) +
        |s_j|``, ``a_j = sm_scale sum_d |q_d k_jd|``: a logit rounding of ``u e_j`` each
        moves the LSE by at most ``u`` times this (0 where no key is seen).

    Raises
    ------
    PagedTypeError, PagedValueError
        If ``inputs`` is not a consistent :class:`PagedInputs`.
    """
    inputs = _checked(inputs).to("cpu")
    case = inputs.case
    f64 = torch.float64
    cu = inputs.cu_seqlens_q.tolist()
    lse = torch.full((case.total_q, case.num_q_heads), float("-inf"), dtype=f64)
    scale = torch.zeros(case.total_q, case.num_q_heads, dtype=f64)
    for i, (k, _) in enumerate(gather_kv(inputs)):
        q = inputs.q[cu[i] : cu[i + 1]].to(f64)  # [q_len, hq, d]
        if q.shape[0] == 0 or k.shape[0] == 0:
            continue
        k = dequantize(k, case.k_scale, f64)  # [kv_len, hkv, d]
        logits = masked_logits(q, k, case, inputs.alibi_slopes)  # [hq, q_len, kv_len]
        seen = torch.isfinite(logits).any(-1)  # [hq, q_len]
        denominator = torch.logsumexp(logits, dim=-1)  # [hq, q_len], -inf when none seen
        if inputs.sinks is not None:
            sink = inputs.sinks.to(f64)[:, None].expand_as(denominator)
            denominator = torch.logaddexp(denominator, sink)
        weights = attention_weights(logits, case, inputs.sinks)  # [hq, q_len, kv_len]
        k_rep = k.repeat_interleave(case.gqa_ratio, dim=1)  # [kv_len, hq, d]
        error = torch.einsum("qhd,khd->hqk", (q * case.scale).abs(), k_rep.abs())
        error = error * math.sqrt(case.head_dim)
        if case.logits_soft_cap is not None:
            raw = torch.einsum("qhd,khd->hqk", q * case.scale, k_rep) / case.logits_soft_cap
            error = error * (1 - torch.tanh(raw).square())
        error = error + logits.abs().nan_to_num(posinf=0.0)  # hidden keys: weight 0
        rows = slice(cu[i], cu[i + 1])
        lse[rows] = torch.where(seen, denominator, float("-inf")).T
        scale[rows] = (weights * error).sum(-1).T
    return lse, scale


__all__ = ["reference_lse"]
