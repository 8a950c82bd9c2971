"""Processes as Linux shows them in ``/proc``: a process's live descendants, its CPU time,
and killing a set of them. Where ``/proc`` is missing, a process has no descendants and no
CPU time (the checks built on them then pass)."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterable
from pathlib import Path


def process_cpu_seconds(pid: int | None) -> float:
    """CPU seconds (user + system, all its threads) process ``pid`` has used, from
    ``/proc/<pid>/stat`` (Linux; 0.0 where it cannot be read, so a check built on it
    passes there)."""
    if pid is None:
        return 0.0
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


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


__all__ = ["descendants", "kill_all", "process_cpu_seconds"]
