"""Progress of ``pagedbench run`` and ``bench`` over their (implementation, case) pairs,
and each result's wall time (JUnit's ``time=``).

Lines are printed for what a reader acts on: each failure (``fail``, ``error``, ``crash``,
``timeout``, ``harness-error``) as it arrives, and one line per implementation once its
last pair is in: its verdict counts, or, when it was unavailable on every case, that
with the reason (once, not once per case). On a terminal they scroll above one rich bar
whose count, elapsed time and ETA come first and whose last column, the next pair's
name, is cut with an ellipsis to what the width leaves (so at 80 columns the name never
pushes the count or the ETA off the line). Elsewhere (CI logs, a pipe), where a live bar
would print only its final state, each line starts with ``[done/total eta H:MM:SS]``.
The runner runs one implementation's cases one after another in its worker, so the time
between two results is the second one's wall time (the first case of an implementation
also carries its worker's start).
"""

from __future__ import annotations

import datetime
import time
from collections import Counter
from collections.abc import Iterable

from rich.console import Console
from rich.markup import escape
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                           TimeElapsedColumn, TimeRemainingColumn)
from rich.table import Column

from pagedbench.harness.results import report
from pagedbench.harness.results.record import ResultRecord
from pagedbench.harness.verdict.status import Status


def result_line(record: ResultRecord) -> str:
    """One result as a line of rich markup: implementation, case id, its leaderboard cell
    and, but for a pass, its reason."""
    detail = report.cell_text(record)
    if record.status is not Status.PASS:
        detail += f": {record.reason}"
    return (f"[{record.status.colour}]{escape(record.impl)}[/] {escape(record.case_id)} "
            f"{escape(detail)}")


def implementation_line(impl: str, counts: Counter[Status], unavailable: str | None) -> str:
    """An implementation whose pairs are all in: ``NAME: unavailable: REASON`` when every
    one was unavailable, else ``NAME done: 24 pass, 12 unsupported`` (rich markup)."""
    if unavailable is not None:
        return f"[dim]{escape(impl)}: unavailable: {escape(unavailable)}[/]"
    told = ", ".join(f"[{s.colour}]{counts[s]} {s}[/]" for s in Status if counts[s])
    return f"{escape(impl)} done: {told}"


class RunProgress:
    """Context manager showing the progress of ``order``, the (implementation, case id)
    pairs in the order the runner takes them, under ``label`` (``run``, ``bench``); a
    resumed run's ``earlier`` results count in each implementation's line.

    Attributes
    ----------
    seconds : dict[tuple[str, str], float]
        Wall time of each result received, by (implementation, case id), in seconds.
    """

    def __init__(self, console: Console, label: str, order: list[tuple[str, str]],
                 earlier: Iterable[ResultRecord] = ()) -> None:
        self.console, self.label, self.order = console, label, order
        self.seconds: dict[tuple[str, str], float] = {}
        self._left = Counter(impl for impl, _ in order)
        self._counts: dict[str, Counter[Status]] = {}
        self._unavailable: dict[str, str] = {}
        for record in earlier:
            self._count(record)
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

    def _count(self, record: ResultRecord) -> Counter[Status]:
        counts = self._counts.setdefault(record.impl, Counter())
        counts[record.status] += 1
        if record.status is Status.UNAVAILABLE:
            self._unavailable.setdefault(record.impl, record.reason)
        return counts

    def update(self, record: ResultRecord) -> None:
        """One more result: time it, advance, and print its line if it is a failure and
        its implementation's line if it was the implementation's last pair."""
        now = time.monotonic()
        self.seconds[record.impl, record.case_id] = now - self._last
        self._last = now
        lines = []
        if record.status.failing or record.status is Status.HARNESS_ERROR:
            lines.append(result_line(record))
        counts = self._count(record)
        self._left[record.impl] -= 1
        if self._left[record.impl] == 0:
            every = counts[Status.UNAVAILABLE] == sum(counts.values())
            lines.append(implementation_line(
                record.impl, counts, self._unavailable.get(record.impl) if every else None))
        done = len(self.seconds)
        if self._bar is not None:
            for line in lines:
                self._bar.console.print(line, soft_wrap=True)
            self._bar.update(self._task, advance=1, description=self._name(done))
            return
        left = len(self.order) - done
        eta = datetime.timedelta(seconds=round((now - self._start) / done * left))
        for line in lines:  # one log line per event, never wrapped
            self.console.print(escape(f"[{done}/{len(self.order)} eta {eta}] ") + line,
                               soft_wrap=True)
