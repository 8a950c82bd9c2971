"""Processes as Linux shows them in ``/proc``: a process's live descendants, the CPU time of
it and its descendants, and killing a set of them. Where ``/proc`` is missing, a process
has no descendants and no CPU time (the checks built on them then pass)."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterable
from pathlib import Path


def tree_cpu_seconds(pid: int | None) -> dict[tuple[int, int], float]:
    """CPU seconds (user + system, all threads) used by process ``pid`` and by each of its
    descendants (a zombie included): each one's own and what its children it has waited
    for used (``/proc/<pid>/stat`` fields 14-17), keyed by ``(pid, start time in clock
    ticks)`` so that a reused pid is another process. Linux; empty where ``/proc`` cannot
    be read, so a check built on it passes there."""
    if pid is None:
        return {}
    children: dict[int, list[int]] = {}
    used: dict[int, tuple[int, int]] = {}
    for proc in Path("/proc").iterdir() if Path("/proc").is_dir() else ():
        if not proc.name.isdigit():
            continue
        try:
            fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        used[int(proc.name)] = (int(fields[19]), sum(int(t) for t in fields[11:15]))
        children.setdefault(int(fields[1]), []).append(int(proc.name))
    tick = os.sysconf("SC_CLK_TCK")
    found, todo = {}, [pid] if pid in used else []
    while todo:
        here = todo.pop()
        started, ticks = used[here]
        found[(here, started)] = ticks / tick
        todo.extend(child for child in children.get(here, ()) if child in used)
    return found


def descendants(pid: int) -> list[int]:
    """Live (not zombie) descendants of ``pid``, from ``/proc`` (Linux; empty elsewhere)."""
    children: dict[int, list[int]] = {}
    for proc in Path("/proc").iterdir() if Path("/proc").is_dir() else ():
        if not proc.name.isdigit():
            continue
        try:
            state, ppid = (proc / "stat").read_text().rsplit(")", 1)[1].split()[:2]
        except (OSError, ValueError):
            continue
        if state != "Z":
            children.setdefault(int(ppid), []).append(int(proc.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), ()):
            found.append(child)
            todo.append(child)
    return found


def kill_all(pids: Iterable[int]) -> None:
    """SIGKILL each of ``pids`` (gone or not ours: skipped)."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


__all__ = ["descendants", "kill_all", "tree_cpu_seconds"]
