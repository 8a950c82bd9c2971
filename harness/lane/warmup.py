"""The GPU lane's compile warm-up: every implementation's kernels compiled (or loaded from
their caches) before anything is judged or timed, each implementation in its own process,
all at once, within one budget.

    python -m pagedbench.harness.lane.warmup --device cuda --cases FILE --out FILE
        --budget-s S [--impl NAME=TARGET ...]

Triton compiles each kernel specialization at its first launch (into ``TRITON_CACHE_DIR``),
TorchInductor each FlexAttention shape (``TORCHINDUCTOR_CACHE_DIR``), FlashInfer each
module it has no ahead-of-time build of (``FLASHINFER_WORKSPACE_BASE``); those caches are
on disk under the cache folder, so the workers of the later steps load what the warm-up
compiled instead of spending their per-case budget on it (a killed worker loses a compile
in flight). Each implementation's process (:func:`warm`), confined as a worker is
(``harness/run/confine.py``), imports the adapter, asks ``available``, then prepares and
runs every case of ``--cases`` it supports, unjudged; it prints one JSON line
(:func:`warm`'s record) last and kills every process the implementation left, its output
going to ``warmup-<name>.log`` beside ``--out``. The parent (:func:`warm_all`) runs them
side by side (the compilers are single-threaded per kernel; the GPU work is tiny), stops
those past the budget (SIGINT, then SIGKILL), and writes every record, the stopped ones
``"status": "out of budget"``, to ``--out`` as JSON lines as they finish.

:func:`miniature` makes each point of the sweep small without changing what the
compilers specialize on: the same heads, dtype, block size and batch, the first sequence
at the point's context, the others short.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from pagedbench.reference import PagedCase

from pagedbench.harness.lane import BUILD, ROOT
from pagedbench.harness.run.confine import confine
from pagedbench.harness.run.environment import worker_environment
from pagedbench.harness.run.processes import kill_descendants

#: Keys of each sequence but the first in a :func:`miniature`.
SHORT_KV_LEN = 64
#: Largest KV pool of a :func:`miniature` (bytes): past it, fewer sequences.
MAX_MINIATURE_BYTES = 256 * 2**20
#: Seconds between SIGINT and SIGKILL for a process past the budget.
GRACE_S = 5


def pool_bytes(case: PagedCase) -> int:
    """Bytes of ``case``'s KV pool: every block of every sequence, K and V."""
    import torch

    elem = torch.empty((), dtype=case.kv_torch_dtype).element_size()
    return (sum(case.blocks_per_seq) * case.block_size * case.num_kv_heads
            * (case.head_dim + case.v_head_dim) * elem)


def miniature(case: PagedCase) -> PagedCase:
    """``case`` with every sequence after the first cut to :data:`SHORT_KV_LEN` keys: the
    kernels' specializations (block size, batch, dtypes, heads, the longest context) and
    little memory. Where its pool would still exceed :data:`MAX_MINIATURE_BYTES` (a
    contiguous block of thousands of tokens per sequence), fewer sequences: 16 for a batch
    Triton specializes as a multiple of 16, else 2, or the first alone."""
    kv_lens = (case.kv_lens[0], *(min(kv, SHORT_KV_LEN) for kv in case.kv_lens[1:]))
    small = case.with_(kv_lens=kv_lens)
    for batch in (16 if len(kv_lens) % 16 == 0 else 2, 1):
        if pool_bytes(small) <= MAX_MINIATURE_BYTES or len(small.kv_lens) <= batch:
            break
        small = case.with_(kv_lens=kv_lens[:batch])
    return small


def warm(name: str, target: str, device: str, cases: list[PagedCase]) -> dict[str, Any]:
    """Import ``target``, ask ``available(device)``, then ``prepare`` and ``run`` each of
    ``cases`` it supports (inputs drawn on ``device``). The record: ``impl``, ``status``
    (``ok``, ``unavailable`` or ``error``), ``reason``, ``cases`` (run), ``unsupported``,
    and ``seconds`` (the import and each case's)."""
    import torch

    from pagedbench.adapters import load
    from pagedbench.reference import materialize

    record: dict[str, Any] = {"impl": name, "status": "ok", "reason": "", "cases": 0,
                              "unsupported": 0, "seconds": {}}
    start = time.monotonic()
    try:
        adapter = load(target)
        availability = adapter.available(device)
    except Exception as exc:  # noqa: BLE001 (a peer's import can raise anything)
        return record | {"status": "error", "reason": f"import: {type(exc).__name__}: {exc}"}
    record["seconds"]["import"] = round(time.monotonic() - start, 2)
    if availability.ok is not True:
        return record | {"status": "unavailable", "reason": availability.reason}
    for case in cases:
        if adapter.why_unsupported(case, device):
            record["unsupported"] += 1
            continue
        start = time.monotonic()
        try:
            adapter.run(adapter.prepare(materialize(case, device)))
            if device.startswith("cuda"):
                torch.cuda.synchronize()
        except Exception as exc:  # noqa: BLE001 (the later steps judge and record it)
            return record | {"status": "error",
                             "reason": f"{case.case_id}: {type(exc).__name__}: {exc}"[:2000]}
        record["seconds"][case.case_id] = round(time.monotonic() - start, 2)
        record["cases"] += 1
    return record


def warm_all(impls: dict[str, str], device: str, cases_file: Path, out: Path,
             budget_s: float, parallel: int | None = None) -> list[dict[str, Any]]:
    """:func:`warm` each of ``impls`` (``{name: target}``) in its own process, at most
    ``parallel`` at once (default: all), within ``budget_s`` in all; append each record to
    ``out`` (JSON lines) as it arrives; returns them in ``impls``' order."""
    env = worker_environment(device, BUILD)
    pending = list(impls.items())
    running: dict[str, subprocess.Popen] = {}
    records: dict[str, dict[str, Any]] = {}
    deadline = time.monotonic() + budget_s
    parallel = parallel or len(pending) or 1

    def finish(name: str, record: dict[str, Any]) -> None:
        records[name] = record
        with out.open("a") as file:
            file.write(json.dumps(record) + "\n")

    while running or (pending and time.monotonic() < deadline):
        while pending and len(running) < parallel and time.monotonic() < deadline:
            name, target = pending.pop(0)
            with (out.parent / f"warmup-{name}.log").open("w") as log:
                running[name] = subprocess.Popen(
                    [sys.executable, "-m", "pagedbench.harness.lane.warmup", "--one", name,
                     "--target", target, "--device", device, "--cases", str(cases_file)],
                    cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                    start_new_session=True)
        for name, proc in list(running.items()):
            if proc.poll() is None and time.monotonic() < deadline:
                continue
            if proc.poll() is None:
                _stop(proc)
                finish(name, {"impl": name, "status": "out of budget",
                              "reason": f"stopped at the warm-up's {budget_s:g} s"})
            else:
                lines = (out.parent / f"warmup-{name}.log").read_text().strip().splitlines()
                try:
                    finish(name, json.loads(lines[-1]))
                except (IndexError, ValueError):
                    finish(name, {"impl": name, "status": "error",
                                  "reason": f"exit {proc.returncode} without a record "
                                            f"(warmup-{name}.log)"})
            del running[name]
        time.sleep(0.2)
    for name in impls:  # never started: the budget ran out first
        if name not in records:
            finish(name, {"impl": name, "status": "out of budget", "reason": "not started"})
    return [records[name] for name in impls]


def _stop(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGINT)
    try:
        proc.wait(timeout=GRACE_S)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pagedbench.harness.lane.warmup",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--cases", type=Path, required=True,
                        help="JSON list of cases (PagedCase.to_dict())")
    parser.add_argument("--out", type=Path, help="JSON lines, one record per implementation")
    parser.add_argument("--budget-s", type=float, default=90.0)
    parser.add_argument("--impl", action="append", default=[], metavar="NAME=TARGET")
    parser.add_argument("--one", metavar="NAME", help="warm this one (a child process)")
    parser.add_argument("--target", help="with --one: its module:Class")
    args = parser.parse_args(argv)
    cases = [PagedCase.from_dict(c) for c in json.loads(args.cases.read_text())]
    if args.one:  # confined as a worker is, and no process it leaves outlives it
        confine()
        print(json.dumps(warm(args.one, args.target, args.device, cases)), flush=True)
        kill_descendants(os.getpid())
        return 0
    impls = dict(item.split("=", 1) for item in args.impl)
    records = warm_all(impls, args.device, args.cases, args.out, args.budget_s)
    for record in records:
        print(f"{record['impl']:<28} {record['status']:<14} {record.get('reason', '')[:100]}")
    return 0 if all(r["status"] in ("ok", "unavailable") for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
