"""The judge's side of a serving loop (``serving.py`` has its events and the
implementation's side): :class:`LoopJudge` turns each event into a tick of the reference
model (``reference/serving.py``), judges each batch's output, row by row, against the
float64 truth of the logical K/V the allocator says each sequence holds, with the per-call
tolerance policy (and the LSE's, for an implementation that returns it), and counts what
the loop exercised (:data:`~.serving.TRANSITIONS`). :class:`InMemoryLoop` drives both
sides in this process (the pytest state machine, ``suites/serving``).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from pagedbench.adapters import Adapter
from pagedbench.reference import OutOfBlocksError, PagedInputError
from pagedbench.reference.serving import Tick, physical_copy

from pagedbench.harness.verdict import tolerance
from pagedbench.harness.verdict.comparison import Checked, Comparison
from pagedbench.harness.verdict.judging import cu_seqlens_q, judged_here
from pagedbench.harness.verdict.messages import (Applied, Concluded, Entered, LoopTick,
                                                 StepDone, Waiting, decode, lse_shape,
                                                 output_shape, split_payload)
from pagedbench.harness.verdict.serving import (Admit, Finish, Fork, LoopEventError, LoopSpec,
                                                Preempt, Readmit, Step, SwapOut,
                                                implementation_side, write_trace)
from pagedbench.harness.verdict.status import Status

#: Step truths kept in this process, by everything a step's truth is a function of (the
#: spec, the queries' seed, the lengths, every token's key): a shrinking state machine
#: replays the same steps many times.
TRUTHS_KEPT = 2048
_TRUTHS: dict[tuple, tolerance.Expected] = {}


@dataclass(frozen=True)
class StepVerdict:
    """The outcome of one tick of a loop.

    Attributes
    ----------
    index : int
        The tick's number (the worker's item).
    event : int
        The event it came from (0-based: the trace's line is ``event + 2``).
    status : Status
        ``pass``, ``fail``, ``error`` or ``unsupported``; a tick without a batch passes.
    reason : str
    seqs : tuple
        The batch's sequences, row order.
    comparison : Comparison or None
    lse : Checked or None
    """

    index: int
    event: int
    status: Status
    reason: str = ""
    seqs: tuple[Hashable, ...] = ()
    comparison: Comparison | None = None
    lse: Checked | None = None

    def where(self) -> str:
        """Which loop sequence the worst element of a failed comparison belongs to (the
        comparison numbers the batch's sequences from 0)."""
        index = (self.comparison.worst_index if self.comparison else None) or \
            (self.lse.worst_index if self.lse else None)
        if not index:
            return ""
        row = index[0]
        seq = (f"loop sequence {self.seqs[row]}" if row < len(self.seqs)
               else f"padding row {row - len(self.seqs)}")
        return f"batch sequence {row} is {seq}"


@dataclass
class LoopJudge:
    """The judge's side of a loop: the reference model, the events so far, the ticks in
    flight, what was exercised (:attr:`coverage`) and every step's verdict.

    Parameters
    ----------
    spec : LoopSpec
    capabilities : dict
        What the implementation declares (``Capabilities.to_dict()``): whether its LSE is
        judged, its yardstick's logits, what a scheduler may ask of it.
    work : callable
        How the judge's own computations run (:func:`~.judging.judged_here`).
    """

    spec: LoopSpec
    capabilities: dict[str, Any] = field(default_factory=dict)
    work: Callable[[Callable[[], Any], str], Any] = judged_here
    events: list[BaseModel] = field(default_factory=list)
    verdicts: list[StepVerdict] = field(default_factory=list)
    coverage: Counter = field(default_factory=Counter)

    @property
    def returns_lse(self) -> bool:
        return bool(self.capabilities.get("returns_lse", False))

    @property
    def logits_precision(self) -> str:
        return str(self.capabilities.get("logits_precision", "float32"))

    def __post_init__(self) -> None:
        self.model = self.spec.model()
        self.ticks = 0
        self._freed: set[int] = set()  # physical blocks freed with K/V in them
        self._prefix_hit: set[Hashable] = set()
        self._readmit: dict[Hashable, list[int]] = {}

    def tick_for(self, event: BaseModel) -> Tick:
        """Apply ``event`` to the reference model and record it.

        Raises
        ------
        LoopEventError
            If the reference refuses it (nothing is recorded).
        """
        model = self.model
        cached = model.allocator.cached_blocks().items()
        try:
            tick = self._apply(event)
        except (PagedInputError, OutOfBlocksError, KeyError, LoopEventError) as exc:
            raise LoopEventError(f"event {len(self.events) + 1} ({event.model_dump_json()}): "
                                 f"{exc}") from None
        self.events.append(event)
        self.coverage[event.op] += 1
        self.coverage["prefix-evicted"] += len(cached - model.allocator.cached_blocks().items())
        self.coverage["copy-on-write"] += sum(c.kind.value == "copy-on-write" for c in tick.copies)
        written = {s // model.block_size for s in tick.slots}
        self.coverage["freed-block-reused"] += len(written & self._freed)
        self._freed -= written
        return tick

    def _apply(self, event: BaseModel) -> Tick:
        model = self.model
        if isinstance(event, Admit):
            tick = model.admit(event.seq, event.prompt)
            if model.requests[event.seq].prefix_hit:
                self._prefix_hit.add(event.seq)
            return tick
        if isinstance(event, Readmit):
            if event.seq not in self._readmit:
                raise LoopEventError(f"sequence {event.seq} was not preempted")
            tick = model.admit(event.seq, self._readmit.pop(event.seq))
            if model.requests[event.seq].prefix_hit:
                self._prefix_hit.add(event.seq)
            return tick
        if isinstance(event, Step):
            tick = model.step([tuple(r) for r in event.rows], pad=event.pad)
            batch = tick.batch
            decode_rows = [(s, q) for s, q, p in zip(batch.seqs, batch.q_lens, batch.prefill)
                           if not p]
            self.coverage["prefix-hit-decode"] += sum(s in self._prefix_hit for s, _ in decode_rows)
            self.coverage["multi-token-decode"] += sum(q > 1 for _, q in decode_rows)
            self.coverage["mixed-batch"] += any(batch.prefill) and bool(decode_rows)
            self.coverage["padded-batch"] += batch.pad > 0
            return tick
        if isinstance(event, Fork):
            return model.fork(event.parent, event.child)
        if isinstance(event, (Finish, Preempt)):
            blocks = {model.physical(b) for b in model.allocator.block_table(event.seq)} \
                if event.seq in model.allocator else set()
            if isinstance(event, Finish):
                tick = model.finish(event.seq)
            else:
                tick, self._readmit[event.seq] = model.preempt(event.seq)
            self._freed |= blocks
            self._prefix_hit.discard(event.seq)
            return tick
        if isinstance(event, SwapOut):
            return model.swap_out(event.seq)
        return model.swap_in(event.seq)

    def message_for(self, tick: Tick) -> LoopTick:
        """The :class:`~.messages.LoopTick` the worker is sent for ``tick``."""
        batch = tick.batch
        fields: dict[str, Any] = dict(copies=[physical_copy(c) for c in tick.copies],
                                      slots=list(tick.slots), keys=list(tick.keys),
                                      index=self.ticks)
        if batch is not None:
            fields |= dict(q_lens=list(batch.q_lens), kv_lens=list(batch.kv_lens),
                           block_tables=[list(r) for r in batch.block_tables],
                           q_seed=batch.q_seed)
        self.ticks += 1
        return LoopTick(**fields)

    def judge(self, tick: Tick, message: BaseModel) -> StepVerdict:
        """The verdict on what the worker answered to ``tick`` (``Applied``, ``StepDone``
        or ``Concluded``); the reference then moves on (:meth:`ServingModel.done`).

        Raises
        ------
        ValueError
            If the message is not an answer to a tick, or its values are not what it
            describes (the implementation's fault).
        """
        index, event = self.ticks - 1, len(self.events) - 1
        batch = tick.batch
        seqs = batch.seqs if batch is not None else ()
        if isinstance(message, Concluded):
            verdict = StepVerdict(index, event, Status.ERROR,
                                  f"{message.step}: {message.reason}", seqs)
        elif isinstance(message, Applied):
            status = Status.UNSUPPORTED if message.unsupported else Status.PASS
            if batch is not None and not message.unsupported:
                raise ValueError("a tick with a batch answered without its output")
            verdict = StepVerdict(index, event, status, message.unsupported, seqs)
        elif isinstance(message, StepDone):
            if batch is None:
                raise ValueError("an output for a tick without a batch")
            verdict = self._compare(index, event, tick, message)
            self.coverage["plan-replayed"] += message.replayed
        else:
            raise ValueError(f"a {getattr(message, 'kind', type(message).__name__)!r} "
                             "message does not answer a tick")
        self.model.done(tick)
        self.verdicts.append(verdict)
        return verdict

    def _compare(self, index: int, event: int, tick: Tick, message: StepDone) -> StepVerdict:
        batch, model = tick.batch, self.model
        case = model.step_case(batch)
        shapes = [(output_shape(case), case.dtype), (lse_shape(case), "float32")]
        if len(message.outputs) != 1 + self.returns_lse:
            raise ValueError(f"{len(message.outputs)} outputs; declared "
                             f"{'an output and its LSE' if self.returns_lse else 'one'}")
        chunks = split_payload(message.payload, message.outputs)
        found = [decode(d, c, shape, dtype)
                 for d, c, (shape, dtype) in zip(message.outputs, chunks, shapes)]

        def judged() -> tuple[Comparison, Checked | None]:
            key = (self.spec.model_dump_json(), batch.q_seed, batch.q_lens, batch.kv_lens,
                   tuple(tuple(model.requests[seq].keys[:n])
                         for seq, n in zip(batch.seqs, batch.kv_lens)),
                   self.logits_precision, self.returns_lse)
            expected = _TRUTHS.get(key)
            if expected is None:
                expected = tolerance.Expected.of(model.truth_inputs(batch), self.logits_precision,
                                                 with_lse=self.returns_lse)
                _TRUTHS[key] = expected
                while len(_TRUTHS) > TRUTHS_KEPT:
                    _TRUTHS.pop(next(iter(_TRUTHS)))
            bounds = cu_seqlens_q(case)
            out = tolerance.compare(found[0], expected, case.dtype, bounds)
            lse = (tolerance.compare_lse(found[1], expected, case.dtype, self.logits_precision,
                                         bounds) if self.returns_lse else None)
            return out, lse

        comparison, lse = self.work(judged, "compare")
        passed = comparison.passed and (lse is None or lse.passed)
        return StepVerdict(index, event, Status.PASS if passed else Status.FAIL,
                           comparison.reason or (lse.reason if lse else ""), batch.seqs,
                           comparison, lse)


class InMemoryLoop:
    """A loop with both sides in this process (the pytest state machine): :meth:`event`
    applies one event and returns the verdict of its tick (None for an event that needed
    nothing of the implementation)."""

    def __init__(self, adapter: Adapter, spec: LoopSpec, device: str) -> None:
        self.judge = LoopJudge(spec, adapter.capabilities(device).to_dict())
        self.side = implementation_side(adapter, spec, device)
        self._pending = next(self.side)  # its first "step" announcement

    def event(self, event: BaseModel) -> StepVerdict | None:
        """Apply ``event``; raises :class:`LoopEventError` if the reference refuses it."""
        tick = self.judge.tick_for(event)
        if tick.empty:
            self.judge.model.done(tick)
            return None
        message = self._exchange(self.judge.message_for(tick))
        return self.judge.judge(tick, message)

    def _exchange(self, reply: LoopTick) -> BaseModel:
        """Hand ``reply`` to the implementation's side; its answer."""
        message = self._pending
        while not isinstance(message, Waiting):
            message = next(self.side)
        message = self.side.send(reply)
        while isinstance(message, Entered):
            message = next(self.side)
        self._pending = next(self.side)
        return message

    def close(self) -> None:
        self.side.close()


def save_failure(path: Path, judge: LoopJudge) -> Path:
    """Write the trace of ``judge``'s loop so far to ``path`` (its last event the one that
    failed); the path."""
    write_trace(path, judge.spec, judge.events)
    return path


def describe_failure(verdict: StepVerdict, judge: LoopJudge) -> str:
    """What broke: the tick, the event (trace line) and where in the batch."""
    event = judge.events[verdict.event]
    where = verdict.where()
    return (f"tick {verdict.index} ({verdict.status}), event {verdict.event + 1} "
            f"{json.dumps(event.model_dump())}{': ' + where if where else ''}: {verdict.reason}")


__all__ = ["TRUTHS_KEPT", "InMemoryLoop", "LoopJudge", "StepVerdict", "describe_failure",
           "save_failure"]
