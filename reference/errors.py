"""pagedbench's own input errors: each names the parameter, the value and what is allowed.

Every public entry point (``PagedCase``, ``materialize``, the reference functions, the
allocator and the simulator, the harness and the CLI) raises these for bad input, so a
caller can tell a refused input (:class:`PagedInputError`) from a fault; an unknown
sequence id stays a ``KeyError``, as in a mapping. They live in the lowest layer so that every
layer above can raise and catch them.

- :class:`PagedValueError` (a ``ValueError``): a value out of range or inconsistent.
- :class:`PagedTypeError` (a ``TypeError``, and a ``ValueError`` too, so that callers
  written when every refusal was a ``ValueError`` keep catching it): a value of the
  wrong type.
"""

from __future__ import annotations

from numbers import Integral

#: Longest ``repr`` of a refused value shown in a message (a generated input can be huge).
MAX_VALUE_REPR = 120


def _short_repr(value: object) -> str:
    try:
        text = repr(value)
    except Exception as exc:  # a hostile __repr__ must not hide the real error
        text = f"<{type(value).__name__}: repr raised {type(exc).__name__}>"
    return text if len(text) <= MAX_VALUE_REPR else text[: MAX_VALUE_REPR - 3] + "..."


class PagedInputError(Exception):
    """Base of pagedbench's input errors.

    Parameters
    ----------
    parameter : str
        The refused parameter, as the caller spelled it (``"block_size"``,
        ``"--results-dir"``, ``"case.kv_lens"``).
    value : object
        The refused value.
    allowed : str
        What would be accepted, as a phrase completing "must be ...".
    message : str or None
        A full message instead of ``"{parameter} must be {allowed}, got {value!r}"``
        (it should still name the parameter, the value and what is allowed).
    """

    def __init__(self, parameter: str, value: object, allowed: str,
                 message: str | None = None) -> None:
        self.parameter = parameter
        self.value = value
        self.allowed = allowed
        super().__init__(message or f"{parameter} must be {allowed}, got {_short_repr(value)}")


class PagedValueError(PagedInputError, ValueError):
    """A value out of range, or inconsistent with another parameter."""


class PagedTypeError(PagedInputError, TypeError, ValueError):
    """A value of the wrong type."""


def is_integer(value: object) -> bool:
    """Whether ``value`` is an integer (Python or NumPy), not a bool."""
    return type(value) is int or (isinstance(value, Integral) and not isinstance(value, bool))


__all__ = ["PagedInputError", "PagedTypeError", "PagedValueError", "is_integer"]
