"""The parent's side of a worker's ``list`` job (``pagedbench list``, the self-test's and
the GPU lane's listings): what each implementation says about itself, asked in one worker
that is replaced when it dies or hangs. Imports no torch: the worker does."""

from __future__ import annotations

from pathlib import Path

from pagedbench.adapters import Entry

from pagedbench.harness.results.record import ListingRow
from pagedbench.harness.run.config import LIST_TIMEOUT_S
from pagedbench.harness.run.environment import worker_environment
from pagedbench.harness.run.protocol import Answer, Supervisor
from pagedbench.harness.verdict.messages import IMPL, JOB_STEPS, Data, Message


def list_adapters(found: list[Entry], device: str, cache_dir: Path,
                  timeout_s: float = LIST_TIMEOUT_S) -> list[ListingRow]:
    """What each implementation of ``found`` says about itself on ``device``, one row each
    in ``found``'s order: one that crashes or hangs at import (past ``timeout_s``) gets a
    ``crash`` or ``timeout`` row, one whose worker sends anything but a valid listing an
    ``error`` row, and a fresh worker lists the rest."""
    env = worker_environment(device, cache_dir)
    job = {"kind": "list", "device": device, "entries": [(e.name, e.target) for e in found]}
    rows: list[ListingRow] = []

    def on_message(message: Message) -> Answer:
        try:
            if not isinstance(message, Data):
                raise ValueError(f"a {message.kind!r} message in a list job")
            rows.append(ListingRow.model_validate(message.data))
        except ValueError as exc:  # pydantic's ValidationError is one
            entry = found[len(rows)]
            rows.append(ListingRow.error(entry.name, entry.target, "error",
                                         f"the worker sent an invalid listing ({exc})"))
        return Answer(item_done=True)

    while len(rows) < len(found):
        supervisor = Supervisor(job | {"start": len(rows)}, env, {IMPL: timeout_s},
                                JOB_STEPS["list"])
        fault = supervisor.run(on_message)
        if fault is None:
            break
        index = len(rows) if fault.item is None else fault.item
        if index < len(found):
            entry = found[index]
            what = fault.detail if fault.kind == "timeout" else f"worker {fault.detail}"
            status = {"timeout": "timeout", "crash": "crash"}.get(fault.kind, "error")
            rows.append(ListingRow.error(entry.name, entry.target, status,
                                         f"{fault.step}: {what}"))
    return rows


__all__ = ["list_adapters"]
