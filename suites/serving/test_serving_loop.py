"""Every implementation, driven through a serving loop on one persistent pool, agrees with
the float64 truth at every step: requests admitted (sharing cached prompt prefixes),
prefilled in chunks beside decodes, decoding one token or several (speculative
verification), padded to a captured batch size with empty rows, forked (copy-on-write of
the shared partial block), finished (their blocks handed out again with their K/V in
them), preempted and re-admitted, swapped out and in; plans replayed on new metadata for
an implementation that declares ``plan_reuse`` (``harness/verdict/serving.py``).

Each loop configuration is driven first by ``pagedbench loop``'s seeded scheduler
(:func:`scheduled_loop`: the same events on every host, so what it exercises is stated
exactly, suites/serving/test_serving_coverage.py), then by a hypothesis state machine
(:func:`machine_for`) that chooses the events and shrinks a failing loop to its shortest
event sequence. A failure is saved as a trace that ``pagedbench replay TRACE --impl NAME``
reruns, and names the step, the sequence, the row and the event. Run one implementation:
``pytest suites/serving --impl NAME``.
"""

from __future__ import annotations

import hashlib
import random
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import note, settings
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, precondition, rule,
                                 run_state_machine_as_test)

from pagedbench.adapters import Adapter
from pagedbench.harness.run.loop import Scheduler
from pagedbench.harness.verdict.serving import (Admit, Finish, Fork, LoopEventError, LoopSpec,
                                                Preempt, Readmit, Step, SwapIn, SwapOut,
                                                read_trace)
from pagedbench.harness.verdict.serving_judge import InMemoryLoop, describe_failure, save_failure
from pagedbench.harness.verdict.status import Status
from pagedbench.reference.axes import FP8_SCALES
from pagedbench.reference.serving import VOCAB

from pagedbench.suites import plugin

from ..conformance.cases import pinned_case
from .conftest import DEVICE, loop_budget

#: Batch sizes a loop in graph mode pads its decode-only batches to (an engine captures a
#: graph per size and pads a batch to the next one: vLLM's cudagraph_capture_sizes).
CAPTURED_SIZES = (2, 4, 8)
#: fp8 scales of an fp8 loop (``FP8_SCALES``' first pair: unequal, neither 1 nor each
#: other's reciprocal, so a path that drops one, swaps them or applies one twice shows).
LOOP_SCALES = dict(zip(("k_scale", "v_scale"), FP8_SCALES[0]))


def loop_specs(adapter: Adapter) -> list[LoopSpec]:
    """The loops ``adapter`` is driven through: its smallest pinned shape in its first
    dtype, and again with an fp8 cache when it declares one."""
    case = pinned_case(adapter, lambda bs: (1,), 4, 2, "loop")
    caps = adapter.capabilities(DEVICE)
    interpreted = adapter.is_interpreted(DEVICE)
    cases = [case]
    fp8 = sorted(caps.kv_cache_dtypes - {"auto"})
    if fp8:
        scales = dict(LOOP_SCALES, v_scale=LOOP_SCALES["k_scale"]) if case.latent_cache \
            else LOOP_SCALES
        cases.append(case.with_(kv_cache_dtype=fp8[0], **scales))
    tokens = max(5 * case.block_size, 48)
    per_sequence = -(-tokens // case.block_size)
    # A pool of two longest sequences and a few blocks more: freed blocks come back soon.
    return [LoopSpec(case=c.to_dict(), num_blocks=2 * per_sequence + 3,
                     max_batch=4 if interpreted else 6, max_tokens=tokens,
                     num_host_blocks=2 * per_sequence) for c in cases]


def machine_for(adapter: Adapter, spec: LoopSpec, impl: str, traces: Path,
                graphs: bool) -> type[RuleBasedStateMachine]:
    """A state machine driving ``adapter`` through loops of ``spec``, its decode batches
    padded to a captured graph's size (:data:`CAPTURED_SIZES`) with empty rows when
    ``graphs``; its class counts what every loop it ran exercised (``reached``)."""
    capabilities = adapter.capabilities(DEVICE)
    block_size = spec.template().block_size
    prefill_mode = "prefill" in capabilities.modes
    shares = capabilities.shared_blocks

    class ServingLoop(RuleBasedStateMachine):
        reached: Counter = Counter()

        def __init__(self) -> None:
            super().__init__()
            self.loop = InMemoryLoop(adapter, spec, DEVICE)
            self.model = self.loop.judge.model
            self.next_seq = 0
            self.prompts: list[list[int]] = []
            self.preempted: list[int] = []
            self.swapped: list[int] = []
            self.decode_tokens = 1

        # What the pool and the batch allow ---------------------------------------
        def on_device(self) -> int:
            return len(self.model.decoding()) + len(self.model.prefilling())

        def free(self) -> int:
            return self.model.allocator.num_free_blocks

        def growing(self) -> list[int]:
            return [s for s in self.model.decoding()
                    if len(self.model.requests[s].tokens) < spec.max_tokens]

        def apply(self, event) -> None:
            note(event.model_dump_json())
            try:
                verdict = self.loop.event(event)
            except LoopEventError as exc:  # a rule asked for what the pool cannot hold
                raise AssertionError(f"the state machine made an event the reference "
                                     f"refuses: {exc}") from exc
            if verdict is not None and verdict.status in (Status.FAIL, Status.ERROR):
                raise _failed(self.loop, verdict, impl, traces)

        # Rules ------------------------------------------------------------------------
        @precondition(lambda self: self.on_device() < spec.max_batch)
        @rule(data=st.data())
        def admit(self, data) -> None:
            most = spec.max_tokens // 2
            boundaries = [n for n in (block_size, 2 * block_size, block_size + 1,
                                      2 * block_size - 1) if 0 < n <= most]
            length = data.draw(st.one_of(st.sampled_from(boundaries or [most]),
                                         st.integers(1, most)), label="prompt length")
            tokens = random.Random(data.draw(st.integers(0, 2**16), label="prompt seed"))
            prompt = [tokens.randrange(VOCAB) for _ in range(length)]
            if shares and self.prompts and data.draw(st.booleans(), label="shared prefix"):
                source = data.draw(st.sampled_from(self.prompts), label="prefix of")
                blocks = data.draw(st.integers(1, max(1, len(source) // block_size)))
                prompt = (source[: blocks * block_size] + prompt)[: spec.max_tokens]
            if self.model.allocator.blocks_needed_for_prompt(prompt) > self.free():
                return
            self.next_seq += 1
            self.prompts.append(prompt)
            self.apply(Admit(seq=self.next_seq, prompt=prompt))

        @precondition(lambda self: self.model.prefilling())
        @rule(data=st.data())
        def prefill(self, data) -> None:
            rows = []
            for seq in self.model.prefilling():
                pending = self.model.pending_prompt(seq)
                rows.append((seq, data.draw(st.one_of(st.just(pending), st.integers(1, pending)),
                                            label=f"chunk of {seq}")))
            decodes = [(seq, 1) for seq in self.growing()]
            if prefill_mode and decodes and data.draw(st.booleans(), label="mixed") and \
                    sum(self.model.allocator.blocks_needed(*row) for row in decodes) <= \
                    self.free():
                rows += decodes
            self.apply(Step(rows=rows[: spec.max_batch]))

        @initialize(tokens=st.sampled_from((1, 2, 4)))
        def decode_width(self, tokens: int) -> None:
            """How many query tokens each decode row of this loop has (1, or a
            speculative step's drafts plus one)."""
            self.decode_tokens = tokens if prefill_mode else 1

        @precondition(lambda self: self.growing())
        @rule(data=st.data())
        def decode(self, data) -> None:
            seqs = self.growing()[: spec.max_batch]  # an engine decodes every running one
            if data.draw(st.booleans(), label="a subset decodes"):
                seqs = data.draw(st.lists(st.sampled_from(seqs), min_size=1, unique=True),
                                 label="decoding")
            rows = [(seq, min(self.decode_tokens,
                              spec.max_tokens - len(self.model.requests[seq].tokens)))
                    for seq in seqs]
            if sum(self.model.allocator.blocks_needed(s, n) for s, n in rows) > self.free():
                return
            size = next((n for n in CAPTURED_SIZES if n >= len(rows)), len(rows))
            pad = min(size, spec.max_batch) - len(rows) if graphs else 0
            self.apply(Step(rows=rows, pad=pad))

        @precondition(lambda self: shares and self.model.decoding()
                      and self.on_device() < spec.max_batch)
        @rule(data=st.data())
        def fork(self, data) -> None:
            parent = data.draw(st.sampled_from(self.model.decoding()), label="parent")
            self.next_seq += 1
            self.apply(Fork(parent=parent, child=self.next_seq))

        @precondition(lambda self: self.model.decoding())
        @rule(data=st.data())
        def finish(self, data) -> None:
            self.apply(Finish(seq=data.draw(st.sampled_from(self.model.decoding()))))

        @precondition(lambda self: self.model.decoding())
        @rule(data=st.data())
        def preempt(self, data) -> None:
            seq = data.draw(st.sampled_from(self.model.decoding()))
            self.preempted.append(seq)
            self.apply(Preempt(seq=seq))

        @precondition(lambda self: self.preempted and self.on_device() < spec.max_batch)
        @rule()
        def readmit(self) -> None:
            seq = self.preempted[0]
            if self.model.allocator.blocks_needed_for_prompt(
                    self.model.requests[seq].tokens) <= self.free():
                self.preempted.pop(0)
                self.apply(Readmit(seq=seq))

        @precondition(lambda self: self.model.decoding())
        @rule(data=st.data())
        def swap_out(self, data) -> None:
            seq = data.draw(st.sampled_from(self.model.decoding()))
            usage = self.model.allocator.usage()
            room = self.model.num_host_blocks - usage.host_blocks_used
            if len(self.model.allocator.block_table(seq)) <= room:
                self.swapped.append(seq)
                self.apply(SwapOut(seq=seq))

        @precondition(lambda self: self.swapped and self.on_device() < spec.max_batch)
        @rule()
        def swap_in(self) -> None:
            seq = self.swapped[0]
            if -(-len(self.model.requests[seq].tokens) // block_size) <= self.free():
                self.swapped.pop(0)
                self.apply(SwapIn(seq=seq))

        def teardown(self) -> None:
            type(self).reached.update(self.loop.judge.coverage)
            self.loop.close()

    return ServingLoop


#: The scheduler's seed (``pagedbench loop --seed 1``): its 40 steps meet every event kind
#: on the catalogue's control (seed 0's swap none out), as test_serving_coverage.py checks.
SCHEDULER_SEED = 1


def _failed(loop: InMemoryLoop, verdict, impl: str, traces: Path) -> AssertionError:
    """The failure of ``loop``'s last event: its trace saved, its replay command named."""
    digest = hashlib.sha256(str(loop.judge.events).encode()).hexdigest()[:8]
    path = save_failure(traces / f"{impl}-{digest}.jsonl", loop.judge)
    return AssertionError(f"{impl}: {describe_failure(verdict, loop.judge)}; "
                          f"replay: pagedbench replay {path} --impl {impl}")


def scheduled_loop(adapter: Adapter, spec: LoopSpec, impl: str, traces: Path,
                   steps: int) -> Counter:
    """One loop of ``steps`` forward steps whose events ``pagedbench loop``'s scheduler
    draws from :data:`SCHEDULER_SEED`; what it exercised. Raises AssertionError at the
    first step that fails."""
    loop = InMemoryLoop(adapter, spec, DEVICE)
    scheduler = Scheduler(spec, steps, seed=SCHEDULER_SEED)
    try:
        while (event := scheduler.next_event(loop.judge)) is not None:
            verdict = loop.event(event)
            if verdict is not None and verdict.status in (Status.FAIL, Status.ERROR):
                raise _failed(loop, verdict, impl, traces)
        return Counter(loop.judge.coverage)
    finally:
        loop.close()


def run_loops(adapter: Adapter, spec: LoopSpec, impl: str, traces: Path,
              examples: int, steps: int) -> Counter:
    """The :func:`scheduled_loop` of ``steps`` steps, then ``examples`` state-machine loops
    of at most ``steps`` events, half of them with graph-padded decode batches where
    ``adapter`` takes empty rows; what they all exercised."""
    reached = scheduled_loop(adapter, spec, impl, traces, steps)
    pads = "empty_kv" in adapter.capabilities(DEVICE).features
    halves = ((False, examples - examples // 2), (True, examples // 2)) if pads else (
        (False, examples),)
    for graphs, loops in (half for half in halves if half[1]):
        machine = machine_for(adapter, spec, impl, traces, graphs)
        run_state_machine_as_test(machine, settings=settings(
            settings(), max_examples=loops, stateful_step_count=steps))
        reached += machine.reached
    return reached


def test_serving_loop_matches_dense(adapter, impl, pytestconfig) -> None:
    examples, steps = loop_budget(adapter)
    traces = plugin.cache_dir(pytestconfig, pytestconfig.getoption(
        "--pagedbench-cache-dir")) / "serving-traces"
    for spec in loop_specs(adapter):
        reached = run_loops(adapter, spec, impl, traces, examples, steps)
        assert reached["step"], f"{impl}: no loop of {spec.template().case_id} took a step"


#: Lifecycles that the scheduler and the state machine meet too rarely, each pinned as a
#: trace (the format ``pagedbench loop`` writes) and replayed on every implementation in
#: each of its loop shapes (the events alone: they name sequences and tokens, not shapes).
#: ``freed-block-same-row``: a sequence within one partly filled block finishes, and the
#: next request, longer, takes that block first (the free list's most recent) in the same
#: batch row; state kept per row and guarded by the block table then reads the old
#: sequence's K/V as the new one's prefix.
PINNED_TRACES = sorted((Path(__file__).parent / "traces").glob("*.jsonl"))


@pytest.mark.parametrize("trace", PINNED_TRACES, ids=lambda path: path.stem)
def test_pinned_lifecycles_match_dense(adapter, impl, trace, pytestconfig) -> None:
    traces = plugin.cache_dir(pytestconfig, pytestconfig.getoption(
        "--pagedbench-cache-dir")) / "serving-traces"
    _, events = read_trace(trace)
    passed = 0
    for spec in loop_specs(adapter):
        loop = InMemoryLoop(adapter, spec, DEVICE)
        try:
            for event in events:
                verdict = loop.event(event)
                if verdict is not None and verdict.status in (Status.FAIL, Status.ERROR):
                    raise _failed(loop, verdict, impl, traces)
                passed += verdict is not None and verdict.status is Status.PASS
        finally:
            loop.close()
    assert passed, f"{impl}: no step of {trace.name} passed in any of its loop shapes"
