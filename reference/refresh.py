"""New values written into a case's own tensors before every timed call: the inputs of an
engine's next step.

A timing seeded ``seed`` (:class:`TimedInputs`) writes, before its call ``k`` (0 the
first), new Q into the tensor :func:`~.inputs.materialize` made, drawn from
:func:`call_seed` of ``seed`` and ``k``: fresh normal values for a Q of at most
:data:`FRESH_ELEMENTS` elements; for a larger one, its ``total_q * num_q_heads`` query
vectors picked in a drawn order among twice as many drawn once from ``seed`` (a pick and a
copy on the inputs' device, cheap enough to precede every call; the orders of that many
vectors do not repeat). Before the calls ``kv_calls`` it also writes new K and V into
every live slot (:func:`refresh_kv`). Block tables, lengths, slot mapping, poison and
stale tails stay as they are. The judge rebuilds the inputs of any one call from freshly
materialized ones (:meth:`TimedInputs.rebuild`); an implementation that computed its
output before (in ``prepare``, in a memo, on another thread) returns an old one.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from .case import PagedCase
from .errors import PagedTypeError, PagedValueError
from .inputs import PagedInputs
from .writes import draw_kv, outlier_gain, write_slots

#: Elements of the largest Q drawn afresh before each call (about 0.1 ms of
#: ``torch.randn`` on one CPU core); a larger Q is picked from a pool.
FRESH_ELEMENTS = 2**14


def call_seed(seed: int, call: int) -> int:
    """The seed of the new inputs of call ``call`` (0 the first) of a timing seeded
    ``seed``: ``seed * 2**32 + call``.

    Raises
    ------
    PagedValueError
        If ``seed`` is not in ``[0, 2**31)`` or ``call`` not in ``[0, 2**32)``.
    """
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**31:
        raise PagedValueError("seed", seed, "an int in [0, 2**31)")
    if isinstance(call, bool) or not isinstance(call, int) or not 0 <= call < 2**32:
        raise PagedValueError("call", call, "an int in [0, 2**32)")
    return seed * 2**32 + call


def _offset_channel(case: PagedCase) -> float:
    """Channel 0's value that gives the case's logit offset (:func:`~.inputs.materialize`)."""
    return math.sqrt(abs(case.logit_offset) / case.scale) if case.logit_offset else 0.0


def refresh_kv(inputs: PagedInputs, seed: int) -> None:
    """Write new K and V into every live slot of ``inputs.kv_cache`` (each slot once, so a
    shared block stays one sequence's prefix), drawn from ``seed`` as
    :func:`~.inputs.materialize` draws them (outlier channels, the case's magnitudes and
    logit offset, MLA's latent V).

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
    slots = torch.unique(inputs.slot_mapping.cpu())  # [live slots], ascending
    k, v = draw_kv(slots.numel(), case.num_kv_heads, case.head_dim, case.v_head_dim, generator,
                   qk_magnitude=case.qk_magnitude, v_magnitude=case.v_magnitude,
                   channel_gain=outlier_gain(case.num_kv_heads, case.head_dim, generator),
                   offset_channel=_offset_channel(case), latent=case.latent_cache)
    device = inputs.kv_cache.device
    write_slots(inputs.kv_cache, slots.to(device), k.to(device), v.to(device),
                case.k_scale, case.v_scale)


class TimedInputs:
    """The new inputs of every call of one timing of ``case`` (module docstring).

    Parameters
    ----------
    case : PagedCase
    seed : int
        The timing's seed, in ``[0, 2**31)``.
    kv_calls : sequence of int
        The calls before which new K and V are written too.
    device : str or torch.device
        Where the pool of query vectors lives (the inputs').

    Raises
    ------
    PagedValueError
        If ``seed`` or a call is out of range.
    """

    def __init__(self, case: PagedCase, seed: int, kv_calls: Sequence[int],
                 device: str | torch.device = "cpu") -> None:
        call_seed(seed, 0)
        for call in kv_calls:
            call_seed(seed, call)
        self.case, self.seed, self.kv_calls = case, seed, frozenset(kv_calls)
        vectors = case.total_q * case.num_q_heads
        self.pool = (None if vectors * case.head_dim <= FRESH_ELEMENTS
                     else self._draw(2 * vectors, seed).to(device))  # [2 * vectors, d]

    def write(self, inputs: PagedInputs, call: int) -> None:
        """Write the new inputs of ``call`` into ``inputs`` after those of the call before
        it: K and V when ``call`` is one of ``kv_calls``, then Q."""
        if call in self.kv_calls:
            refresh_kv(inputs, call_seed(self.seed, call))
        self._write_q(inputs, call)

    def rebuild(self, inputs: PagedInputs, call: int) -> None:
        """Turn freshly materialized ``inputs`` into those of ``call``: the K and V of the
        last of ``kv_calls`` up to it, then its Q."""
        last_kv = max((c for c in self.kv_calls if c <= call), default=None)
        if last_kv is not None:
            refresh_kv(inputs, call_seed(self.seed, last_kv))
        self._write_q(inputs, call)

    def _draw(self, vectors: int, seed: int) -> torch.Tensor:
        """``Tensor[vectors, head_dim]`` in the case dtype on the CPU: normal with the
        case's query magnitude, channel 0 set for its logit offset."""
        case = self.case
        drawn = torch.randn(vectors, case.head_dim, generator=torch.Generator().manual_seed(seed))
        drawn *= case.qk_magnitude
        if case.logit_offset:
            drawn[:, 0] = math.copysign(_offset_channel(case), case.logit_offset)
        limit = torch.finfo(case.torch_dtype).max
        return drawn.clamp(-limit, limit).to(case.torch_dtype)

    def _write_q(self, inputs: PagedInputs, call: int) -> None:
        q = inputs.q  # [total_q, num_q_heads, head_dim], any strides
        vectors, seed = q.shape[0] * q.shape[1], call_seed(self.seed, call)
        if self.pool is None:
            q.copy_(self._draw(vectors, seed).view(q.shape))
            return
        picks = torch.randperm(self.pool.shape[0], generator=torch.Generator().manual_seed(seed))
        q.copy_(self.pool[picks[:vectors].to(self.pool.device)].view(q.shape))


__all__ = ["FRESH_ELEMENTS", "TimedInputs", "call_seed", "refresh_kv"]
