"""What comparing a returned tensor with its truth found (:mod:`.tolerance` decides it):
plain dataclasses without torch, so that the results record, whose figures are
:class:`Comparison`'s fields, and the commands that only read results import no torch."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Checked:
    """What comparing one returned tensor with its truth found: the figures every
    comparison has.

    Attributes
    ----------
    passed : bool
    reason : str
        Empty when passed; otherwise what failed, with the figures.
    max_abs_err : float
        The largest ``|returned - truth|`` that is judged; ``nan`` when the tensor is not
        finite there or misshaped.
    allowed_abs_err : float
        The allowance of the binding element: the one closest to, or furthest past, its
        allowance.
    err_over_allowance : float
        The binding element's error over its allowance: <= 1 passes.
    worst_index : tuple[int, ...] or None
        The binding element, from ``(sequence, query row in the sequence, head)`` on; for a
        non-finite tensor, the first non-finite element.
    """

    passed: bool
    reason: str
    max_abs_err: float
    allowed_abs_err: float
    err_over_allowance: float
    worst_index: tuple[int, ...] | None


@dataclass(frozen=True)
class Comparison(Checked):
    """One output against the float64 truth over all its rows: :class:`Checked`, with
    ``worst_index`` as ``(sequence, query row, head, channel)``, and

    - ``max_rel_err``: ``|out - truth| / (|truth| + 1e-6)`` at its largest;
    - ``max_err_ulps``, ``mean_err_ulps``: the largest error, and the mean signed error
      toward larger magnitude, in ulps of the case dtype at ``max(|truth|, rms of the
      sequence)``;
    - ``naive_abs_err``: the binding sequence's yardstick (its naive error), ``nan`` if
      not finite;
    - ``err_ratio_vs_naive``: the largest per-sequence ``max|out - truth| / yardstick``
      (``inf`` when a yardstick is 0 and the error is not).

    Each is a float, ``nan`` when the output is not finite or misshaped.
    """

    max_rel_err: float
    max_err_ulps: float
    mean_err_ulps: float
    naive_abs_err: float
    err_ratio_vs_naive: float


__all__ = ["Checked", "Comparison"]
