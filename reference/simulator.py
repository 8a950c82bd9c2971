"""KV-cache capacity simulator: how many requests fit, and how much reserved memory is wasted.

The simulator replays one request trace under several memory policies and measures, step
by step, the KV memory that holds token state against the memory the policy reserved.
It is the measurable form of the vLLM paper's memory argument (Kwon et al., "Efficient
Memory Management for Large Language Model Serving with PagedAttention", SOSP 2023,
arXiv 2309.06180, section 3 and Fig. 2).

Policies
--------
``Max``
    Contiguous reservation of ``max_context`` slots per sequence at admission (the
    pre-paging baseline; the paper's "Orca (Max)").
``Pow2``
    Contiguous reservation of the sequence's final length rounded up to a power of two,
    capped at ``max_context`` (the paper's "Orca (Pow2)": output length known within 2x).
``Oracle``
    Contiguous reservation of exactly ``prompt_len + output_len`` (the paper's
    "Orca (Oracle)": output lengths known in advance).
``Paged``
    On-demand blocks of ``block_size`` slots from
    :class:`~pagedbench.reference.allocator.BlockAllocator`; each of the ``n`` samples of a
    request is its own sequence with its own copy of the prompt.
``Paged+share``
    The same allocator with prefix caching enabled (requests with the same ``prefix_id``
    share the full blocks of their common prefix) and the ``n`` samples of a request
    created by ``fork`` from one prompt, with copy-on-write of a shared partial block.

Contiguous policies are modelled as a pool of slots without external fragmentation: any
``R`` free slots can hold an ``R``-slot reservation. That is the best case for them (the
paper's Fig. 2 also charges them external fragmentation), so their waste here is a lower
bound.

Scheduler (continuous batching, one iteration per step; vLLM v1's
``Scheduler.schedule`` in ``vllm/v1/core/sched/scheduler.py``)
-------------------------------------------------------------------------------------
At step ``s``:

1. Requests with ``arrival <= s`` join the back of the waiting queue, in trace order.
2. Decode: every running request, oldest admission first, stores the K/V of one new
   token for each of its ``n`` samples. When a paged append cannot get a block, the
   newest running request is preempted by recomputation (all its blocks freed, its
   tokens so far to be recomputed) and put at the front of the waiting queue; this
   repeats until the append fits or the request preempts itself (vLLM v1's
   ``running[-1]`` victim, ``prepend_request``). Contiguous policies never preempt: the
   reservation covers every future token.
3. Admission, skipped in a step that preempted: first come, first served. The head of
   the waiting queue is admitted when the policy can reserve (contiguous) or allocate
   (paged) its whole prompt for all ``n`` samples; admission stops at the first request
   that does not fit (no skipping ahead). An admitted prompt enters the cache whole in
   its admission step (the prefill); a request readmitted after preemption enters with
   its prompt plus the tokens it had generated (recomputation).
4. Memory and concurrency are sampled.
5. A request whose samples each hold ``prompt_len + output_len`` tokens finishes and
   frees its memory before step ``s + 1``.

A request admitted at step ``a`` and never preempted therefore runs ``output_len + 1``
steps and holds ``prompt_len + (s - a)`` tokens per sample at step ``s``. The K/V of every
prompt and output token is stored (a real engine never writes the last output token's
K/V; the one-token difference is ignored so that ``Oracle`` reserves exactly what is
stored).

Waste accounting (per step, summed over all steps, then divided)
----------------------------------------------------------------
``reserved``
    Contiguous: the slots reserved for running requests. Paged: the slots of blocks in
    use (``usage().slots_allocated``); cached blocks that nothing references are free
    memory and are not counted.
``tokens``
    Slots holding the K/V of a token; a block shared by several sequences counts once.
``reservation waste``
    Reserved slots that the request will fill later (contiguous only: paging reserves
    nothing beyond the current block).
``internal fragmentation``
    Reserved slots that will never hold a token: ``R - (prompt_len + output_len)`` per
    contiguous sequence; for paged policies every empty allocated slot (the allocator's
    ``usage().fragmentation_slots``), the paper's convention (section 4.2: waste is
    confined to the last block).

``waste = reserved - tokens = reservation waste + internal fragmentation``.
"""

from __future__ import annotations

import csv
import json
import math
import random
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from .allocator import BlockAllocator, OutOfBlocksError

#: Block sizes swept by the paged policies (tokens per block; the paper's Fig. 18b and 1).
PAGED_BLOCK_SIZES = (1, 8, 16, 32, 64, 128, 256)
#: Contiguous policies, in table order.
CONTIGUOUS_POLICIES = ("Max", "Pow2", "Oracle")
#: Every policy name.
POLICY_NAMES = (*CONTIGUOUS_POLICIES, "Paged", "Paged+share")
#: Columns a trace file may have; the first two are required.
TRACE_COLUMNS = ("prompt_len", "output_len", "arrival", "prefix_id", "prefix_len", "n")
REQUIRED_TRACE_COLUMNS = ("prompt_len", "output_len")
#: Defaults of :func:`generate_trace`.
DEFAULT_MAX_CONTEXT = 2048
DEFAULT_NUM_PREFIXES = 4


class TraceError(ValueError):
    """A request trace is malformed or inconsistent with ``max_context``."""


class CapacityError(ValueError):
    """A request can never run under a policy: the KV budget is smaller than it needs."""


# Requests and traces ----------------------------------------------------------------------
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

    def __post_init__(self) -> None:
        for name in ("prompt_len", "output_len", "n"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise TraceError(f"{name} must be an integer >= 1, got {value!r}")
        if not _is_int(self.arrival) or self.arrival < 0:
            raise TraceError(f"arrival must be an integer step >= 0, got {self.arrival!r}")
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
        elif not _is_int(self.prefix_len) or not 1 <= self.prefix_len <= self.prompt_len:
            raise TraceError(
                f"prefix_len must be an integer in [1, prompt_len={self.prompt_len}], "
                f"got {self.prefix_len!r}"
            )

    @property
    def total_len(self) -> int:
        """Tokens per sample at the end: ``prompt_len + output_len``."""
        return self.prompt_len + self.output_len


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def validate_trace(trace: Sequence[Request], max_context: int) -> None:
    """Check that ``trace`` is non-empty and every request fits ``max_context``.

    Raises
    ------
    TraceError
        If the trace is empty, or a request's ``prompt_len + output_len`` exceeds
        ``max_context`` (the message gives the request index and both lengths).
    ValueError
        If ``max_context`` < 1.
    """
    if max_context < 1:
        raise ValueError(f"max_context must be >= 1, got {max_context}")
    if not trace:
        raise TraceError("the trace has no requests")
    for i, req in enumerate(trace):
        if req.total_len > max_context:
            raise TraceError(
                f"request {i}: prompt_len + output_len = {req.prompt_len} + {req.output_len} "
                f"= {req.total_len} exceeds max_context={max_context}"
            )


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
    ValueError
        If a parameter is out of range; the message names it and its allowed values.
    """
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    if max_context < 2:
        raise ValueError(f"max_context must be >= 2, got {max_context}")
    if arrival_rate is not None and not arrival_rate > 0:
        raise ValueError(f"arrival_rate must be None or > 0 requests per step, got {arrival_rate}")
    if not 0.0 <= prefix_share <= 1.0:
        raise ValueError(f"prefix_share must be in [0, 1], got {prefix_share}")
    if num_prefixes < 1:
        raise ValueError(f"num_prefixes must be >= 1, got {num_prefixes}")
    if parallel_samples < 1:
        raise ValueError(f"parallel_samples must be >= 1, got {parallel_samples}")
    half = max_context // 2
    if shared_prefix_len is None:
        shared_prefix_len = max(1, max_context // 8)
    if prefix_share > 0 and not 1 <= shared_prefix_len <= half - 1:
        raise ValueError(
            f"shared_prefix_len must be in [1, max_context // 2 - 1 = {half - 1}], "
            f"got {shared_prefix_len}"
        )
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
    (required), ``arrival`` (step), ``prefix_id``, ``prefix_len`` and ``n`` (optional;
    an empty CSV cell or JSON ``null`` takes the :class:`Request` default).

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
        the file, the line and the column.
    FileNotFoundError
        If ``path`` does not exist.
    ValueError
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
        raise ValueError(f"max_context must be >= 1, got {max_context}")
    trace = []
    for line, row in rows:
        req = _request_from_row(path, line, row)
        if req.total_len > max_context:
            raise TraceError(
                f"{path}:{line}: prompt_len + output_len = {req.prompt_len} + "
                f"{req.output_len} = {req.total_len} exceeds max_context={max_context}"
            )
        trace.append(req)
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
        elif _is_int(raw):
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


# Policies and results -----------------------------------------------------------------------
@dataclass(frozen=True)
class Policy:
    """A KV memory policy.

    Parameters
    ----------
    name : str
        One of :data:`POLICY_NAMES`: ``"Max"``, ``"Pow2"``, ``"Oracle"`` (contiguous),
        ``"Paged"``, ``"Paged+share"``.
    block_size : int or None
        Tokens per block for the paged policies (>= 1); ``None`` for contiguous ones.

    Raises
    ------
    ValueError
        If ``name`` is unknown, or ``block_size`` is missing for a paged policy or given
        for a contiguous one.
    """

    name: str
    block_size: int | None = None

    def __post_init__(self) -> None:
        if self.name not in POLICY_NAMES:
            raise ValueError(f"policy name must be one of {list(POLICY_NAMES)}, got {self.name!r}")
        if self.paged:
            if not _is_int(self.block_size) or self.block_size < 1:
                raise ValueError(
                    f"block_size must be an integer >= 1 for policy {self.name}, "
                    f"got {self.block_size!r}"
                )
        elif self.block_size is not None:
            raise ValueError(f"block_size must be None for contiguous policy {self.name}")

    @property
    def paged(self) -> bool:
        return self.name.startswith("Paged")

    @property
    def sharing(self) -> bool:
        return self.name == "Paged+share"

    @property
    def label(self) -> str:
        """``"Max"``, or ``"Paged bs16"`` for a paged policy."""
        return f"{self.name} bs{self.block_size}" if self.paged else self.name


def default_policies(
    block_sizes: Sequence[int] = PAGED_BLOCK_SIZES, sharing: bool = False
) -> list[Policy]:
    """``Max``, ``Pow2``, ``Oracle``, then ``Paged`` at each block size, then (if
    ``sharing``) ``Paged+share`` at each block size."""
    policies = [Policy(name) for name in CONTIGUOUS_POLICIES]
    policies += [Policy("Paged", bs) for bs in block_sizes]
    if sharing:
        policies += [Policy("Paged+share", bs) for bs in block_sizes]
    return policies


@dataclass(frozen=True)
class PolicyResult:
    """What one policy did with one trace and budget.

    Attributes
    ----------
    policy : str
        Policy name (:data:`POLICY_NAMES`).
    block_size : int or None
        Tokens per block (paged), ``None`` (contiguous).
    num_requests : int
        Requests in the trace.
    steps : int
        Steps from 0 until the last request finished (steps).
    utilization_pct : float
        Slots holding tokens, % of reserved slots, summed over steps (%).
    waste_pct : float
        ``100 - utilization_pct``: reserved slots not holding a token (%).
    reservation_waste_pct : float
        Reserved slots to be filled later, % of reserved (%).
    fragmentation_pct : float
        Reserved slots never filled (internal fragmentation), % of reserved (%).
    mean_reserved_tokens : float
        Reserved token slots averaged over all steps (tokens; times the preset's
        ``kv_bytes_per_token`` gives bytes).
    mean_stored_tokens : float
        Token slots holding a token, averaged over all steps (tokens).
    peak_concurrency : int
        Most requests running at once (requests).
    mean_concurrency : float
        Running requests averaged over all steps (requests).
    waited : int
        Requests not admitted in their arrival step (requests).
    preempted : int
        Requests preempted at least once (requests).
    preemptions : int
        Preemption events (a request may be preempted several times).
    recomputed_tokens : int
        Tokens whose K/V preemption dropped, to be recomputed (tokens; with prefix
        caching, readmission may serve some of them from the cache).
    cow_copies : int
        Blocks copied by copy-on-write (``Paged+share`` only; blocks).
    concurrency_ratio : float or None
        ``mean_concurrency`` over the ``Max`` policy's on the same trace and budget;
        ``None`` when ``Max`` was not run.
    throughput_ratio : float or None
        ``Max`` steps over this policy's steps: requests served per step relative to
        ``Max``, assuming every step takes the same time (memory-bound decode).
    """

    policy: str
    block_size: int | None
    num_requests: int
    steps: int
    utilization_pct: float
    waste_pct: float
    reservation_waste_pct: float
    fragmentation_pct: float
    mean_reserved_tokens: float
    mean_stored_tokens: float
    peak_concurrency: int
    mean_concurrency: float
    waited: int
    preempted: int
    preemptions: int
    recomputed_tokens: int
    cow_copies: int
    concurrency_ratio: float | None = None
    throughput_ratio: float | None = None


# Memory models ----------------------------------------------------------------------------
@dataclass(eq=False)
class _Live:
    """Scheduler state of one request."""

    index: int
    request: Request
    generated: int = 0
    reserved: int = 0
    seq_ids: list[tuple[int, int]] = field(default_factory=list)


class _Contiguous:
    """Slot-counting model of a contiguous reservation policy (no external fragmentation)."""

    def __init__(self, policy: Policy, kv_budget_tokens: int, max_context: int) -> None:
        self.policy = policy
        self.max_context = max_context
        self.free_slots = kv_budget_tokens
        self.reserved = 0
        self.tokens = 0
        self.fragmentation = 0
        self.cow_copies = 0

    def reservation(self, req: Request) -> int:
        """Slots reserved per sample (see the module docstring's policies)."""
        if self.policy.name == "Max":
            return self.max_context
        if self.policy.name == "Pow2":
            return min(self.max_context, 1 << (req.total_len - 1).bit_length())
        return req.total_len

    def admit(self, live: _Live) -> bool:
        req = live.request
        per_sample = self.reservation(req)
        need = req.n * per_sample
        if need > self.free_slots:
            return False
        live.reserved = need
        self.free_slots -= need
        self.reserved += need
        self.tokens += req.n * (req.prompt_len + live.generated)
        self.fragmentation += req.n * (per_sample - req.total_len)
        return True

    def grow(self, live: _Live, sample: int) -> bool:
        """Store one more token of one sample: always inside the reservation."""
        self.tokens += 1
        return True

    def release(self, live: _Live, preempt: bool = False) -> int:
        """Free ``live``'s reservation; returns the tokens it held (``preempt`` is never
        set for a contiguous policy, whose reservation covers every token)."""
        req = live.request
        held = req.n * (req.prompt_len + live.generated)
        self.free_slots += live.reserved
        self.reserved -= live.reserved
        self.tokens -= held
        self.fragmentation -= live.reserved - req.n * req.total_len
        live.reserved = 0
        return held

    def sample(self) -> tuple[int, int, int]:
        """``(reserved, tokens, fragmentation)`` slots now."""
        return self.reserved, self.tokens, self.fragmentation


class _Paged:
    """A paged policy driving :class:`BlockAllocator` (blocks, tables, fork, prefix cache).

    Token ids matter only with prefix caching: prefix group ``g`` is the token ``g``
    repeated, request ``i``'s own prompt tokens are ``num_groups + i``, and the tokens
    generated by sample ``k`` of request ``i`` are ``num_groups + num_requests +
    first_sample[i] + k``, so only tokens of a shared prefix ever hash alike.
    """

    def __init__(
        self, policy: Policy, kv_budget_tokens: int, trace: Sequence[Request], seed: int
    ) -> None:
        assert policy.block_size is not None
        num_blocks = kv_budget_tokens // policy.block_size
        if num_blocks < 1:
            raise CapacityError(
                f"kv budget of {kv_budget_tokens} tokens holds no block of "
                f"block_size={policy.block_size}"
            )
        self.sharing = policy.sharing
        self.allocator = BlockAllocator(
            num_blocks, policy.block_size, seed=seed, enable_prefix_caching=self.sharing
        )
        self.cow_copies = 0
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

    def _prompt_tokens(self, live: _Live) -> list[int]:
        req = live.request
        own = self._own_base + live.index
        group = self._group[live.index]
        shared = [] if group is None else [group] * req.prefix_len
        return shared + [own] * (req.prompt_len - len(shared))

    def _generated_token(self, live: _Live, sample: int) -> int:
        return self._gen_base + self._first_sample[live.index] + sample

    def _step(self, seq: tuple[int, int], tokens: int | list[int]) -> int:
        """Append ``tokens`` to ``seq`` as one engine step: reserve the slots, make the
        copy-on-write copy, write and commit; returns the copies made."""
        alloc = self.allocator
        alloc.append_tokens(seq, tokens)
        copies = alloc.pop_copies()
        alloc.copy_done(copies)
        alloc.commit(seq, alloc.num_tokens(seq))
        return len(copies)

    def admit(self, live: _Live) -> bool:
        req = live.request
        alloc = self.allocator
        live.seq_ids = []
        copies = 0
        try:
            if self.sharing:
                first = (live.index, 0)
                prompt = self._prompt_tokens(live)
                if req.n == 1:
                    prompt += [self._generated_token(live, 0)] * live.generated
                live.seq_ids.append(first)
                alloc.add_sequence(first, prompt)
                alloc.commit(first, len(prompt))
                for k in range(1, req.n):
                    live.seq_ids.append((live.index, k))
                    alloc.fork(first, (live.index, k))
                if req.n > 1 and live.generated:
                    for k, seq in enumerate(live.seq_ids):
                        copies += self._step(seq, [self._generated_token(live, k)] * live.generated)
            else:
                for k in range(req.n):
                    seq = (live.index, k)
                    live.seq_ids.append(seq)
                    alloc.add_sequence(seq)
                    self._step(seq, req.prompt_len + live.generated)
        except OutOfBlocksError:
            for seq in live.seq_ids:
                if seq in alloc.sequences():
                    alloc.free(seq)
            live.seq_ids = []
            return False
        self.cow_copies += copies
        return True

    def grow(self, live: _Live, sample: int) -> bool:
        """Append one token to sample ``sample``; False (nothing changed) if no block is free."""
        seq = live.seq_ids[sample]
        try:
            if self.sharing:
                self.cow_copies += self._step(seq, [self._generated_token(live, sample)])
            else:
                self._step(seq, 1)
        except OutOfBlocksError:
            return False
        return True

    def release(self, live: _Live, preempt: bool = False) -> int:
        """Free ``live``'s sequences: ``free`` when it finished, ``preempt`` (for
        recomputation) when ``preempt`` is set; returns the tokens to recompute (0 when
        finished)."""
        alloc = self.allocator
        if preempt:
            held = sum(alloc.preempt(seq) for seq in live.seq_ids)
        else:
            held = 0
            alloc.free(*live.seq_ids)
        live.seq_ids = []
        return held

    def sample(self) -> tuple[int, int, int]:
        """``(reserved, tokens, fragmentation)`` slots now, from ``usage()``."""
        usage = self.allocator.usage()
        return usage.slots_allocated, usage.tokens_stored, usage.fragmentation_slots


# The scheduler ----------------------------------------------------------------------------
def simulate(
    trace: Sequence[Request],
    policy: Policy,
    kv_budget_tokens: int,
    max_context: int = DEFAULT_MAX_CONTEXT,
    seed: int = 0,
) -> PolicyResult:
    """Replay ``trace`` under ``policy`` with continuous batching (module docstring).

    Parameters
    ----------
    trace : Sequence[Request]
        The requests, in trace order (ties in ``arrival`` keep this order).
    policy : Policy
        The memory policy.
    kv_budget_tokens : int
        KV memory in token slots, >= 1 (bytes / ``kv_bytes_per_token``); a paged policy
        gets ``kv_budget_tokens // block_size`` blocks.
    max_context : int
        Longest sequence, prompt + output tokens (``Max`` reserves this per sample).
    seed : int
        Seeds the allocator's block placement (does not change any count).

    Returns
    -------
    PolicyResult
        With ``concurrency_ratio`` and ``throughput_ratio`` left ``None`` (see
        :func:`compare_policies`).

    Raises
    ------
    TraceError
        If the trace is empty or a request exceeds ``max_context``.
    CapacityError
        If some request can never run: it does not fit the budget with nothing else
        running.
    ValueError
        If ``kv_budget_tokens`` < 1.
    """
    if kv_budget_tokens < 1:
        raise ValueError(f"kv_budget_tokens must be >= 1, got {kv_budget_tokens}")
    validate_trace(trace, max_context)
    memory: _Contiguous | _Paged
    if policy.paged:
        memory = _Paged(policy, kv_budget_tokens, trace, seed)
    else:
        memory = _Contiguous(policy, kv_budget_tokens, max_context)

    order = sorted(range(len(trace)), key=lambda i: trace[i].arrival)
    pending = deque(_Live(i, trace[i]) for i in order)
    waiting: deque[_Live] = deque()
    running: list[_Live] = []
    preempted: set[int] = set()
    waited = preemptions = recomputed = 0
    sum_reserved = sum_tokens = sum_frag = sum_running = 0
    peak = 0
    step = 0

    def too_big(live: _Live) -> CapacityError:
        req = live.request
        return CapacityError(
            f"request {live.index} (prompt_len={req.prompt_len}, output_len={req.output_len}, "
            f"n={req.n}) cannot run alone under policy {policy.label} with "
            f"kv_budget_tokens={kv_budget_tokens}"
        )

    while pending or waiting or running:
        if not waiting and not running and pending[0].request.arrival > step:
            step = pending[0].request.arrival  # idle steps: nothing held, nothing running
        while pending and pending[0].request.arrival <= step:
            waiting.append(pending.popleft())

        preempted_now = False
        i = 0
        while i < len(running):
            live = running[i]
            for k in range(live.request.n):
                while not memory.grow(live, k):
                    victim = running.pop()
                    if victim is live and not running:
                        raise too_big(live)
                    recomputed += memory.release(victim, preempt=True)
                    preemptions += 1
                    preempted.add(victim.index)
                    preempted_now = True
                    waiting.appendleft(victim)
                    if victim is live:
                        break
                else:
                    continue
                break  # ``live`` preempted itself; it was the last running request
            else:
                live.generated += 1
                i += 1

        if not preempted_now:
            while waiting and memory.admit(waiting[0]):
                live = waiting.popleft()
                if live.index not in preempted and step > live.request.arrival:
                    waited += 1
                running.append(live)
            if waiting and not running:
                raise too_big(waiting[0])

        reserved, tokens, frag = memory.sample()
        sum_reserved += reserved
        sum_tokens += tokens
        sum_frag += frag
        sum_running += len(running)
        peak = max(peak, len(running))
        step += 1

        finished = [live for live in running if live.generated == live.request.output_len]
        if finished:
            for live in finished:
                memory.release(live)
            running = [live for live in running if live.generated < live.request.output_len]

    waste = sum_reserved - sum_tokens
    pct = (lambda x: 100.0 * x / sum_reserved) if sum_reserved else (lambda x: 0.0)
    return PolicyResult(
        policy=policy.name,
        block_size=policy.block_size,
        num_requests=len(trace),
        steps=step,
        utilization_pct=pct(sum_tokens),
        waste_pct=pct(waste),
        reservation_waste_pct=pct(waste - sum_frag),
        fragmentation_pct=pct(sum_frag),
        mean_reserved_tokens=sum_reserved / step,
        mean_stored_tokens=sum_tokens / step,
        peak_concurrency=peak,
        mean_concurrency=sum_running / step,
        waited=waited,
        preempted=len(preempted),
        preemptions=preemptions,
        recomputed_tokens=recomputed,
        cow_copies=memory.cow_copies,
    )


def compare_policies(
    trace: Sequence[Request],
    policies: Sequence[Policy],
    kv_budget_tokens: int,
    max_context: int = DEFAULT_MAX_CONTEXT,
    seed: int = 0,
) -> list[PolicyResult]:
    """:func:`simulate` every policy on the same trace and budget, with ratios to ``Max``.

    ``concurrency_ratio`` and ``throughput_ratio`` are set relative to the ``Max`` result
    when ``Max`` is among ``policies`` (else they stay ``None``).

    Returns
    -------
    list[PolicyResult]
        One per policy, in the order given.

    Raises
    ------
    TraceError, CapacityError, ValueError
        As :func:`simulate`.
    """
    results = [simulate(trace, p, kv_budget_tokens, max_context, seed) for p in policies]
    base = next((r for r in results if r.policy == "Max"), None)
    if base is None:
        return results
    return [
        replace(
            r,
            concurrency_ratio=r.mean_concurrency / base.mean_concurrency,
            throughput_ratio=base.steps / r.steps,
        )
        for r in results
    ]


def budget_tokens_from_bytes(kv_budget_bytes: int, kv_bytes_per_token: int) -> int:
    """Token slots that ``kv_budget_bytes`` of KV memory holds: ``floor(budget / per_token)``.

    Parameters
    ----------
    kv_budget_bytes : int
        KV memory (bytes), >= 1.
    kv_bytes_per_token : int
        K and V bytes per token over all layers (bytes), >= 1:
        ``2 * num_layers * num_kv_heads * head_dim * dtype_bytes``.

    Raises
    ------
    ValueError
        If either is < 1, or the budget holds no token.
    """
    if kv_budget_bytes < 1:
        raise ValueError(f"kv_budget_bytes must be >= 1, got {kv_budget_bytes}")
    if kv_bytes_per_token < 1:
        raise ValueError(f"kv_bytes_per_token must be >= 1, got {kv_bytes_per_token}")
    tokens = kv_budget_bytes // kv_bytes_per_token
    if tokens < 1:
        raise ValueError(
            f"a kv budget of {kv_budget_bytes} bytes holds no token at "
            f"{kv_bytes_per_token} bytes per token"
        )
    return tokens
