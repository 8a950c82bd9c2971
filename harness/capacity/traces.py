"""Request traces for the capacity simulator: drawn from a documented distribution, or read
from a CSV or JSONL file.

:func:`generate_trace` is ``pagedbench simulate``'s default workload; :func:`read_trace`
reads ``--trace FILE``. Both return :class:`~pagedbench.reference.workload.Request` lists,
which :func:`~pagedbench.reference.simulator.simulate` replays.
"""

from __future__ import annotations

import csv
import json
import math
import random
from collections.abc import Iterable
from pathlib import Path

from pagedbench.reference.workload import (
    DEFAULT_MAX_CONTEXT,
    Request,
    TraceError,
    check_parent,
)
from pagedbench.reference.errors import PagedValueError, is_integer

#: Columns a trace file may have; the first two are required.
TRACE_COLUMNS = ("prompt_len", "output_len", "arrival", "prefix_id", "prefix_len", "n",
                 "parent")
REQUIRED_TRACE_COLUMNS = ("prompt_len", "output_len")
#: Shared prefixes in a generated trace unless a caller says otherwise.
DEFAULT_NUM_PREFIXES = 4


def _log_uniform(rng: random.Random, high: int) -> int:
    """An integer ``round(exp(U(0, ln high)))``, in ``[1, high]``."""
    return max(1, min(high, round(math.exp(rng.uniform(0.0, math.log(high))))))


def generate_trace(
    num_requests: int,
    max_context: int = DEFAULT_MAX_CONTEXT,
    seed: int = 0,
    *,
    arrival_rate: float | None = None,
    prefix_share: float = 0.0,
    num_prefixes: int = DEFAULT_NUM_PREFIXES,
    shared_prefix_len: int | None = None,
    parallel_samples: int = 1,
) -> list[Request]:
    """A seeded request trace from a documented distribution.

    For each request, in order, from one ``random.Random(seed)``:

    - with probability ``prefix_share`` it carries ``prefix_id = "p<g>"``, ``g`` uniform in
      ``[0, num_prefixes)``, and its prompt is the group's ``shared_prefix_len`` tokens
      followed by ``round(exp(U(0, ln(max_context // 2 - shared_prefix_len))))`` own
      tokens;
    - otherwise ``prompt_len = round(exp(U(0, ln(max_context // 2))))``;
    - ``output_len = round(exp(U(0, ln(max_context // 2))))``;
    - ``n = parallel_samples``;
    - ``arrival`` is 0 for every request when ``arrival_rate`` is ``None`` (the whole
      trace queued at once: the offline throughput setting), else the floor of a Poisson
      process's arrival times at ``arrival_rate`` requests per step.

    Log-uniform lengths weight every order of magnitude equally (short chat turns and
    long documents both occur), as heavy-tailed serving traces do; with the default
    ``max_context`` of 2048 the mean prompt and the mean output are each about 148
    tokens, and ``prompt_len + output_len <= max_context`` always holds.

    Parameters
    ----------
    num_requests : int
        Requests in the trace, >= 1.
    max_context : int
        Longest sequence (prompt + output tokens), >= 2.
    seed : int
        Seed of the draws.
    arrival_rate : float or None
        Mean arrivals per step, > 0; ``None`` for all at step 0.
    prefix_share : float
        Fraction of requests with a shared prefix, in ``[0, 1]``.
    num_prefixes : int
        Distinct shared prefixes, >= 1.
    shared_prefix_len : int or None
        Tokens of each shared prefix, in ``[1, max_context // 2 - 1]``; ``None`` means
        ``max_context // 8``.
    parallel_samples : int
        ``n`` of every request, >= 1.

    Returns
    -------
    list[Request]
        ``[num_requests]`` requests, in arrival order.

    Raises
    ------
    PagedValueError
        If a parameter is out of range; the message names it and its allowed values.
    """
    if num_requests < 1:
        raise PagedValueError("num_requests", num_requests, ">= 1")
    if max_context < 2:
        raise PagedValueError("max_context", max_context, ">= 2")
    if arrival_rate is not None and not arrival_rate > 0:
        raise PagedValueError("arrival_rate", arrival_rate, "None or > 0 requests per step")
    if not 0.0 <= prefix_share <= 1.0:
        raise PagedValueError("prefix_share", prefix_share, "in [0, 1]")
    if num_prefixes < 1:
        raise PagedValueError("num_prefixes", num_prefixes, ">= 1")
    if parallel_samples < 1:
        raise PagedValueError("parallel_samples", parallel_samples, ">= 1")
    half = max_context // 2
    if shared_prefix_len is None:
        shared_prefix_len = max(1, max_context // 8)
    if prefix_share > 0 and not 1 <= shared_prefix_len <= half - 1:
        raise PagedValueError("shared_prefix_len", shared_prefix_len,
                              f"in [1, max_context // 2 - 1 = {half - 1}]")
    rng = random.Random(seed)
    clock = 0.0
    trace = []
    for _ in range(num_requests):
        if prefix_share > 0 and rng.random() < prefix_share:
            prefix_id: str | None = f"p{rng.randrange(num_prefixes)}"
            prompt_len = shared_prefix_len + _log_uniform(rng, half - shared_prefix_len)
            prefix_len: int | None = shared_prefix_len
        else:
            prefix_id, prefix_len = None, None
            prompt_len = _log_uniform(rng, half)
        output_len = _log_uniform(rng, half)
        if arrival_rate is not None:
            clock += rng.expovariate(arrival_rate)
        trace.append(
            Request(
                prompt_len=prompt_len,
                output_len=output_len,
                arrival=int(clock),
                prefix_id=prefix_id,
                prefix_len=prefix_len,
                n=parallel_samples,
            )
        )
    return trace


def read_trace(path: str | Path, max_context: int) -> list[Request]:
    """Read a request trace from a CSV file (with a header row) or a JSONL file.

    The format follows the suffix: ``.csv``, or ``.jsonl`` / ``.ndjson`` (one JSON object
    per line; blank lines are skipped). Columns: ``prompt_len`` and ``output_len``
    (required), ``arrival`` (step), ``prefix_id``, ``prefix_len``, ``n`` and ``parent``
    (the 0-based request index a conversation's next turn continues; optional: an empty
    CSV cell or JSON ``null`` takes the :class:`Request` default).

    Returns
    -------
    list[Request]
        The requests, in file order.

    Raises
    ------
    TraceError
        If the suffix is not one of the above, the file has no requests, a required
        column is missing, an unknown column appears, a value is not an integer, a length
        is out of range, or ``prompt_len + output_len > max_context``; the message names
        the file, the line and the column; or a ``parent`` is not an earlier request
        whose whole sequence the prompt outgrows.
    FileNotFoundError
        If ``path`` does not exist.
    PagedValueError
        If ``max_context`` < 1.
    """
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix == ".csv":
        rows = _csv_rows(path)
    elif suffix in (".jsonl", ".ndjson"):
        rows = _jsonl_rows(path)
    else:
        raise TraceError(f"{path}: trace files must end in .csv, .jsonl or .ndjson, got {suffix!r}")
    if max_context < 1:
        raise PagedValueError("max_context", max_context, ">= 1")
    trace = []
    for line, row in rows:
        req = _request_from_row(path, line, row)
        if req.total_len > max_context:
            raise TraceError(
                f"{path}:{line}: prompt_len + output_len = {req.prompt_len} + "
                f"{req.output_len} = {req.total_len} exceeds max_context={max_context}"
            )
        trace.append(req)
        try:
            check_parent(trace, len(trace) - 1)
        except TraceError as err:
            raise TraceError(f"{path}:{line}: {err}") from None
    if not trace:
        raise TraceError(f"{path}: the file holds no requests")
    return trace


def _check_columns(path: Path, line: int, columns: Iterable[str]) -> None:
    columns = list(columns)
    repeated = sorted({c for c in columns if columns.count(c) > 1})
    if repeated:
        raise TraceError(f"{path}:{line}: column(s) {repeated} appear more than once")
    unknown = [c for c in columns if c not in TRACE_COLUMNS]
    if unknown:
        raise TraceError(
            f"{path}:{line}: unknown column(s) {unknown}; allowed columns are {list(TRACE_COLUMNS)}"
        )
    missing = [c for c in REQUIRED_TRACE_COLUMNS if c not in columns]
    if missing:
        raise TraceError(
            f"{path}:{line}: missing required column(s) {missing}; found {columns}"
        )


def _csv_rows(path: Path) -> list[tuple[int, dict[str, object]]]:
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        if reader.fieldnames is None:
            raise TraceError(f"{path}: the file is empty (no header row)")
        _check_columns(path, 1, [c.strip() for c in reader.fieldnames])
        rows = []
        for row in reader:
            if None in row:
                raise TraceError(f"{path}:{reader.line_num}: more cells than header columns")
            cells = {k.strip(): (v.strip() if v is not None else "") for k, v in row.items()}
            rows.append((reader.line_num, {k: (v if v != "" else None) for k, v in cells.items()}))
    return rows


def _jsonl_rows(path: Path) -> list[tuple[int, dict[str, object]]]:
    rows = []
    with path.open() as f:
        for line, text in enumerate(f, start=1):
            if not text.strip():
                continue
            try:
                row = json.loads(text)
            except json.JSONDecodeError as err:
                raise TraceError(f"{path}:{line}: not valid JSON ({err.msg})") from None
            if not isinstance(row, dict):
                raise TraceError(
                    f"{path}:{line}: each line must be a JSON object, got {text.strip()!r}"
                )
            _check_columns(path, line, row)
            rows.append((line, row))
    return rows


def _request_from_row(path: Path, line: int, row: dict[str, object]) -> Request:
    values: dict[str, object] = {}
    for column, raw in row.items():
        if raw is None:
            continue
        if column == "prefix_id":
            values[column] = str(raw)
            continue
        if isinstance(raw, str):
            try:
                values[column] = int(raw)
            except ValueError:
                raise TraceError(
                    f"{path}:{line}: column {column!r} must be an integer, got {raw!r}"
                ) from None
        elif is_integer(raw):
            values[column] = raw
        else:
            raise TraceError(f"{path}:{line}: column {column!r} must be an integer, got {raw!r}")
    for column in REQUIRED_TRACE_COLUMNS:
        if column not in values:
            raise TraceError(f"{path}:{line}: column {column!r} is empty; it is required")
    try:
        return Request(**values)  # type: ignore[arg-type]
    except TraceError as err:
        raise TraceError(f"{path}:{line}: {err}") from None
