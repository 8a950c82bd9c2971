"""``pagedbench loop``'s engine: a serving loop on one implementation in a worker process.

The judge's side (:class:`~pagedbench.harness.verdict.serving_judge.LoopJudge`) runs here, in the
parent, which never imports a plug-in; the implementation's side runs in a worker
(``harness/run/jobs.py``'s ``loop`` job), one tick per item of the worker protocol, so a
tick that hangs or crashes is that step's ``timeout`` or ``crash``. Events come from a
trace (``--trace``) or from :class:`Scheduler`, which plays an engine's scheduler with a
seeded generator: requests arrive (half of them sharing a prompt prefix with an earlier
one), are prefilled in chunks beside decodes, fork, finish, are preempted (when the pool is
short) and re-admitted, swapped out and in, and decode-only batches are padded to a power
of two with empty rows, as a captured graph's batch is, within what the implementation
declares (its modes, its features, whether it takes shared
blocks). The first step that fails ends the loop; its trace is saved for ``pagedbench
replay``.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ValidationError

from pagedbench.harness.results.record import ListingRow
from pagedbench.harness.run.config import RunConfig
from pagedbench.harness.run.environment import worker_environment
from pagedbench.harness.run.protocol import Answer, Supervisor
from pagedbench.harness.verdict import judging
from pagedbench.harness.verdict.messages import (IMPL, JOB_STEPS, Applied, Concluded, Fatal,
                                                 Loaded, LoopTick, Message, StepDone, Waiting,
                                                 as_json, validation_problem)
from pagedbench.harness.verdict.serving import (Admit, Finish, Fork, LoopEventError, LoopSpec,
                                                Preempt, Readmit, Step, SwapIn, SwapOut)
from pagedbench.harness.verdict.serving_judge import LoopJudge, StepVerdict
from pagedbench.harness.verdict.status import Status
from pagedbench.reference.serving import VOCAB

#: Longest prompt chunk a step prefills, in blocks.
CHUNK_BLOCKS = 2
#: Weights of the scheduler's actions besides a step.
WEIGHTS = {"admit": 3.0, "fork": 0.6, "finish": 1.0, "preempt": 0.4, "swap": 0.4}


@dataclass
class Scheduler:
    """Events for a loop of ``steps`` forward passes, drawn from ``seed`` (see the module
    docstring), within what the implementation declared (the judge's ``capabilities``):
    decode-only implementations get prefill steps of their own (which they answer
    ``unsupported``) and no multi-token decodes; padding needs ``empty_kv``; prefix
    sharing and forks need ``shared_blocks``."""

    spec: LoopSpec
    steps: int
    seed: int
    rng: random.Random = field(init=False)
    made: int = 0
    next_seq: int = 0
    prompts: list[list[int]] = field(default_factory=list)
    preempted: list[int] = field(default_factory=list)
    swapped: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)

    def next_event(self, judge: LoopJudge) -> BaseModel | None:
        """The next event for the loop ``judge`` holds (None after ``steps`` steps)."""
        if self.made >= self.steps:
            return None
        model, rng, capabilities = judge.model, self.rng, judge.capabilities
        on_device = model.decoding() + model.prefilling()
        free = model.allocator.num_free_blocks
        if self.preempted and len(on_device) < self.spec.max_batch and \
                model.allocator.blocks_needed_for_prompt(
                    model.requests[self.preempted[0]].tokens) <= free:
            return Readmit(seq=self.preempted.pop(0))
        if self.swapped and rng.random() < 0.5 and len(on_device) < self.spec.max_batch and \
                -(-len(model.requests[self.swapped[0]].tokens) // model.block_size) <= free:
            return SwapIn(seq=self.swapped.pop(0))
        choices = {"step": 4.0 if on_device else 0.0} | WEIGHTS
        if len(on_device) >= self.spec.max_batch - 1:
            choices["admit"] = 0.0
        if not model.decoding():
            choices.update(fork=0.0, finish=0.0, preempt=0.0, swap=0.0)
        if not capabilities.get("shared_blocks", True):
            choices["fork"] = 0.0
        action = rng.choices(list(choices), weights=list(choices.values()))[0]
        if action == "step":
            event = self._step(judge)
            need = sum(model.allocator.blocks_needed(seq, n) for seq, n in
                       getattr(event, "rows", ()) if not model.pending_prompt(seq))
            if need > model.allocator.num_free_blocks:
                return self._make_room(judge)
            self.made += isinstance(event, Step)
            return event
        if action == "admit":
            event = self._admit(capabilities.get("shared_blocks", True))
            if model.allocator.blocks_needed_for_prompt(event.prompt) > \
                    model.allocator.num_free_blocks:
                self.prompts.pop()
                return self._make_room(judge)
            self.next_seq += 1
            return event
        seq = rng.choice(model.decoding())
        if action == "fork":
            self.next_seq += 1
            return Fork(parent=seq, child=self.next_seq)
        if action == "finish":
            return Finish(seq=seq)
        if action == "preempt":
            self.preempted.append(seq)
            return Preempt(seq=seq)
        usage = model.allocator.usage()
        if len(model.allocator.block_table(seq)) > model.num_host_blocks - usage.host_blocks_used:
            return Finish(seq=seq)  # the host pool is full: the request ends instead
        self.swapped.append(seq)
        return SwapOut(seq=seq)

    def _admit(self, share: bool) -> Admit:
        rng, bs = self.rng, self.spec.template().block_size
        length = rng.randint(1, max(1, self.spec.max_tokens // 2))
        prompt = [rng.randrange(VOCAB) for _ in range(length)]
        if self.prompts and share and rng.random() < 0.5:
            source = rng.choice(self.prompts)
            shared = bs * rng.randint(1, max(1, len(source) // bs))
            prompt = (source[:shared] + prompt)[: self.spec.max_tokens // 2 + shared]
        self.prompts.append(prompt)
        return Admit(seq=self.next_seq + 1, prompt=prompt)

    def _make_room(self, judge: LoopJudge) -> BaseModel:
        """The pool is short: preempt the newest decoding sequence (vLLM preempts the
        lowest-priority, last-scheduled request), else finish one that is prefilling."""
        model = judge.model
        if model.decoding():
            seq = model.decoding()[-1]
            self.preempted.append(seq)
            return Preempt(seq=seq)
        return Finish(seq=model.prefilling()[-1])

    def _step(self, judge: LoopJudge) -> Step:
        model, rng, capabilities = judge.model, self.rng, judge.capabilities
        prefill_mode = "prefill" in capabilities.get("modes", ["prefill"])
        decoding = [s for s in model.decoding()
                    if len(model.requests[s].tokens) < self.spec.max_tokens]
        prefilling = model.prefilling()
        rows: list[tuple[int, int]] = []
        if prefilling and (prefill_mode or not decoding or rng.random() < 0.3):
            chunk = CHUNK_BLOCKS * model.block_size
            rows += [(s, min(model.pending_prompt(s), rng.randint(1, chunk)))
                     for s in prefilling]
        if prefill_mode or not rows:
            for seq in decoding:
                room = self.spec.max_tokens - len(model.requests[seq].tokens)
                tokens = rng.randint(2, 4) if prefill_mode and rng.random() < 0.2 else 1
                rows.append((seq, min(tokens, room)))
        rows = rows[: self.spec.max_batch]
        if not rows:  # nothing on device can grow: finish the longest
            return Finish(seq=max(model.decoding(), key=lambda s: len(model.requests[s].tokens)))
        pad = 0
        decode_only = all(not model.pending_prompt(seq) for seq, _ in rows)
        if decode_only and "empty_kv" in capabilities.get("features", []):
            size = 1 << (len(rows) - 1).bit_length()  # a captured graph's batch size
            pad = min(size, self.spec.max_batch) - len(rows)
        return Step(rows=rows, pad=pad)


@dataclass
class LoopOutcome:
    """What a loop in a worker concluded: every step's verdict, the listing row, and,
    when it stopped early, why (a worker fault, an event the reference refused)."""

    judge: LoopJudge
    row: ListingRow | None = None
    stopped: str = ""
    status: Status | None = None

    @property
    def verdicts(self) -> list[StepVerdict]:
        return self.judge.verdicts


def run_loop(name: str, target: str, spec: LoopSpec, config: RunConfig,
             next_event: Callable[[LoopJudge], BaseModel | None],
             on_verdict: Callable[[StepVerdict, LoopJudge], None] | None = None) -> LoopOutcome:
    """Run a loop on ``target`` in a worker, events from ``next_event(judge)`` (None ends
    it), judged here; ``on_verdict`` is called with each step's verdict as it comes. The
    first step that does not pass (``unsupported`` aside) ends the loop."""
    judge: LoopJudge | None = None
    outcome = LoopOutcome(LoopJudge(spec))
    state: dict[str, Any] = {"tick": None, "over": False}

    def next_tick() -> LoopTick:
        while not state["over"]:
            event = next_event(judge)
            if event is None:
                break
            try:
                tick = judge.tick_for(event)
            except LoopEventError as exc:
                outcome.stopped, outcome.status = str(exc), Status.ERROR
                break
            if tick.empty:
                judge.model.done(tick)
                continue
            state["tick"] = tick
            return judge.message_for(tick)
        return LoopTick(end=True)

    def on_message(message: Message) -> Answer:
        nonlocal judge
        if isinstance(message, Loaded):
            try:
                outcome.row = ListingRow.model_validate(message.row)
            except ValidationError as exc:
                raise judging.Refused(validation_problem(exc)) from exc
            judge = outcome.judge = LoopJudge(spec, dict(outcome.row.capabilities or {}))
            if not outcome.row.available:
                outcome.stopped, outcome.status = outcome.row.reason, Status.UNAVAILABLE
            return Answer()
        if isinstance(message, Fatal):
            outcome.stopped, outcome.status = message.reason, Status.ERROR
            return Answer()
        if isinstance(message, Waiting):
            return Answer(as_json(next_tick()))
        if not isinstance(message, (Applied, StepDone, Concluded)) or state["tick"] is None:
            raise judging.Refused(f"a {message.kind!r} message in a loop")
        try:
            verdict = judge.judge(state["tick"], message)
        except ValueError as exc:
            raise judging.Refused(str(exc)) from exc
        state["tick"] = None
        if on_verdict is not None:
            on_verdict(verdict, judge)
        if verdict.status in (Status.FAIL, Status.ERROR):
            state["over"] = True
        return Answer(item_done=True)

    job = {"kind": "loop", "name": name, "target": target, "spec": spec.model_dump(mode="json"),
           "device": config.device, "threads": config.threads, "start": 0}
    supervisor = Supervisor(job, worker_environment(config.device, config.cache_dir),
                            {IMPL: config.case_timeout_s}, JOB_STEPS["loop"],
                            max_payload_bytes=2 * 4 * spec.max_batch * spec.max_tokens
                            * spec.template().num_q_heads * spec.template().cache_head_dim)
    try:
        fault = supervisor.run(on_message)
    except judging.Refused as exc:
        outcome.stopped, outcome.status = f"the worker sent what the loop refuses ({exc})", \
            Status.ERROR
        return outcome
    if fault is not None:
        kind = {"timeout": Status.TIMEOUT, "crash": Status.CRASH}.get(fault.kind, Status.ERROR)
        outcome.stopped, outcome.status = (f"worker {fault.detail} during {fault.step} of "
                                           f"tick {fault.item}"), kind
    return outcome


__all__ = ["CHUNK_BLOCKS", "LoopOutcome", "Scheduler", "run_loop"]
