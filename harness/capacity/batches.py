"""``pagedbench simulate --emit-batches FILE``: the kernel batch of every decode step of a
simulated trace, written as a batch trace (:mod:`pagedbench.harness.cases.batch_trace`)
that ``pagedbench bench --trace FILE`` replays.

The trace is replayed paged at one block size (``Paged``, or ``Paged+share`` when a
request shares a prefix or has several samples, as ``pagedbench simulate`` and ``tune``
choose) by :func:`~pagedbench.reference.simulator.simulate`; after each step's decode its
running requests are the batch: every sample one sequence, decoding one token over its
``prompt_len + generated`` tokens (``q_lens`` all 1: a prompt enters the cache whole in
its admission step, which is not a decode). Each line carries the preset's shapes.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from pagedbench.reference.kv_policies import LiveRequest, Policy
from pagedbench.reference.simulator import simulate
from pagedbench.reference.workload import Request, shares

from pagedbench.harness.cases.batch_trace import TraceStep
from pagedbench.harness.cases.presets import ModelPreset
from pagedbench.harness.results.store import write_output


def decode_steps(trace: Sequence[Request], block_size: int, kv_budget_tokens: int,
                 max_context: int, preset: ModelPreset, seed: int = 0) -> list[TraceStep]:
    """Every decode step's batch of ``trace`` paged at ``block_size``, numbered from 0,
    with ``preset``'s heads.

    Raises
    ------
    TraceError, CapacityError, PagedValueError
        As :func:`~pagedbench.reference.simulator.simulate`.
    """
    policy = Policy("Paged+share" if shares(trace) else "Paged", block_size)
    shapes = {"num_q_heads": preset.num_q_heads, "num_kv_heads": preset.num_kv_heads,
              "head_dim": preset.head_dim, "head_dim_v": preset.head_dim_v}
    steps: list[TraceStep] = []

    def on_decode(running: Sequence[LiveRequest]) -> None:
        kv_lens = [live.request.prompt_len + live.generated
                   for live in running for _ in range(live.request.n)]
        steps.append(TraceStep(step=len(steps), kv_lens=kv_lens, **shapes))

    simulate(trace, policy, kv_budget_tokens, max_context, seed, on_decode=on_decode)
    return steps


def write_steps(path: Path, steps: Sequence[TraceStep]) -> None:
    """Write ``steps`` to ``path``, one JSON line each (unset fields left out), atomically
    (:func:`~pagedbench.harness.results.store.write_output`)."""
    write_output(path, "".join(step.model_dump_json(exclude_none=True) + "\n"
                               for step in steps))


__all__ = ["decode_steps", "write_steps"]
