"""New values written into a case's own tensors: the inputs of an engine's next step.

:func:`refresh_live` draws new Q (and K and V for every live slot) and writes them into the
tensors :func:`~.inputs.materialize` made, leaving the metadata, the poison and the stale
tails alone. Every timed call runs on such inputs (``harness/verdict/conformance.py``): new
Q before each call, drawn from :func:`call_seed`, and new K and V too before a few of them;
the judge rebuilds the inputs of any one call from :func:`call_refreshes` alone. An
implementation that computed its output before (in ``prepare``, in a memo, on another
thread) returns the old one.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from .errors import PagedTypeError, PagedValueError
from .inputs import PagedInputs
from .writes import draw_kv, outlier_gain, write_slots


def refresh_live(inputs: object, seed: int, *, kv: bool = True) -> None:
    """Write new values into ``inputs``' own tensors: every element of ``q`` and, with
    ``kv``, the K and V of every live slot (each slot once, so a shared block stays one
    sequence's prefix), drawn from ``seed`` as :func:`~.inputs.materialize` draws them
    (outlier channels, the case's magnitudes and logit offset, MLA's latent V; Q first, so
    that Q is the same with or without ``kv``). Block tables, lengths, slot mapping, poison
    and stale tails are unchanged: the next step of the same batch.

    Raises
    ------
    PagedTypeError
        If ``inputs`` is not a :class:`~.inputs.PagedInputs`.
    PagedValueError
        If ``seed`` is not an int in ``[0, 2**63)``.
    """
    if not isinstance(inputs, PagedInputs):
        raise PagedTypeError("inputs", inputs, "a PagedInputs (see materialize)")
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
        raise PagedValueError("seed", seed, "an int in [0, 2**63)")
    case = inputs.case
    generator = torch.Generator().manual_seed(seed)
    offset_channel = math.sqrt(abs(case.logit_offset) / case.scale) if case.logit_offset else 0.0
    q = torch.randn(inputs.q.shape, generator=generator) * case.qk_magnitude
    if case.logit_offset:
        q[..., 0] = math.copysign(offset_channel, case.logit_offset)
    limit = torch.finfo(inputs.q.dtype).max
    inputs.q.copy_(q.clamp(-limit, limit).to(inputs.q.dtype))
    if not kv:
        return
    slots = torch.unique(inputs.slot_mapping.cpu())  # [live slots], ascending
    k, v = draw_kv(slots.numel(), case.num_kv_heads, case.head_dim, case.v_head_dim, generator,
                   qk_magnitude=case.qk_magnitude, v_magnitude=case.v_magnitude,
                   channel_gain=outlier_gain(case.num_kv_heads, case.head_dim, generator),
                   offset_channel=offset_channel, latent=case.latent_cache)
    device = inputs.kv_cache.device
    write_slots(inputs.kv_cache, slots.to(device), k.to(device), v.to(device),
                case.k_scale, case.v_scale)


def call_seed(seed: int, call: int) -> int:
    """The seed of the new inputs of call ``call`` (0 the first) of a timing seeded
    ``seed``: ``seed * 2**32 + call``.

    Raises
    ------
    PagedValueError
        If ``seed`` is not in ``[0, 2**31)`` or ``call`` not in ``[0, 2**32)``.
    """
    if not 0 <= seed < 2**31:
        raise PagedValueError("seed", seed, "an int in [0, 2**31)")
    if not 0 <= call < 2**32:
        raise PagedValueError("call", call, "an int in [0, 2**32)")
    return seed * 2**32 + call


def call_refreshes(seed: int, call: int, kv_calls: Sequence[int]) -> tuple[tuple[int, bool], ...]:
    """The :func:`refresh_live` writes, ``(seed, kv)`` in order, that turn freshly
    materialized inputs into those of call ``call`` of a timing seeded ``seed`` whose
    calls ``kv_calls`` also got new K and V: the K and V of the last such call up to
    ``call``, then this call's Q (one write when ``call`` is itself one of them)."""
    last_kv = max((c for c in kv_calls if c <= call), default=None)
    own = (call_seed(seed, call), call == last_kv)
    if last_kv is None or last_kv == call:
        return (own,)
    return ((call_seed(seed, last_kv), True), own)


__all__ = ["call_refreshes", "call_seed", "refresh_live"]
