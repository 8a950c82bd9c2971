"""The token ids of a request trace, for the policies that match prefixes.

A trace (:mod:`~pagedbench.reference.workload`) gives lengths, not tokens; prefix caching
needs ids that are equal exactly where requests share a prefix. :class:`TraceTokens`
names them: prefix group ``g`` (a ``prefix_id``) is the token ``g`` repeated, request
``i``'s own prompt tokens are ``num_groups + i``, and the tokens sample ``k`` of request
``i`` generates are ``num_groups + num_requests + first_sample[i] + k``. A request with a
``parent`` (the next turn of a conversation, the next step of an agent) starts with the
parent's whole sequence, its prompt and sample 0's output, then its own tokens. So only
a shared prefix, or a parent's history, ever hashes or matches alike.
"""

from __future__ import annotations

from collections.abc import Sequence

from .workload import Request


class TraceTokens:
    """Token ids of every request of ``trace`` (module docstring).

    Parameters
    ----------
    trace : Sequence[Request]
        A trace that :func:`~pagedbench.reference.workload.validate_trace` accepts
        (parents before their children).
    """

    def __init__(self, trace: Sequence[Request]) -> None:
        self.trace = trace
        groups = {pid: g for g, pid in enumerate(dict.fromkeys(
            r.prefix_id for r in trace if r.prefix_id is not None))}
        self._group = [groups.get(r.prefix_id) for r in trace]
        self._own_base = len(groups)
        self._gen_base = len(groups) + len(trace)
        self._first_sample = []
        total = 0
        for r in trace:
            self._first_sample.append(total)
            total += r.n
        self._prompts: dict[int, list[int]] = {}

    def generated(self, index: int, sample: int) -> int:
        """The id of every token sample ``sample`` of request ``index`` generates."""
        return self._gen_base + self._first_sample[index] + sample

    def prompt(self, index: int) -> list[int]:
        """Request ``index``'s prompt, ``[prompt_len]`` ids (a copy)."""
        if index not in self._prompts:
            req = self.trace[index]
            own = self._own_base + index
            if req.parent is not None:
                head = self.sequence(req.parent)
            elif self._group[index] is not None:
                head = [self._group[index]] * req.prefix_len
            else:
                head = []
            self._prompts[index] = head + [own] * (req.prompt_len - len(head))
        return list(self._prompts[index])

    def sequence(self, index: int, sample: int = 0, generated: int | None = None) -> list[int]:
        """Request ``index``'s prompt and the first ``generated`` tokens of ``sample``
        (default: its whole output), ids."""
        req = self.trace[index]
        count = req.output_len if generated is None else generated
        return self.prompt(index) + [self.generated(index, sample)] * count


__all__ = ["TraceTokens"]
