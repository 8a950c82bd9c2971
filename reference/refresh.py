"""New values written into a case's own tensors before every timed call: the inputs of an
engine's next step.

A timing seeded ``seed`` (:class:`TimedInputs`) writes, before its call ``k`` (0 the
first), new Q into the tensor :func:`~.inputs.materialize` made: its ``total_q *
num_q_heads`` query vectors picked from a pool drawn once from ``seed``, vector ``j`` the
pool's ``(a * j + b) mod R`` (``R`` a power of two, :func:`pool_size`; ``a`` odd and drawn
per call from :func:`call_seed` of ``seed`` and ``k``, ``b`` a drawn start plus ``k``), so
the vectors of one call are distinct and no two calls of a timing get the same Q; then
its channels permuted (channel ``c`` takes ``(u * c + s) mod m``, ``u`` a unit mod ``m``
and ``s`` drawn per call; channel 0 kept where it holds the logit offset, ``m`` the
others) and their signs flipped by one of :data:`SIGN_PATTERNS` patterns drawn per call.
Q's channels are independent and symmetric, so the distribution stays the case's, while a
vector comes back bit for bit about once in ``R * m * phi(m) * SIGN_PATTERNS`` picks: a
memo keyed by one query vector (its output row, or its logits) never pays. The write is a
gather on the inputs' device from host integers: no host synchronization, cheaper than any
call. Before the calls ``kv_calls`` it also writes new K and V into
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

#: Fewest query vectors in a timing's pool: a Q of one vector gets a new one on each of
#: this many calls.
MIN_POOL = 2**12
#: Sign patterns a timing draws once; each call flips the signs of its Q's channels by
#: one of them.
SIGN_PATTERNS = 2**12


def call_seed(seed: int, call: int) -> int:
    """The seed of the new inputs of call ``call`` (0 the first) of a timing seeded
    ``seed``: ``(seed * 2654435761 + call * 2246822519) mod 2**32``. torch's CPU generator
    keeps only the low 32 bits of a seed, so they must hold both; ``call`` maps one to one
    onto them (an odd multiplier), so no two calls of a timing share a seed.

    Raises
    ------
    PagedValueError
        If ``seed`` is not in ``[0, 2**31)`` or ``call`` not in ``[0, 2**32)``.
    """
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**31:
        raise PagedValueError("seed", seed, "an int in [0, 2**31)")
    if isinstance(call, bool) or not isinstance(call, int) or not 0 <= call < 2**32:
        raise PagedValueError("call", call, "an int in [0, 2**32)")
    return (seed * 2654435761 + call * 2246822519) % 2**32


def pool_size(case: PagedCase) -> int:
    """Query vectors a timing of ``case`` picks from: the least power of two that is at
    least twice the ``total_q * num_q_heads`` it writes and at least :data:`MIN_POOL`."""
    return 1 << (max(2 * case.total_q * case.num_q_heads, MIN_POOL) - 1).bit_length()


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
        generator = torch.Generator().manual_seed(seed)
        pool = torch.randn(pool_size(case), case.head_dim, generator=generator)
        pool *= case.qk_magnitude
        if case.logit_offset:
            pool[:, 0] = math.copysign(_offset_channel(case), case.logit_offset)
        limit = torch.finfo(case.torch_dtype).max
        self.pool = pool.clamp(-limit, limit).to(case.torch_dtype).to(device)  # [R, d]
        self.start = int(torch.randint(pool_size(case), (), generator=generator))
        self.vector = torch.arange(case.total_q * case.num_q_heads, device=device)  # [n]
        # The channels a call permutes and flips: all, or all but the logit offset's 0.
        self.first = 1 if case.logit_offset else 0
        moved = case.head_dim - self.first
        self.units = [a for a in range(1, max(moved, 2)) if math.gcd(a, moved) == 1]
        self.channel = torch.arange(moved, device=device)  # [m]
        self.kept = torch.zeros(self.first, dtype=torch.long, device=device)
        signs = torch.randint(2, (SIGN_PATTERNS, case.head_dim), generator=generator) * 2 - 1
        signs[:, : self.first] = 1
        self.signs = signs.to(case.torch_dtype).to(device)  # [SIGN_PATTERNS, d], +-1

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

    def _write_q(self, inputs: PagedInputs, call: int) -> None:
        q = inputs.q  # [total_q, num_q_heads, head_dim], any strides
        size, moved = self.pool.shape[0], self.channel.numel()
        generator = torch.Generator().manual_seed(call_seed(self.seed, call))
        scale = 2 * int(torch.randint(size // 2, (), generator=generator)) + 1
        unit = self.units[int(torch.randint(len(self.units), (), generator=generator))]
        shift = int(torch.randint(max(moved, 1), (), generator=generator))
        sign = int(torch.randint(SIGN_PATTERNS, (), generator=generator))
        picks = (self.vector * scale + (self.start + call)) % size  # [n], distinct
        channels = torch.cat((self.kept, (self.channel * unit + shift) % moved + self.first))
        q.copy_((self.pool[picks[:, None], channels] * self.signs[sign]).view(q.shape))


__all__ = ["MIN_POOL", "SIGN_PATTERNS", "TimedInputs", "call_seed", "pool_size", "refresh_kv"]
