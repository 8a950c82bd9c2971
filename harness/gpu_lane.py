"""The GPU lane: one command that checks and times everything installed on a CUDA machine.

Usage::

    python -m pagedbench.harness.gpu_lane --out DIR [--device cuda|cpu]
        [--impl NAME ...] [--preset NAME ...] [--block-size N ...] [--tests PATH ...]

Four steps, each a child process with its own time budget, so that one hung or slow
step (a first-time JIT compile, a deadlocked kernel) cannot take the others down:

1. ``env``: ``DIR/env.json``: the selection, ``nvidia-smi`` (when present), torch, its
   CUDA build and the device, the versions of triton and every peer, the git commit and
   whether the tree was dirty (:func:`pagedbench.harness.store.environment`).
2. ``list``: ``DIR/list.json``: ``pagedbench list --json``, every implementation's
   availability on the device, with the reason when it cannot run.
3. ``run``: ``DIR/results/<run-id>.jsonl`` and ``.md``: ``pagedbench run --device D
   --results-dir DIR/results`` (conformance against the float64 truth, then timing), log
   in ``DIR/run.log``.
4. ``pytest``: ``DIR/junit.xml``: ``pytest <tests> -m "not bench" --junitxml``, log in
   ``DIR/pytest.log``.

``DIR/lane.json`` records the lane's command line and each step's command, exit status,
wall time and whether it ran out of budget. The lane exits 1 if any step failed or ran out of budget, else 0.

Budgets (s, :data:`BUDGETS_S`) add up to 7.5 minutes on CUDA, inside the 8 the lane is
given on one H200, and a deadline of :data:`TOTAL_BUDGET_S` caps the sum. A step past its
budget first gets SIGINT (pytest then still writes its junit file; the runner's result
lines are already on disk), then SIGKILL after :data:`GRACE_S`. With ``--device cpu`` the
lane runs a small selection (:data:`CPU_SELECTION`) for CI, in about a minute.

Caches stay inside the checkout: Triton, TorchInductor, FlashInfer's JIT and
``XDG_CACHE_HOME`` default to folders under ``build/``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .environment import cache_environment

ROOT = Path(__file__).resolve().parent.parent
BUILD = ROOT / "build"
DEVICES = ("cuda", "cpu")
#: Per-step budgets (s), by device.
BUDGETS_S = {
    "cuda": {"env": 30, "list": 45, "run": 240, "pytest": 135},
    "cpu": {"env": 30, "list": 45, "run": 90, "pytest": 90},
}
#: Hard cap on the whole lane (s), by device: each step's budget is cut to what is left.
TOTAL_BUDGET_S = {"cuda": 465, "cpu": 240}
#: Seconds between SIGINT and SIGKILL for a step past its budget.
GRACE_S = 10
#: Per-case limit passed to ``pagedbench run --case-timeout`` (s).
CASE_TIMEOUT_S = {"cuda": 60, "cpu": 60}
#: Set in every step's environment, so a test can tell it runs inside a lane (and not
#: start a lane of its own there).
IN_LANE_ENV = "PAGEDBENCH_IN_GPU_LANE"
#: ``nvidia-smi`` queries recorded in env.json.
NVIDIA_SMI_QUERY = "name,driver_version,memory.total,compute_cap,clocks.max.sm,power.limit"


@dataclass(frozen=True)
class Selection:
    """What the lane runs: implementations, presets and block sizes for ``pagedbench
    run`` (empty = the CLI's defaults, i.e. everything), and the pytest targets."""

    impls: tuple[str, ...] = ()
    presets: tuple[str, ...] = ()
    block_sizes: tuple[int, ...] = ()
    tests: tuple[str, ...] = ("suites",)


#: The CUDA lane: every implementation, every preset, the whole pytest suite.
CUDA_SELECTION = Selection()
#: The CPU rehearsal CI runs: one preset, one block size, the plain-torch baseline, and
#: one quick test module.
CPU_SELECTION = Selection(
    impls=("torch-gather",),
    presets=("llama3.1-70b-tp8",),
    block_sizes=(16,),
    tests=("suites/adapters/test_flash_attn_layout.py",),
)


@dataclass
class Step:
    """One step's outcome, as recorded in ``lane.json``."""

    name: str
    command: list[str]
    budget_s: float
    returncode: int | None = None
    wall_s: float = 0.0
    timed_out: bool = False
    log: str = ""
    stdout: str = ""
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out


def _child_env() -> dict[str, str]:
    """This process's environment, caches under ``build/`` unless already set
    (:func:`~pagedbench.harness.environment.cache_environment`), and :data:`IN_LANE_ENV`."""
    return {**os.environ, **cache_environment(BUILD), IN_LANE_ENV: "1"}


def run_step(step: Step, out: Path) -> Step:
    """Run ``step.command`` in its own process group from the checkout's root, output to
    ``out/<name>.log`` (stdout to ``out/<step.stdout>`` instead when that is set); past
    ``step.budget_s`` send the group SIGINT, then SIGKILL after :data:`GRACE_S`."""
    step.log = f"{step.name}.log"
    start = time.monotonic()
    with contextlib.ExitStack() as files:
        log = files.enter_context((out / step.log).open("w"))
        stdout = files.enter_context((out / step.stdout).open("w")) if step.stdout else log
        log.write(f"$ {shlex.join(step.command)}\n")
        log.flush()
        proc = subprocess.Popen(step.command, cwd=ROOT, env=_child_env(), stdout=stdout,
                                stderr=log, start_new_session=True)
        try:
            step.returncode = proc.wait(timeout=step.budget_s)
        except subprocess.TimeoutExpired:
            step.timed_out = True
            os.killpg(proc.pid, signal.SIGINT)
            try:
                step.returncode = proc.wait(timeout=GRACE_S)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                step.returncode = proc.wait()
    step.wall_s = round(time.monotonic() - start, 1)
    return step


def _nvidia_smi() -> dict[str, Any]:
    """``nvidia-smi`` output (plain and a CSV query), or why there is none."""
    out: dict[str, Any] = {}
    for key, args in (("summary", []),
                      ("query", [f"--query-gpu={NVIDIA_SMI_QUERY}", "--format=csv"])):
        try:
            done = subprocess.run(["nvidia-smi", *args], capture_output=True, text=True,
                                  timeout=30)
        except (OSError, subprocess.SubprocessError) as exc:
            return {"error": f"nvidia-smi not run: {exc}"}
        out[key] = done.stdout if done.returncode == 0 else f"exit {done.returncode}: {done.stderr}"
    return out


def environment_record(device: str, selection: Selection) -> dict[str, Any]:
    """What ``env.json`` holds: the lane's selection, the result-line
    environment of :func:`pagedbench.harness.store.environment`, torch's CUDA build,
    the number of visible GPUs, every peer's installed version, and ``nvidia-smi``."""
    import torch

    from pagedbench.adapters.cuda_probe import installed_distribution

    from .store import environment

    env = environment(device)
    peers = {}
    for module in ("torch", "triton", "flashinfer", "flash_attn", "flash_attn_3", "xformers",
                   "vllm", "hypothesis", "pytest", "numpy"):
        found = installed_distribution(module)
        peers[module] = None if found is None else {"distribution": found[0],
                                                    "version": found[1]}
    return {
        "selection": asdict(selection),
        "environment": env,
        "torch_cuda": torch.version.cuda,
        "cuda_device_count": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        "packages": peers,
        "nvidia_smi": _nvidia_smi(),
    }


def _flags(pairs: tuple[tuple[str, tuple], ...]) -> list[str]:
    return [arg for flag, values in pairs for value in values for arg in (flag, str(value))]


def _steps(device: str, selection: Selection, out: Path) -> list[Step]:
    """The four steps, in order, with their commands and full budgets."""
    python = sys.executable
    budgets = BUDGETS_S[device]
    run_flags = _flags((("--impl", selection.impls), ("--preset", selection.presets),
                        ("--block-size", selection.block_sizes)))
    lane_flags = run_flags + _flags((("--tests", selection.tests),))
    return [
        Step("env", [python, "-m", "pagedbench.harness.gpu_lane", "--env-only",
                     "--device", device, "--out", str(out), *lane_flags], budgets["env"]),
        Step("list", [python, "-m", "pagedbench.harness.cli", "list", "--json",
                      "--device", device], budgets["list"], stdout="list.json"),
        Step("run", [python, "-m", "pagedbench.harness.cli", "run", "--device", device,
                     "--results-dir", str(out / "results"),
                     "--case-timeout", str(CASE_TIMEOUT_S[device]), *run_flags],
             budgets["run"]),
        Step("pytest", [python, "-m", "pytest", *selection.tests, "-m", "not bench",
                        f"--junitxml={out / 'junit.xml'}", "-q",
                        *_flags((("--impl", selection.impls),))], budgets["pytest"]),
    ]


def run_lane(out: Path, device: str, selection: Selection, argv: list[str]) -> list[Step]:
    """Run the four steps into ``out`` (created if missing) and write ``lane.json``
    (``argv``, the lane's own command line, is recorded there).

    Raises
    ------
    ValueError
        If ``device`` is not one of :data:`DEVICES`.
    """
    if device not in DEVICES:
        raise ValueError(f"device must be one of {DEVICES}, got {device!r}")
    out.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + TOTAL_BUDGET_S[device]
    steps = _steps(device, selection, out)
    for step in steps:
        step.budget_s = round(min(step.budget_s, deadline - time.monotonic()), 1)
        if step.budget_s <= 0:
            step.notes.append("not run: the lane's total budget was spent")
            continue
        run_step(step, out)
    record = {"argv": argv, "device": device, "total_budget_s": TOTAL_BUDGET_S[device],
              "ok": all(s.ok for s in steps),
              "steps": [{**asdict(s), "ok": s.ok} for s in steps]}
    (out / "lane.json").write_text(json.dumps(record, indent=2) + "\n")
    return steps


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m pagedbench.harness.gpu_lane",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for everything written")
    parser.add_argument("--device", default="cuda", choices=DEVICES,
                        help="cuda (default): the full lane; cpu: the small CI rehearsal")
    parser.add_argument("--impl", action="append", default=[], metavar="NAME",
                        help="implementation (repeatable; default: the device's selection)")
    parser.add_argument("--preset", action="append", default=[], metavar="NAME",
                        help="model preset (repeatable; default: the device's selection)")
    parser.add_argument("--block-size", action="append", default=[], type=int, metavar="N",
                        help="block size (repeatable; default: the device's selection)")
    parser.add_argument("--tests", action="append", default=[], metavar="PATH",
                        help="pytest target (repeatable; default: the device's selection)")
    parser.add_argument("--env-only", action="store_true",
                        help="only write OUT/env.json (the lane's first step)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit status (0: every step passed within budget)."""
    argv = sys.argv[1:] if argv is None else argv
    args = _parser().parse_args(argv)
    base = CUDA_SELECTION if args.device == "cuda" else CPU_SELECTION
    selection = Selection(
        impls=tuple(args.impl) or base.impls,
        presets=tuple(args.preset) or base.presets,
        block_sizes=tuple(args.block_size) or base.block_sizes,
        tests=tuple(args.tests) or base.tests,
    )
    if args.env_only:
        args.out.mkdir(parents=True, exist_ok=True)
        record = environment_record(args.device, selection)
        (args.out / "env.json").write_text(json.dumps(record, indent=2) + "\n")
        return 0
    steps = run_lane(args.out, args.device, selection, argv)
    for step in steps:
        state = "ok" if step.ok else ("out of budget" if step.timed_out else
                                      f"exit {step.returncode}")
        print(f"{step.name:<7} {state:<14} {step.wall_s:7.1f} s  {step.log} {' '.join(step.notes)}")
    return 0 if all(step.ok for step in steps) else 1


if __name__ == "__main__":
    sys.exit(main())
