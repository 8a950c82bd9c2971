"""Processes as Linux shows them in ``/proc``: a process's live descendants, the CPU time of
it and its descendants, and killing a set of them. Where ``/proc`` is missing, a process
has no descendants and no CPU time (the checks built on them then pass)."""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path
from typing import NamedTuple


class _Stat(NamedTuple):
    """What this module reads of ``/proc/<pid>/stat`` (fields 3, 4, 14-17 and 22)."""

    state: str
    ppid: int
    ticks: int  # user + system CPU, its own and its waited-for children's, in clock ticks
    started: int  # clock ticks after boot


def _stats() -> dict[int, _Stat]:
    """Every process ``/proc`` shows (empty where it cannot be read)."""
    found = {}
    for proc in Path("/proc").iterdir() if Path("/proc").is_dir() else ():
        if not proc.name.isdigit():
            continue
        try:
            fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
            found[int(proc.name)] = _Stat(fields[0], int(fields[1]),
                                          sum(int(t) for t in fields[11:15]), int(fields[19]))
        except (OSError, IndexError, ValueError):
            continue
    return found


def _tree(stats: dict[int, _Stat], pid: int, *, zombies: bool) -> list[int]:
    """``pid`` (when listed) and its descendants in ``stats``; a zombie's only with
    ``zombies``."""
    children: dict[int, list[int]] = {}
    for child, stat in stats.items():
        if zombies or stat.state != "Z":
            children.setdefault(stat.ppid, []).append(child)
    found, todo = [], [pid] if pid in stats else []
    while todo:
        here = todo.pop()
        found.append(here)
        todo.extend(children.get(here, ()))
    return found


def tree_cpu_seconds(pid: int | None) -> dict[tuple[int, int], float]:
    """CPU seconds (user + system, all threads) used by process ``pid`` and by each of its
    descendants (a zombie included): each one's own and what its children it has waited
    for used, keyed by ``(pid, start time in clock ticks)`` so that a reused pid is another
    process. Linux; empty where ``/proc`` cannot be read, so a check built on it passes
    there."""
    if pid is None:
        return {}
    stats, tick = _stats(), os.sysconf("SC_CLK_TCK")
    return {(p, stats[p].started): stats[p].ticks / tick
            for p in _tree(stats, pid, zombies=True)}


def descendants(pid: int) -> list[int]:
    """Live (not zombie) descendants of ``pid``, from ``/proc`` (Linux; empty elsewhere)."""
    stats = _stats()
    if pid not in stats:  # gone: its children are reparented
        return []
    return _tree(stats, pid, zombies=False)[1:]


#: Rounds of :func:`kill_descendants` (each round kills those found; a process that forks
#: while it is killed leaves a child for the next round).
KILL_ROUNDS = 20


def kill_descendants(pid: int) -> None:
    """SIGKILL every live descendant of ``pid``, in rounds until none is found (at most
    :data:`KILL_ROUNDS`); gone or not ours: skipped. ``pid`` itself is left: its caller
    must not have reaped it, or the number may be another process's."""
    for _ in range(KILL_ROUNDS):
        found = descendants(pid)
        if not found:
            return
        for child in found:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(child, signal.SIGKILL)


__all__ = ["KILL_ROUNDS", "descendants", "kill_descendants", "tree_cpu_seconds"]
