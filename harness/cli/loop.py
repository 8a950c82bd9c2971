"""``pagedbench loop``: a serving loop on one implementation (``harness/run/loop.py``), and
``pagedbench replay TRACE`` of a loop's saved trace. Its options: :mod:`.loop_options`."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

from pydantic import BaseModel

from rich.console import Console
from rich.markup import escape

from pagedbench.reference import PagedCase, PagedValueError
from pagedbench.reference.axes import FP8_SCALES

from pagedbench.harness.cases.presets import MODEL_PRESETS
from pagedbench.harness.cli.loop_options import DEFAULT_HEAD_DIM, DEFAULT_HEADS
from pagedbench.harness.cli.options import checked_device, select_impls
from pagedbench.harness.run.config import RunConfig
from pagedbench.harness.run.loop import LoopOutcome, Scheduler, run_loop
from pagedbench.harness.verdict.serving import TRANSITIONS, LoopEventError, LoopSpec, read_trace
from pagedbench.harness.verdict.serving_judge import (LoopJudge, StepVerdict, describe_failure,
                                                      save_failure)
from pagedbench.harness.verdict.status import ExitCode, Status

#: Where a failing loop's trace is kept (under the cache folder).
TRACES = "loop-traces"


def loop_spec(args: argparse.Namespace) -> LoopSpec:
    """The spec of ``args``' case axes.

    Raises
    ------
    PagedValueError
        Naming the option when the axes do not make a case.
    """
    if args.preset:
        preset = MODEL_PRESETS[args.preset]
        shape = dict(num_q_heads=preset.num_q_heads, num_kv_heads=preset.num_kv_heads,
                     head_dim=preset.head_dim, head_dim_v=preset.head_dim_v,
                     latent_cache=preset.latent_cache, name=preset.name)
    else:
        shape = dict(num_q_heads=DEFAULT_HEADS[0], num_kv_heads=DEFAULT_HEADS[1],
                     head_dim=DEFAULT_HEAD_DIM, name="loop")
    scales = {} if args.kv_cache_dtype == "auto" else dict(zip(("k_scale", "v_scale"),
                                                               FP8_SCALES[0]))
    if scales and shape.get("latent_cache"):
        scales["v_scale"] = scales["k_scale"]
    case = PagedCase(kv_lens=(1,), block_size=args.block_size, dtype=args.dtype,
                     kv_cache_dtype=args.kv_cache_dtype, seed=args.seed, **shape, **scales)
    return LoopSpec(case=case.to_dict(), num_blocks=args.num_blocks, max_batch=args.max_batch,
                    max_tokens=args.max_tokens)


def _line(verdict: StepVerdict, event: BaseModel) -> str:
    """One tick as the loop prints it (rich markup): its index, verdict and event (a
    step's rows, or the lifecycle event's name)."""
    colour = verdict.status.colour
    rows = ", ".join(f"{s}:{n}" for s, n in event.rows) if event.op == "step" else event.op
    pad = f" +{event.pad} empty" if getattr(event, "pad", 0) else ""
    text = f"tick {verdict.index:>4} [{colour}]{verdict.status:<11}[/] {escape(rows)}{pad}"
    if verdict.status is not Status.PASS and verdict.reason:
        text += f": {escape(verdict.reason[:300])}"
    return text


def _summary(name: str, outcome: LoopOutcome, console: Console, trace_dir: Path) -> int:
    judge = outcome.judge
    counts = {status: sum(v.status is status for v in outcome.verdicts) for status in Status}
    shown = ", ".join(f"{n} {s}" for s, n in counts.items() if n)
    console.print(f"{name}: {len(outcome.verdicts)} ticks ({shown or 'none'}), "
                  f"{judge.coverage['step']} steps")
    console.print("exercised: " + ", ".join(f"{k} {judge.coverage[k]}" for k in
                                             ("admit", "fork", "finish", "preempt", "swap-out",
                                              *TRANSITIONS)))
    failed = next((v for v in outcome.verdicts if v.status in (Status.FAIL, Status.ERROR)), None)
    if failed is not None or outcome.status in (Status.CRASH, Status.TIMEOUT, Status.ERROR):
        path = save_failure(trace_dir / f"{name}-{judge.spec.template().seed}.jsonl", judge)
        if failed is not None:
            console.print(f"[red]{escape(describe_failure(failed, judge))}[/]")
        if outcome.stopped:
            console.print(f"[red]stopped: {escape(outcome.stopped)}[/]")
        console.print(f"trace: {path}\nreplay: pagedbench replay {path} --impl {name}")
        return int(ExitCode.CONFORMANCE_FAILURE)
    if outcome.status is Status.UNAVAILABLE:
        console.print(f"[yellow]{name} unavailable: {escape(outcome.stopped)}[/]")
        return int(ExitCode.NOTHING_RAN)
    if not counts[Status.PASS] or not judge.coverage["step"] or \
            all(v.status is Status.UNSUPPORTED for v in outcome.verdicts if v.seqs):
        console.print("[red]nothing ran: no step of the loop was judged[/]")
        return int(ExitCode.NOTHING_RAN)
    return int(ExitCode.CLEAN)


def cmd_loop(args: argparse.Namespace) -> int:
    (name, target), = select_impls([args.impl]).items()
    device = checked_device(args.device or "cpu")
    config = RunConfig(device=device, timing=False, cache_dir=args.cache_dir,
                       case_timeout_s=args.case_timeout or RunConfig.case_timeout_s,
                       suite="loop")
    console = Console(highlight=False, soft_wrap=True)
    if args.trace is not None:
        return replay_trace(args.trace, name, target, config, console)
    spec = loop_spec(args)
    scheduler = Scheduler(spec, args.steps, args.seed)
    return _run(name, target, spec, config, scheduler.next_event, console, args.cache_dir)


def _run(name: str, target: str, spec: LoopSpec, config: RunConfig,
         next_event: Callable[[LoopJudge], BaseModel | None], console: Console,
         cache_dir: Path) -> int:
    """Run the loop, print each step, a summary and what failed; the exit code."""
    console.print(f"pagedbench loop: {name} on {config.device}, {spec.template().case_id}, "
                  f"{spec.num_blocks} blocks, batches up to {spec.max_batch}, sequences up to "
                  f"{spec.max_tokens} tokens")

    def on_verdict(verdict: StepVerdict, judge: LoopJudge) -> None:
        console.print(_line(verdict, judge.events[verdict.event]))

    outcome = run_loop(name, target, spec, config, next_event, on_verdict)
    return _summary(name, outcome, console, cache_dir / TRACES)


def is_trace(path: Path) -> bool:
    """Whether ``path`` holds a loop trace (its first line a loop spec)."""
    try:
        with open(path) as f:
            first = json.loads(f.readline() or "null")
    except (OSError, ValueError):
        return False
    return isinstance(first, dict) and first.get("kind") == "loop"


def replay_trace(path: Path, name: str, target: str, config: RunConfig,
                 console: Console) -> int:
    """Rerun the loop of the trace at ``path`` on ``name``; the exit code.

    Raises
    ------
    PagedValueError
        Naming the trace when it is not one (with the line at fault).
    """
    try:
        spec, events = read_trace(path)
    except (LoopEventError, OSError) as exc:
        why = f"{path}: cannot read it ({exc.strerror})" if isinstance(exc, OSError) else str(exc)
        raise PagedValueError("TRACE", str(path), "a loop trace (its spec, then one event "
                              "per line)", why) from None
    remaining = iter(events)
    return _run(name, target, spec, config, lambda judge: next(remaining, None), console,
                config.cache_dir)


__all__ = ["cmd_loop", "is_trace", "loop_spec", "replay_trace"]
