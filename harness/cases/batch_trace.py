"""Batches from a serving trace: one engine step a line, read as benchmark workloads
(``pagedbench bench --trace FILE``) and written by ``pagedbench simulate --emit-batches``.

A file is JSON lines, one object per step (docs/benchmarks.md shows how to record one from
vLLM or SGLang)::

    {"step": 12, "kv_lens": [1057, 1057, 2051, 129], "q_lens": [1, 1, 4, 129],
     "num_q_heads": 32, "num_kv_heads": 8, "head_dim": 128}

- ``kv_lens``: each sequence's KV length in this step, its new tokens included (vLLM's and
  SGLang's ``seq_lens``), each >= 1;
- ``q_lens``: each sequence's new tokens (query rows), 1 to its kv_len; absent: all 1 (a
  decode step);
- ``num_q_heads``, ``num_kv_heads``, ``head_dim`` (and ``head_dim_v`` where V's differs,
  as MLA's): the attention layer's shapes, all or none; a line without them takes the
  heads of ``--layout`` (a preset's or a synthetic layout's);
- ``step``: the engine's step number, distinct in a file; absent: the line's number from 0.

Each step becomes the :class:`~.workloads.Workload` ``trace-<file stem>-<step>``, within
the bounds of one batch (:data:`~.workloads.BATCH_BOUNDS`). Unknown fields are refused, so
a misspelt one is never silently ignored; every error names the file and line.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from pagedbench.reference import PagedValueError

from pagedbench.harness.cases.presets import MODEL_PRESETS
from pagedbench.harness.cases.workloads import (Workload, check_sequences, format_batch_spec,
                                                layout_heads, mode_of)

#: Characters a file stem keeps in workload names (others become ``-``).
_NAME_CHARACTERS = re.compile(r"[^A-Za-z0-9._-]+")
#: What ``--trace`` expects, for error messages.
TRACE_FORMAT = ("JSON lines of kv_lens, optional q_lens, step and shapes (num_q_heads, "
                "num_kv_heads, head_dim, optional head_dim_v)")


class TraceStep(BaseModel):
    """One step of a batch trace (module docstring); validated on construction."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    step: int = Field(ge=0)
    kv_lens: list[int] = Field(min_length=1)
    q_lens: Optional[list[int]] = None
    num_q_heads: Optional[int] = Field(default=None, ge=1)
    num_kv_heads: Optional[int] = Field(default=None, ge=1)
    head_dim: Optional[int] = Field(default=None, ge=1)
    head_dim_v: Optional[int] = Field(default=None, ge=1)

    @model_validator(mode="after")
    def _consistent(self) -> TraceStep:
        if min(self.kv_lens) < 1:
            raise ValueError("every kv_len must be >= 1")
        if self.q_lens is not None:
            if len(self.q_lens) != len(self.kv_lens):
                raise ValueError(f"q_lens has {len(self.q_lens)} entries, kv_lens "
                                 f"{len(self.kv_lens)}: one per sequence")
            bad = [i for i, (q, kv) in enumerate(zip(self.q_lens, self.kv_lens))
                   if not 1 <= q <= kv]
            if bad:
                raise ValueError(f"q_lens[{bad[0]}] = {self.q_lens[bad[0]]} is not in 1.."
                                 f"{self.kv_lens[bad[0]]} (its kv_len)")
        shapes = [self.num_q_heads, self.num_kv_heads, self.head_dim]
        if any(v is None for v in shapes) and not all(v is None for v in shapes):
            raise ValueError("num_q_heads, num_kv_heads and head_dim come together")
        if self.head_dim_v is not None and self.head_dim is None:
            raise ValueError("head_dim_v needs num_q_heads, num_kv_heads and head_dim")
        if self.num_q_heads is not None and self.num_q_heads % self.num_kv_heads:
            raise ValueError(f"num_q_heads {self.num_q_heads} is not a multiple of "
                             f"num_kv_heads {self.num_kv_heads}")
        return self

    @property
    def sequences(self) -> tuple[tuple[int, int], ...]:
        """``(q_len, kv_len)`` of every sequence."""
        q_lens = self.q_lens or [1] * len(self.kv_lens)
        return tuple(zip(q_lens, self.kv_lens))


def workload_name(path: Path, step: int) -> str:
    """``trace-<file stem>-<step>``, the stem's other characters than letters, digits,
    ``.``, ``_`` and ``-`` as ``-``."""
    stem = _NAME_CHARACTERS.sub("-", Path(path).stem).strip("-") or "trace"
    return f"trace-{stem}-{step}"


def read_steps(path: Path) -> list[TraceStep]:
    """The steps of the batch trace at ``path``, each with its ``step`` (the line's number
    from 0 where absent).

    Raises
    ------
    PagedValueError
        Naming ``--trace`` and ``file:line``: an unreadable file, a line that is not a
        JSON object of :class:`TraceStep`, a step number given twice, or no step at all.
    """
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise PagedValueError("--trace", str(path), TRACE_FORMAT,
                              f"--trace {path}: cannot be read ({exc.strerror or exc})") from None
    steps: list[TraceStep] = []
    first_line: dict[int, int] = {}
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            data = json.loads(line)
            if not isinstance(data, dict):
                raise ValueError(f"a {type(data).__name__}, not an object")
            step = TraceStep.model_validate({"step": len(steps), **data})
        except (ValueError, ValidationError) as exc:  # JSONDecodeError is a ValueError
            problem = (str(exc) if not isinstance(exc, ValidationError) else
                       "; ".join(f"{'.'.join(map(str, e['loc'])) or 'line'}: {e['msg']}"
                                 for e in exc.errors()[:3]))
            raise PagedValueError("--trace", where, TRACE_FORMAT,
                                  f"--trace {where}: {problem}") from None
        if step.step in first_line:
            raise PagedValueError("--trace", where, "distinct step numbers",
                                  f"--trace {where}: step {step.step} again (first at line "
                                  f"{first_line[step.step]})")
        first_line[step.step] = number
        steps.append(step)
    if not steps:
        raise PagedValueError("--trace", str(path), TRACE_FORMAT, f"--trace {path}: no step")
    return steps


def trace_workloads(path: Path, layout: str | None = None) -> list[Workload]:
    """The workloads of the batch trace at ``path``, in its order: each step with its own
    shapes, or the heads of ``layout`` (:func:`~.workloads.layout_heads`; a preset's V
    head dim too) where the line gives none.

    Raises
    ------
    PagedValueError
        As :func:`read_steps`; also naming the step without shapes when no ``layout`` is
        given (``--layout``), an unknown layout, or a step past the bounds of one batch.
    """
    heads = None if layout is None else layout_heads(layout)
    layout_v = MODEL_PRESETS[layout].head_dim_v if layout in MODEL_PRESETS else None
    workloads = []
    for step in read_steps(path):
        where = f"{path}: step {step.step}"
        if step.head_dim is not None:
            shapes = (step.num_q_heads, step.num_kv_heads, step.head_dim)
            head_dim_v = step.head_dim_v
            named = f"h{step.num_q_heads}x{step.num_kv_heads}"
        elif heads is not None:
            shapes, head_dim_v, named = heads, layout_v, layout
        else:
            raise PagedValueError("--layout", None, "a layout for steps without shapes",
                                  f"--trace {where} gives no num_q_heads, num_kv_heads and "
                                  "head_dim: give them in the file, or the model's heads "
                                  "with --layout (a preset such as llama3.1-8b)")
        sequences = step.sequences
        check_sequences(sequences, "--trace", where)
        workloads.append(Workload(
            name=workload_name(path, step.step), q_lens=tuple(q for q, _ in sequences),
            kv_lens=tuple(kv for _, kv in sequences), num_q_heads=shapes[0],
            num_kv_heads=shapes[1], head_dim=shapes[2], layout=named,
            mode=mode_of(sequences), batch_spec=format_batch_spec(sequences),
            head_dim_v=head_dim_v))
    return workloads


__all__ = ["TRACE_FORMAT", "TraceStep", "read_steps", "trace_workloads", "workload_name"]
