"""The serving-loop check: one implementation, one persistent pool, the events of an engine.

The reference allocator (``reference/serving.py``'s :class:`~pagedbench.reference.serving.ServingModel`)
drives the loop: each :data:`Event` (a line of a trace) becomes a tick: block copies, new
tokens' K/V written at their slots, and a batch. The two sides are a check's
(``conformance.py``):

- the **implementation's side** (:func:`implementation_side`, a generator) keeps one pool
  for the whole loop, applies each tick's copies, writes the K/V (through the adapter's own
  cache-write op when it has one, ``Adapter.write_kv``), writes the batch's metadata into
  the same tensors it used for that batch shape before, and prepares (or, for an adapter
  declaring ``plan_reuse``, refreshes the plan it made for that shape) and runs;
- the **judge's side** (``serving_judge.py``'s ``LoopJudge``) turns events into ticks and
  judges each batch against the float64 truth of the logical K/V the allocator says each
  sequence holds.

``serving_judge.InMemoryLoop`` drives both in this process (the pytest state machine,
``suites/serving``); ``pagedbench loop`` drives them across the worker pipe
(``harness/run/loop.py``). A trace (``.jsonl``: the :class:`LoopSpec`, then one event per
line) replays a loop exactly.
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, Union

import torch
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from pagedbench.adapters import Adapter
from pagedbench.reference import PagedCase, PagedInputError, PagedInputs
from pagedbench.reference.inputs import STALE_SCALE, alibi_slopes
from pagedbench.reference.serving import (PADDING_BLOCK, ServingModel, loop_sinks, step_queries,
                                          token_kv)
from pagedbench.reference.writes import store, write_slots

from pagedbench.harness.verdict.conformance import synchronize, tail_poison
from pagedbench.harness.verdict.judging import describe_exception
from pagedbench.harness.verdict.messages import (Applied, Concluded, Entered, LoopTick,
                                                 StepDone, Waiting, encode, lse_shape,
                                                 output_shape, validation_problem)
from pagedbench.harness.verdict.status import Status

_STRICT = ConfigDict(extra="forbid", frozen=True)


class LoopSpec(BaseModel):
    """A loop's fixed part: the case axes every step shares (``case``: a
    :meth:`PagedCase.to_dict`, its lengths ignored; its ``seed`` seeds the loop), the
    blocks the allocator hands out, and the most rows a batch and tokens a sequence has."""

    model_config = _STRICT

    kind: Literal["loop"] = "loop"
    case: dict[str, Any]
    num_blocks: int = Field(ge=2)
    max_batch: int = Field(ge=1)
    max_tokens: int = Field(ge=1)
    num_host_blocks: int = Field(default=8, ge=0)

    def template(self) -> PagedCase:
        """The case every step's case is made from."""
        return PagedCase.from_dict(self.case)

    def model(self) -> ServingModel:
        return ServingModel(self.template(), self.num_blocks, max_batch=self.max_batch,
                            max_tokens=self.max_tokens, num_host_blocks=self.num_host_blocks)


# Events ----------------------------------------------------------------------------------
class Admit(BaseModel):
    """A request arrives with ``prompt`` (token ids); a cached prefix is shared."""

    model_config = _STRICT
    op: Literal["admit"] = "admit"
    seq: int
    prompt: list[Annotated[int, Field(ge=0, lt=2**62)]] = Field(min_length=1)


class Readmit(BaseModel):
    """A preempted request comes back with every token it had (recomputed)."""

    model_config = _STRICT
    op: Literal["readmit"] = "readmit"
    seq: int


class Step(BaseModel):
    """A forward pass: ``rows`` of ``[seq, tokens]`` (prompt tokens of a sequence still
    prefilling, else new tokens it decodes: 1, or 2-4 for speculative decoding), then
    ``pad`` empty rows."""

    model_config = _STRICT
    op: Literal["step"] = "step"
    rows: list[tuple[int, Annotated[int, Field(ge=1)]]] = Field(min_length=1)
    pad: int = Field(default=0, ge=0)


class Fork(BaseModel):
    model_config = _STRICT
    op: Literal["fork"] = "fork"
    parent: int
    child: int


class _OfOneSequence(BaseModel):
    """An event ``op`` on sequence ``seq`` alone."""

    model_config = _STRICT
    op: str
    seq: int


class Finish(_OfOneSequence):
    op: Literal["finish"] = "finish"


class Preempt(_OfOneSequence):
    op: Literal["preempt"] = "preempt"


class SwapOut(_OfOneSequence):
    op: Literal["swap-out"] = "swap-out"


class SwapIn(_OfOneSequence):
    op: Literal["swap-in"] = "swap-in"


Event = Annotated[Union[Admit, Readmit, Step, Fork, Finish, Preempt, SwapOut, SwapIn],
                  Field(discriminator="op")]
_EVENT = TypeAdapter(Event)
#: What the loop counts (:attr:`LoopJudge.coverage`): each event kind, and these
#: transitions.
TRANSITIONS = ("prefix-hit-decode", "copy-on-write", "freed-block-reused", "plan-replayed",
               "mixed-batch", "padded-batch", "multi-token-decode", "prefix-evicted")


class LoopEventError(ValueError):
    """An event the reference refuses (an unknown sequence, a pool too small): the
    message names the event and why."""


def write_trace(path: Path, spec: LoopSpec, events: list[BaseModel]) -> None:
    """``path``: the spec, then one event per line."""
    lines = [spec.model_dump_json()] + [e.model_dump_json() for e in events]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")


def read_trace(path: Path) -> tuple[LoopSpec, list[BaseModel]]:
    """A trace written by :func:`write_trace`.

    Raises
    ------
    LoopEventError
        Naming the line that is not a spec (line 1) or an event (every other line).
    """
    lines = [line for line in Path(path).read_text().splitlines() if line.strip()]
    if not lines:
        raise LoopEventError(f"{path}: empty; a trace starts with its loop spec")
    try:
        spec = LoopSpec.model_validate_json(lines[0])
        spec.template()
    except (ValidationError, PagedInputError) as exc:
        why = validation_problem(exc) if isinstance(exc, ValidationError) else str(exc)
        raise LoopEventError(f"{path}:1: not a loop spec: {why}") from None
    events = []
    for number, line in enumerate(lines[1:], 2):
        try:
            events.append(_EVENT.validate_json(line))
        except ValidationError as exc:
            raise LoopEventError(f"{path}:{number}: not a loop event: "
                                 f"{validation_problem(exc)}") from None
    return spec, events


# The implementation's side -----------------------------------------------------------------
def new_pool(spec: LoopSpec, adapter: Adapter, device: str) -> torch.Tensor:
    """The loop's pool ``[pool_blocks, 2, block_size, num_kv_heads, cache_head_dim]`` on
    ``device``: NaN everywhere, except that for an adapter declaring
    ``nan_safe_tail=False`` the V of every block but the padding one holds finite stale
    values (as an earlier request leaves them), K staying NaN until written (the per-call
    tail-poison policy, ``conformance.tail_poison``)."""
    case, model = spec.template(), spec.model()
    shape = (model.pool_blocks, 2, case.block_size, case.num_kv_heads, case.cache_head_dim)
    pool = torch.full(shape, float("nan"), dtype=case.kv_torch_dtype)
    if tail_poison(adapter.capabilities(device)) == "stale":
        generator = torch.Generator().manual_seed(case.seed + 5)
        stale = STALE_SCALE * torch.randn(shape[0], *shape[2:], generator=generator)
        pool[:, 1] = store(stale, case.v_scale, case.kv_torch_dtype)
        pool[PADDING_BLOCK, 1] = float("nan")
    return pool.to(device)


@dataclass
class _Bucket:
    """The tensors of one batch shape, written in place at every step of that shape, and
    the plan made for it (for an adapter declaring ``plan_reuse``)."""

    q: torch.Tensor
    block_tables: torch.Tensor
    kv_lens: torch.Tensor
    cu_seqlens_q: torch.Tensor
    prepared: Any = None


def _apply_copies(pool: torch.Tensor, host: torch.Tensor, tick: LoopTick) -> None:
    for kind, src, dst in tick.copies:
        if kind == "copy-on-write":
            pool[dst] = pool[src]
        elif kind == "swap-out":
            host[dst] = pool[src].to(host.device)
        else:
            pool[dst] = host[src].to(pool.device)


def implementation_side(adapter: Adapter, spec: LoopSpec, device: str
                        ) -> Generator[Any, LoopTick | None, None]:
    """The implementation's side of a loop (see the module docstring): yields
    :class:`~.messages.Waiting` and receives each :class:`~.messages.LoopTick` (or None:
    the loop is over), then yields :class:`~.messages.Applied`,
    :class:`~.messages.StepDone` or, for what the adapter raised,
    :class:`~.messages.Concluded`; announces each step (:class:`~.messages.Entered`)."""
    case = spec.template()
    capabilities = adapter.capabilities(device)
    pool = new_pool(spec, adapter, device)
    host = torch.full((max(1, spec.num_host_blocks), *pool.shape[1:]), float("nan"),
                      dtype=pool.dtype)
    buckets: dict[tuple[int, int], _Bucket] = {}
    columns = spec.model().table_columns
    while True:
        yield Entered(step="step")
        tick = yield Waiting()
        if tick is None or tick.end:
            return
        yield Entered(step="write")
        _apply_copies(pool, host, tick)
        if tick.slots:
            slots = torch.tensor(tick.slots, dtype=torch.int64, device=device)
            key, value = (t.to(device) for t in token_kv(tick.keys, case))
            try:
                written = adapter.write_kv(pool, slots, key, value, case)
            except (Exception, SystemExit) as exc:
                yield Concluded(status=str(Status.ERROR), step="write",
                                reason=f"write_kv raised {describe_exception(exc)}",
                                exception=exc)
                continue
            if not written:
                write_slots(pool, slots, key, value, case.k_scale, case.v_scale)
        if not tick.q_lens:
            yield Applied()
            continue
        step_case = case.with_(kv_lens=tuple(tick.kv_lens), q_lens=tuple(tick.q_lens),
                               num_blocks=pool.shape[0], tag=f"loop-step{tick.index}")
        yield Entered(step="why_unsupported")
        try:
            reasons = adapter.why_unsupported(step_case, device)
        except (Exception, SystemExit) as exc:
            yield Concluded(status=str(Status.ERROR), step="why_unsupported",
                            reason=f"why_unsupported raised {describe_exception(exc)}",
                            exception=exc)
            continue
        if reasons:
            yield Applied(unsupported="; ".join(map(str, reasons)))
            continue
        shape = (len(tick.q_lens), sum(tick.q_lens))
        bucket = buckets.get(shape)
        if bucket is None:
            bucket = buckets[shape] = _Bucket(
                q=torch.empty(shape[1], case.num_q_heads, case.head_dim, dtype=case.torch_dtype,
                              device=device),
                block_tables=torch.empty(shape[0], columns, dtype=torch.int32, device=device),
                kv_lens=torch.empty(shape[0], dtype=torch.int32, device=device),
                cu_seqlens_q=torch.empty(shape[0] + 1, dtype=torch.int32, device=device))
        inputs = _step_inputs(bucket, pool, step_case, tick, device)
        replayed = capabilities.plan_reuse and bucket.prepared is not None
        yield Entered(step="prepare")
        try:
            prepared = (adapter.refresh(bucket.prepared, inputs) if replayed
                        else adapter.prepare(inputs))
        except (Exception, SystemExit) as exc:
            yield Concluded(status=str(Status.ERROR), step="prepare",
                            reason=describe_exception(exc), exception=exc)
            continue
        if capabilities.plan_reuse:
            bucket.prepared = prepared
        yield Entered(step="run")
        try:
            out = adapter.run(prepared)
            lse = adapter.lse(prepared) if capabilities.returns_lse else None
            synchronize(device)
            yield Entered(step="output")
            sent = [encode(out, output_shape(step_case), step_case.dtype)]
            if capabilities.returns_lse:
                sent.append(encode(lse, lse_shape(step_case), "float32"))
        except (Exception, SystemExit) as exc:
            yield Concluded(status=str(Status.ERROR), step="run",
                            reason=describe_exception(exc), exception=exc)
            continue
        yield StepDone(outputs=[d for d, _ in sent], replayed=replayed,
                       payload=b"".join(p for _, p in sent))


def _step_inputs(bucket: _Bucket, pool: torch.Tensor, case: PagedCase, tick: LoopTick,
                 device: str) -> PagedInputs:
    """The step's inputs: its metadata and queries written into the bucket's own tensors
    (the same objects at every step of this shape), the pool as it is."""
    bucket.q.copy_(step_queries(case, case.total_q, tick.q_seed))
    bucket.block_tables.copy_(torch.tensor(tick.block_tables, dtype=torch.int32))
    bucket.kv_lens.copy_(torch.tensor(tick.kv_lens, dtype=torch.int32))
    bounds = [0]
    for q_len in tick.q_lens:
        bounds.append(bounds[-1] + q_len)
    bucket.cu_seqlens_q.copy_(torch.tensor(bounds, dtype=torch.int32))
    bs = case.block_size
    slots = [row[t // bs] * bs + t % bs for row, n in zip(tick.block_tables, tick.kv_lens)
             for t in range(n)]
    return PagedInputs(
        case=case, q=bucket.q, kv_cache=pool, block_tables=bucket.block_tables,
        kv_lens=bucket.kv_lens, cu_seqlens_q=bucket.cu_seqlens_q,
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        padding_block=PADDING_BLOCK,
        alibi_slopes=alibi_slopes(case.num_q_heads).to(device) if case.alibi else None,
        sinks=None if not case.sinks else loop_sinks(case).to(device))


__all__ = ["TRANSITIONS", "Admit", "Event", "Finish", "Fork", "LoopEventError", "LoopSpec",
           "Preempt", "Readmit", "Step", "SwapIn", "SwapOut", "implementation_side", "new_pool",
           "read_trace", "write_trace"]
