"""What a request trace is: the input of the KV-capacity simulator.

A trace is a sequence of :class:`Request`: prompt and output lengths, the step the request
arrives at, an optional shared prefix or an earlier request it continues (a conversation's
next turn), and the number of parallel samples. Reading traces
from files and drawing them from a distribution is the harness's job
(:mod:`pagedbench.harness.capacity.traces`); the simulator is :mod:`pagedbench.reference.simulator`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .errors import PagedInputError, PagedValueError, is_integer

#: Longest sequence (prompt + output tokens) unless a caller says otherwise.
DEFAULT_MAX_CONTEXT = 2048


class TraceError(PagedInputError, ValueError):
    """A request trace is malformed or inconsistent with ``max_context``; ``message``
    names the file and line (or the request) and what is wrong."""

    def __init__(self, message: str) -> None:
        super().__init__("trace", None, "a well-formed trace", message)


@dataclass(frozen=True)
class Request:
    """One request of a trace.

    Parameters
    ----------
    prompt_len : int
        Prompt tokens, >= 1.
    output_len : int
        Tokens generated per sample, >= 1.
    arrival : int
        Step at which the request joins the waiting queue, >= 0 (steps).
    prefix_id : str or None
        Requests with the same id begin with the same ``prefix_len`` tokens (a shared
        system prompt or document); ``None`` means no shared prefix.
    prefix_len : int or None
        Leading prompt tokens that belong to the shared prefix, in ``[1, prompt_len]``;
        ``None`` means the whole prompt when ``prefix_id`` is set, else 0.
    n : int
        Parallel samples generated from the prompt, >= 1.
    parent : int or None
        Index in the trace of an earlier request whose whole sequence (its prompt and
        sample 0's output) this prompt starts with: the previous turn of a conversation,
        the previous step of an agent. The request arrives no earlier than the step after
        its parent finished (and not before ``arrival``). Not with ``prefix_id`` (the
        parent's tokens carry any shared prefix).

    Raises
    ------
    TraceError
        If a field is out of range; the message names the field and its allowed values.
    """

    prompt_len: int
    output_len: int
    arrival: int = 0
    prefix_id: str | None = None
    prefix_len: int | None = None
    n: int = 1
    parent: int | None = None

    def __post_init__(self) -> None:
        for name in ("prompt_len", "output_len", "n"):
            value = getattr(self, name)
            if not is_integer(value) or value < 1:
                raise TraceError(f"{name} must be an integer >= 1, got {value!r}")
        if not is_integer(self.arrival) or self.arrival < 0:
            raise TraceError(f"arrival must be an integer step >= 0, got {self.arrival!r}")
        if self.parent is not None:
            if not is_integer(self.parent) or self.parent < 0:
                raise TraceError(f"parent must be empty or a request index >= 0, got "
                                 f"{self.parent!r}")
            if self.prefix_id is not None:
                raise TraceError("parent and prefix_id exclude each other: a request "
                                 "continuing another starts with its tokens")
        if self.prefix_id is None:
            if self.prefix_len not in (None, 0):
                raise TraceError(
                    "prefix_len must be empty or 0 when prefix_id is empty, "
                    f"got {self.prefix_len!r}"
                )
            object.__setattr__(self, "prefix_len", 0)
            return
        object.__setattr__(self, "prefix_id", str(self.prefix_id))
        if self.prefix_len is None:
            object.__setattr__(self, "prefix_len", self.prompt_len)
        elif not is_integer(self.prefix_len) or not 1 <= self.prefix_len <= self.prompt_len:
            raise TraceError(
                f"prefix_len must be an integer in [1, prompt_len={self.prompt_len}], "
                f"got {self.prefix_len!r}"
            )

    @property
    def total_len(self) -> int:
        """Tokens per sample at the end: ``prompt_len + output_len``."""
        return self.prompt_len + self.output_len


def validate_trace(trace: Sequence[Request], max_context: int) -> None:
    """Check that ``trace`` is non-empty and every request fits ``max_context``.

    Raises
    ------
    TraceError
        If the trace is empty, a request's ``prompt_len + output_len`` exceeds
        ``max_context`` (the message gives the request index and both lengths), or a
        ``parent`` is not an earlier request whose whole sequence is shorter than the
        prompt.
    PagedValueError
        If ``max_context`` < 1.
    """
    if max_context < 1:
        raise PagedValueError("max_context", max_context, "an int >= 1")
    if not trace:
        raise TraceError("the trace has no requests")
    for i, req in enumerate(trace):
        if req.total_len > max_context:
            raise TraceError(
                f"request {i}: prompt_len + output_len = {req.prompt_len} + {req.output_len} "
                f"= {req.total_len} exceeds max_context={max_context}"
            )
        check_parent(trace, i)


def check_parent(trace: Sequence[Request], index: int) -> None:
    """Check request ``index``'s ``parent``: an earlier request whose ``prompt_len +
    output_len`` is below this prompt's length (at least one new token).

    Raises
    ------
    TraceError
        Naming the request, its parent and the lengths.
    """
    parent = trace[index].parent
    if parent is None:
        return
    if parent >= index:
        raise TraceError(f"request {index}: parent {parent} is not an earlier request")
    if trace[parent].total_len >= trace[index].prompt_len:
        raise TraceError(
            f"request {index}: prompt_len {trace[index].prompt_len} must exceed its parent "
            f"{parent}'s prompt_len + output_len = {trace[parent].total_len} (the parent's "
            "sequence and at least one new token)")


def shares(trace: Sequence[Request]) -> bool:
    """Whether ``trace`` shares prefixes or samples (a ``prefix_id``, a ``parent``, ``n >
    1``): prefix caching then applies."""
    return any(r.n > 1 or r.prefix_id is not None or r.parent is not None for r in trace)
