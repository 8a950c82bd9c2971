"""Ground truth: dense attention over the logical K/V, gathered through the block table.

Paging changes where K and V live, never the math. The truth for a case is ordinary
attention, per sequence, over the K/V that the block table addresses, computed in
float64 from the very values (already rounded to the case dtype) that kernels read.

The gather walks the block table in plain Python, one token at a time
(``block_tables[i][t // block_size]``, offset ``t % block_size``): no kernel and no
vectorised index arithmetic that could share a bug with the kernels under test.

Semantics pinned here (vLLM's, FlashAttention's and FlashInfer's kernels and tests agree on
each):

- GQA: query head ``h`` reads KV head ``h // (num_q_heads // num_kv_heads)``.
- Causal, aligned bottom-right: query ``i`` of a sequence with ``q_len`` queries and
  ``kv_len`` keys sits at position ``kv_len - q_len + i`` and sees keys ``<=`` it.
- Sliding window ``W``: additionally keys ``> position - W``.
- A query row that sees no key (``kv_len`` 0, or a position below 0 when ``q_len >
  kv_len``) outputs 0, with or without a sink (FlashAttention: "if the row of the mask
  is all zero, the output will be zero"); a sequence with ``q_len`` 0 has no rows.
- Soft cap ``c``: scaled logits ``s`` become ``c * tanh(s / c)`` before masking.
- ALiBi: after the soft cap, ``-slope[h] * (query position - key position)`` is added
  (vLLM's CPU test reference applies the cap first and the bias after; FlashAttention
  adds the bias to the scaled scores).
- Sinks: one extra logit per query head in the softmax denominator, with no value
  (vLLM's ``s_aux``: ``softmax([sink, logits])[1:]``; gpt-oss).
- fp8 KV cache: the math runs on the dequantized values ``stored * k_scale`` and
  ``stored * v_scale``, so the tolerance measures the kernel and not the quantization
  (FlashInfer's fp8 tests compare against the same dequantized cache).
"""

from __future__ import annotations

import torch

from .case import PagedCase
from .errors import PagedTypeError, PagedValueError
from .inputs import PagedInputs


def _checked(inputs: object) -> PagedInputs:
    """``inputs`` once it is a :class:`PagedInputs` whose values agree with its case
    (shapes and dtypes are checked when it is built)."""
    if not isinstance(inputs, PagedInputs):
        raise PagedTypeError("inputs", inputs, "a PagedInputs (see materialize)")
    inputs.check_values()
    return inputs


def gather_kv(inputs: PagedInputs) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The logical K and V of each sequence, read token by token through its block table.

    Returns
    -------
    list of (k, v)
        One pair per sequence, ``Tensor[kv_len, num_kv_heads, head_dim]`` and
        ``Tensor[kv_len, num_kv_heads, v_head_dim]`` in the cache's element type (the case
        dtype, or fp8 holding the quantized values; see :func:`dequantize`), on the
        inputs' device.

    Raises
    ------
    PagedTypeError, PagedValueError
        If ``inputs`` is not a consistent :class:`PagedInputs`.
    """
    inputs = _checked(inputs)
    case = inputs.case
    bs, d, dv = case.block_size, case.head_dim, case.v_head_dim
    tables = inputs.block_tables.tolist()
    cache = inputs.kv_cache  # [num_blocks, 2, bs, hkv, cache_head_dim]
    out = []
    for table, kv_len in zip(tables, inputs.kv_lens.tolist()):
        blocks = [table[t // bs] for t in range(kv_len)]
        offsets = [t % bs for t in range(kv_len)]
        b = torch.tensor(blocks, dtype=torch.int64, device=cache.device)
        o = torch.tensor(offsets, dtype=torch.int64, device=cache.device)
        out.append((cache[b, 0, o, :, :d], cache[b, 1, o, :, :dv]))  # [kv_len, hkv, d | dv]
    return out


def dequantize(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Cache values as the math sees them: ``x`` in ``dtype``, times ``scale`` when ``x``
    is fp8 (``stored * k_scale``, vLLM's convention); other types are only converted."""
    if x.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return x.to(dtype) * scale
    return x.to(dtype)


def _require(name: str, value: torch.Tensor | None, wanted: bool, flag: str) -> None:
    if wanted and value is None:
        raise PagedValueError(name, value, f"a tensor when {flag} is set",
                              f"{flag} is set, so {name} must be given (PagedInputs.{name})")
    if not wanted and value is not None:
        raise PagedValueError(name, "a tensor", f"None when {flag} is False",
                              f"{name} was given but {flag} is False; pass {name}=None")


def _check_sequence(q: object, k: object, v: object, case: object) -> None:
    """Refuse arguments of :func:`attention` that disagree with each other or the case."""
    if not isinstance(case, PagedCase):
        raise PagedTypeError("case", case, "a PagedCase")
    for name, tensor in (("q", q), ("k", k), ("v", v)):
        if not isinstance(tensor, torch.Tensor) or tensor.dim() != 3:
            raise PagedTypeError(name, tensor, "a 3-D torch.Tensor [tokens, heads, head_dim]")
    shapes = ((case.num_q_heads, case.head_dim), (case.num_kv_heads, case.head_dim),
              (case.num_kv_heads, case.v_head_dim))
    for name, tensor, (num_heads, dim) in zip("qkv", (q, k, v), shapes):
        if tuple(tensor.shape[1:]) != (num_heads, dim):
            raise PagedValueError(name, tuple(tensor.shape), f"of shape [*, {num_heads}, {dim}]")
    if k.shape[0] != v.shape[0]:
        raise PagedValueError("v", tuple(v.shape), f"{k.shape[0]} rows, as k has (kv_len)")


def visible_keys(q_len: int, kv_len: int, case: PagedCase,
                 device: torch.device | str = "cpu") -> torch.Tensor:
    """Which keys each query row of a sequence sees: ``Tensor[q_len, kv_len]``, bool.

    Query ``i`` sits at position ``kv_len - q_len + i`` (bottom-right; negative when
    ``q_len > kv_len``) and sees the keys at positions ``<=`` it, and with a window
    ``W`` only those ``> position - W``.
    """
    pos_q = torch.arange(kv_len - q_len, kv_len, device=device)[:, None]  # [q_len, 1]
    pos_k = torch.arange(kv_len, device=device)[None, :]  # [1, kv_len]
    visible = pos_k <= pos_q
    if case.sliding_window is not None:
        visible &= pos_k > pos_q - case.sliding_window
    return visible


def masked_logits(
    q: torch.Tensor,
    k: torch.Tensor,
    case: PagedCase,
    alibi_slopes: torch.Tensor | None = None,
) -> torch.Tensor:
    """The logits of one sequence as the softmax sees them, in the dtype of ``q``: scaled,
    soft-capped, ALiBi-biased, and ``-inf`` where the causal mask or the window hides a key.

    Parameters
    ----------
    q : Tensor[q_len, num_q_heads, head_dim]
    k : Tensor[kv_len, num_kv_heads, head_dim], dtype of ``q``
    case : PagedCase
    alibi_slopes : Tensor[num_q_heads] or None

    Returns
    -------
    Tensor[num_q_heads, q_len, kv_len], dtype of ``q``
    """
    q_len, kv_len = q.shape[0], k.shape[0]
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)  # [kv_len, hq, d]
    scores = torch.einsum("qhd,khd->hqk", q * case.scale, k)  # [hq, q_len, kv_len]
    if case.logits_soft_cap is not None:
        cap = case.logits_soft_cap
        scores = cap * torch.tanh(scores / cap)
    if alibi_slopes is not None:
        pos_q = torch.arange(kv_len - q_len, kv_len, device=q.device)[:, None]  # [q_len, 1]
        pos_k = torch.arange(kv_len, device=q.device)[None, :]  # [1, kv_len]
        distance = (pos_q - pos_k).to(q.dtype)  # [q_len, kv_len]
        scores = scores - alibi_slopes.to(q.dtype)[:, None, None] * distance
    return scores.masked_fill(~visible_keys(q_len, kv_len, case, q.device), float("-inf"))


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    case: PagedCase,
    *,
    alibi_slopes: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Dense attention of one sequence, computed in the dtype of its arguments.

    Parameters
    ----------
    q : Tensor[q_len, num_q_heads, head_dim]
        The sequence's last ``q_len`` tokens' queries (``q_len`` >= 0; rows past
        ``kv_len`` see no key).
    k : Tensor[kv_len, num_kv_heads, head_dim]
    v : Tensor[kv_len, num_kv_heads, v_head_dim]
        Dequantized already (:func:`dequantize`) for an fp8 case.
    case : PagedCase
        Supplies the scale, soft cap, sliding window and the alibi/sinks flags.
    alibi_slopes : Tensor[num_q_heads] or None
        Required exactly when ``case.alibi``; used in the dtype of ``q``.
    sinks : Tensor[num_q_heads] or None
        Sink logits, required exactly when ``case.sinks``; used in the dtype of ``q``.

    Returns
    -------
    Tensor[q_len, num_q_heads, head_dim], dtype of ``q``
        With bottom-right causal masking (and a window >= 1) every row sees at least its
        own position, so no row is fully masked; a NaN anywhere propagates, never hidden.

    Raises
    ------
    PagedTypeError, PagedValueError
        If the tensors' shapes disagree with each other or the case, or ``alibi_slopes``
        or ``sinks`` is missing although the case asks for it, or given although it does
        not.
    """
    _check_sequence(q, k, v, case)
    _require("alibi_slopes", alibi_slopes, case.alibi, "case.alibi")
    _require("sinks", sinks, case.sinks, "case.sinks")
    scores = masked_logits(q, k, case, alibi_slopes)  # [hq, q_len, kv_len]
    probs = attention_weights(scores, case, sinks)  # [hq, q_len, kv_len]
    v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)  # [kv_len, hq, d]
    return torch.einsum("hqk,khd->qhd", probs.to(q.dtype), v)


def attention_weights(scores: torch.Tensor, case: PagedCase,
                      sinks: torch.Tensor | None = None) -> torch.Tensor:
    """The softmax of one sequence's :func:`masked_logits` ``scores [num_q_heads, q_len,
    kv_len]``, with the sinks (``Tensor[num_q_heads]`` or None) in its denominator; 0 for
    hidden keys and in rows that see no key. Same shape and dtype as ``scores``."""
    _, q_len, kv_len = scores.shape
    if sinks is None:
        probs = torch.softmax(scores, dim=-1)  # [hq, q_len, kv_len]
    else:
        sink = sinks.to(scores.dtype)[:, None, None].expand(-1, q_len, 1)  # [hq, q_len, 1]
        logits = torch.cat([sink, scores], dim=-1)  # [hq, q_len, 1 + kv_len]
        probs = torch.softmax(logits, dim=-1)[..., 1:]  # [hq, q_len, kv_len]
    seen = visible_keys(q_len, kv_len, case, scores.device).any(dim=-1)  # [q_len]
    return probs.masked_fill(~seen[None, :, None], 0.0)  # softmax of no key: NaN -> 0


def _per_sequence(inputs: PagedInputs, dtype: torch.dtype) -> torch.Tensor:
    """Attention of every sequence in ``dtype``."""
    inputs = _checked(inputs)
    case = inputs.case
    cu = inputs.cu_seqlens_q.tolist()
    out = torch.empty(case.total_q, case.num_q_heads, case.v_head_dim, dtype=dtype,
                      device=inputs.device)
    for i, (k, v) in enumerate(gather_kv(inputs)):
        q = inputs.q[cu[i] : cu[i + 1]]
        out[cu[i] : cu[i + 1]] = attention(
            q.to(dtype),
            dequantize(k, case.k_scale, dtype),
            dequantize(v, case.v_scale, dtype),
            case,
            alibi_slopes=inputs.alibi_slopes,
            sinks=inputs.sinks,
        )
    return out


def reference_attention(inputs: PagedInputs) -> torch.Tensor:
    """The float64 ground truth, ``Tensor[total_q, num_q_heads, v_head_dim]``, float64.

    Raises
    ------
    PagedTypeError, PagedValueError
        If ``inputs`` is not a consistent :class:`PagedInputs`.
    """
    return _per_sequence(inputs, torch.float64)
