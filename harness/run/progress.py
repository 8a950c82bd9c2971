"""Progress of ``pagedbench run`` and ``bench`` over their (implementation, case) pairs,
and each result's wall time (JUnit's ``time=``).

On a terminal: one rich bar whose count, elapsed time and ETA come first and whose
last column, the next pair's name, is cut with an ellipsis to what the width leaves
(so at 80 columns the name never pushes the count or the ETA off the line). Elsewhere
(CI logs, a pipe), where a live bar would print only its final state: one line per
result, ``[done/total eta H:MM:SS]`` before it. The runner runs one implementation's
cases one after another in its worker, so the time between two results is the second
one's wall time (the first case of an implementation also carries its worker's start).
"""

from __future__ import annotations

import datetime
import time

from rich.console import Console
from rich.markup import escape
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                           TimeElapsedColumn, TimeRemainingColumn)
from rich.table import Column

from pagedbench.harness.results.record import ResultRecord


class RunProgress:
    """Context manager showing the progress of ``order``, the (implementation, case id)
    pairs in the order the runner takes them, under ``label`` (``run``, ``bench``).

    Attributes
    ----------
    seconds : dict[tuple[str, str], float]
        Wall time of each result received, by (implementation, case id), in seconds.
    """

    def __init__(self, console: Console, label: str, order: list[tuple[str, str]]) -> None:
        self.console, self.label, self.order = console, label, order
        self.seconds: dict[tuple[str, str], float] = {}
        self._bar: Progress | None = None
        self._start = self._last = time.monotonic()

    def __enter__(self) -> RunProgress:
        self._start = self._last = time.monotonic()
        if self.console.is_terminal:
            self._bar = Progress(
                TextColumn(self.label), BarColumn(bar_width=20), MofNCompleteColumn(),
                TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(),
                TextColumn("{task.description}", table_column=Column(
                    ratio=1, no_wrap=True, overflow="ellipsis")),
                console=self.console, transient=False, expand=True)
            self._bar.__enter__()
            self._task = self._bar.add_task(self._name(0), total=len(self.order))
        return self

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.__exit__(*exc)

    def _name(self, done: int) -> str:
        return escape(" ".join(self.order[done])) if done < len(self.order) else ""

    def update(self, record: ResultRecord, line: str | None) -> None:
        """One more result: time it, advance, and print ``line`` (rich markup; None
        prints nothing on a terminal, the result's status off one)."""
        now = time.monotonic()
        self.seconds[record.impl, record.case_id] = now - self._last
        self._last = now
        done = len(self.seconds)
        if self._bar is not None:
            if line is not None:
                self._bar.console.print(line)
            self._bar.update(self._task, advance=1, description=self._name(done))
            return
        left = len(self.order) - done
        eta = datetime.timedelta(seconds=round((now - self._start) / done * left))
        text = line if line is not None else (f"{escape(record.impl)} "
                                              f"{escape(record.case_id)} {record.status}")
        self.console.print(escape(f"[{done}/{len(self.order)} eta {eta}] ") + text,
                           soft_wrap=True)  # one log line per result, never wrapped
