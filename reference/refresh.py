"""New values written into a case's own tensors: the inputs of an engine's next step.

:func:`refresh_live` draws new Q (and K and V for every live slot) and writes them into the
tensors :func:`~.inputs.materialize` made, leaving the metadata, the poison and the stale
tails alone. Timed calls are checked on such inputs (``harness/verdict/conformance.py``):
an implementation that computed its output before (in ``prepare``, in a memo, on another
thread) returns the old one.
"""

from __future__ import annotations

import math

import torch

from .errors import PagedTypeError, PagedValueError
from .inputs import PagedInputs
from .writes import draw_kv, outlier_gain, write_slots


def refresh_live(inputs: object, seed: int, *, kv: bool = True) -> None:
    """Write new values into ``inputs``' own tensors: every element of ``q`` and, with
    ``kv``, the K and V of every live slot (each slot once, so a shared block stays one
    sequence's prefix), drawn from ``seed`` as :func:`~.inputs.materialize` draws them
    (outlier channels, the case's magnitudes and logit offset, MLA's latent V). Block
    tables, lengths, slot mapping, poison and stale tails are unchanged: the next step of
    the same batch.

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
    slots = torch.unique(inputs.slot_mapping.cpu())  # [live slots], ascending
    k, v = draw_kv(slots.numel(), case.num_kv_heads, case.head_dim, case.v_head_dim, generator,
                   qk_magnitude=case.qk_magnitude, v_magnitude=case.v_magnitude,
                   channel_gain=outlier_gain(case.num_kv_heads, case.head_dim, generator),
                   offset_channel=offset_channel, latent=case.latent_cache)
    q = torch.randn(inputs.q.shape, generator=generator) * case.qk_magnitude
    if case.logit_offset:
        q[..., 0] = math.copysign(offset_channel, case.logit_offset)
    limit = torch.finfo(inputs.q.dtype).max
    inputs.q.copy_(q.clamp(-limit, limit).to(inputs.q.dtype))
    if not kv:
        return
    device = inputs.kv_cache.device
    write_slots(inputs.kv_cache, slots.to(device), k.to(device), v.to(device),
                case.k_scale, case.v_scale)


__all__ = ["refresh_live"]
