"""What ``run``, ``bench``, ``gate`` (and any command that ends with result records) print
last: a summary that fits the terminal, the full tables being in files it names.

:func:`print_summary` takes the records and a title and prints, each part within the
console's width (:func:`terminal`: the terminal's, ``$COLUMNS``, else
:data:`DEFAULT_WIDTH`):

- per preset or workload (:func:`group_of`, or the ``group`` given) and case, the fastest
  ranked pass (a pass timed by a ranked method, never an interpreter: the leaderboard's
  bold cell) with its median and spread [p10-p90] in ms, and the next fastest;
- the verdicts per implementation, with how many cases each was fastest on; an
  implementation unavailable on every case is one line with its reason;
- each failure (``fail``, ``error``, ``crash``, ``timeout``, ``harness-error``) with the
  command that replays it (:func:`replay_command`), at most ``max_failures`` of them;
- the files (``files``: label and path), which hold every table and reason.

Cells that do not fit are cut with an ellipsis; a replay command is never cut (it is to
be pasted), nor is a path.
"""

from __future__ import annotations

import os
import re
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path

from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from pagedbench.harness.results.derived import RANKED_METHODS
from pagedbench.harness.results.record import ResultRecord
from pagedbench.harness.verdict.status import Status

#: Columns of a summary printed where there is no terminal and no ``$COLUMNS``.
DEFAULT_WIDTH = 100
#: Failures listed with their replay commands; the rest are counted (the report has all).
MAX_FAILURES = 20
_DTYPE_TAGS = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}
_REPLAY = re.compile(r";?\s*replay: (pagedbench replay .+)$")


def terminal(**options) -> Console:
    """A rich console for progress and summaries: the terminal's width on a terminal,
    ``$COLUMNS`` when set, else :data:`DEFAULT_WIDTH` (a log, a pipe); ``options`` go to
    :class:`rich.console.Console`."""
    console = Console(highlight=False, **options)
    if not console.is_terminal and not os.environ.get("COLUMNS", "").isdigit():
        console.width = DEFAULT_WIDTH
    return console


def ranked(record: ResultRecord) -> bool:
    """Whether ``record`` takes part in the ranking: a pass timed by a ranked method
    (:data:`~pagedbench.harness.results.derived.RANKED_METHODS`), never an interpreter."""
    t = record.time_ms
    return (record.status is Status.PASS and t is not None and t.method in RANKED_METHODS
            and not record.interpreted)


def group_of(record: ResultRecord) -> str:
    """The preset or workload a record belongs to: its bench workload, else its case's
    name (a model preset of ``pagedbench run``), else its case id."""
    return record.workload or record.paged_case().name or record.case_id


def case_label(record: ResultRecord) -> str:
    """A case in a few words beside its group: dtype, block size, batch, context (and
    query lengths, fp8 cache), e.g. ``bf16 bs16 b8 kv1..2048``."""
    case = record.paged_case()

    def span(values: Sequence[int]) -> str:
        return f"{min(values)}" if min(values) == max(values) else f"{min(values)}..{max(values)}"

    parts = [_DTYPE_TAGS.get(case.dtype, case.dtype), f"bs{case.block_size}",
             f"b{case.batch_size}", f"kv{span(case.kv_lens)}"]
    if case.mode == "prefill":
        parts.append(f"q{span(case.q_lens_or_decode)}")
    if case.kv_cache_dtype != "auto":
        parts.append(case.kv_cache_dtype)
    return " ".join(parts)


def replay_command(record: ResultRecord, write_case: bool = True) -> str | None:
    """The command that reruns ``record``'s case on its implementation: the one its reason
    ends with (``replay: pagedbench replay FILE --impl NAME``), else that of a case file
    written now (:func:`~pagedbench.harness.run.replay.write_case`) when ``write_case``,
    else None."""
    found = _REPLAY.search(record.reason)
    if found:
        return found.group(1)
    if not write_case:
        return None
    from pagedbench.harness.run import replay  # imports torch: not for a report of passes

    return replay.command(replay.write_case(record.paged_case()), record.impl)


def duration(record: ResultRecord) -> str:
    """The median and spread of a timed record in one unit (s, ms or us), e.g.
    ``848 [746-901] us``."""
    t = record.time_ms
    scale, unit = next((f, u) for f, u in ((1e-3, "s"), (1.0, "ms"), (1e3, "us"))
                       if t.median * f >= 1 or u == "us")
    def number(value: float) -> str:  # 3 significant digits, never an exponent
        return f"{value:.0f}" if value >= 1000 else f"{value:.3g}"

    return f"{number(t.median * scale)} [{number(t.p10 * scale)}-{number(t.p90 * scale)}] {unit}"


def fitted_table(title: str, headers: Sequence[str], rows: Sequence[Sequence[str]],
                 width: int, shrink: Sequence[int], sections: Sequence[int] = ()) -> Table:
    """A table of ``rows`` (cells in rich markup) within ``width`` columns: the columns
    not in ``shrink`` keep their full width, those in ``shrink`` share the rest in
    proportion to their widths (at least 8 each) and are cut with an ellipsis; a line
    is drawn after each row index in ``sections``."""
    natural = [max(Text.from_markup(str(cell)).cell_len for cell in (header, *column))
               for header, *column in zip(headers, *rows)] if rows else [len(h) for h in headers]
    # Two columns between cells, and the box's two edges (blank, but drawn).
    spare = width - 2 * (len(headers) - 1) - 2 - sum(
        n for i, n in enumerate(natural) if i not in shrink)
    wanted = sum(natural[i] for i in shrink)
    caps = {i: natural[i] if wanted <= spare else max(8, natural[i] * spare // wanted)
            for i in shrink}
    table = Table(box=box.SIMPLE_HEAD, title=title or None, title_justify="left", pad_edge=False,
                  collapse_padding=True)
    for i, header in enumerate(headers):
        table.add_column(header, max_width=caps.get(i), overflow="ellipsis", no_wrap=True)
    for index, row in enumerate(rows):
        table.add_row(*row, end_section=index in sections)
    return table


def fastest_table(records: Sequence[ResultRecord], group: Callable[[ResultRecord], str],
                  group_title: str, width: int) -> Table | None:
    """Rows of (group, case) in order of appearance (the device beside the group when
    ``records`` span several): the fastest ranked pass, its median
    [p10-p90] (:func:`duration`), and the next fastest with how many times slower it is;
    None when nothing was ranked. Within ``width`` columns the fastest implementation and
    its time stay whole; the group, case and next-fastest columns share what is left."""
    devices = len({r.env.device for r in records}) > 1  # a gate over several devices
    cases: dict[tuple[str, str, str], list[ResultRecord]] = {}
    for record in records:
        name = f"{group(record)} ({record.env.device})" if devices else group(record)
        cases.setdefault((name, record.env.device, record.case_id), []).append(record)
    rows: list[tuple[str, ...]] = []
    sections: list[int] = []
    previous = None
    for (name, _, _), mine in cases.items():
        timed = sorted((r for r in mine if ranked(r)), key=lambda r: r.time_ms.median)
        if not timed:
            continue
        best = timed[0]
        following = (f"{timed[1].time_ms.median / best.time_ms.median:.3g}x {timed[1].impl}"
                     if len(timed) > 1 else "")
        if rows and name != previous:
            sections.append(len(rows) - 1)
        rows.append((escape(name) if name != previous else "", escape(case_label(best)),
                     f"[green]{escape(best.impl)}[/]", duration(best), escape(following)))
        previous = name
    if not rows:
        return None
    return fitted_table("Fastest passing implementation",
                        (group_title, "case", "fastest", "median [p10-p90]", "next: slower by"),
                        rows, width, shrink=(0, 1, 4), sections=sections)


def verdict_table(records: Sequence[ResultRecord]) -> tuple[Table | None, list[str]]:
    """Implementations x statuses (those that occur), with the count of cases each was the
    fastest on; and one ``name: unavailable: reason`` line per implementation that is
    unavailable on every case (it has no row)."""
    by_impl: dict[str, list[ResultRecord]] = {}
    for record in records:
        by_impl.setdefault(record.impl, []).append(record)
    absent = {impl: mine[0].reason for impl, mine in by_impl.items()
              if all(r.status is Status.UNAVAILABLE for r in mine)}
    fastest: Counter[str] = Counter()
    best: dict[tuple[str, str], ResultRecord] = {}
    for record in filter(ranked, records):
        held = best.get((record.env.device, record.case_id))
        if held is None or record.time_ms.median < held.time_ms.median:
            best[record.env.device, record.case_id] = record
    fastest.update(r.impl for r in best.values())
    shown = [impl for impl in by_impl if impl not in absent]
    lines = [f"{impl}: unavailable: {reason}" for impl, reason in absent.items()]
    if not shown:
        return None, lines
    counts = {impl: Counter(r.status for r in by_impl[impl]) for impl in shown}
    statuses = [s for s in Status if any(c[s] for c in counts.values())]
    table = Table("implementation", *(str(s) for s in statuses), "fastest on",
                  box=box.SIMPLE_HEAD, title="Verdicts", title_justify="left", pad_edge=False)
    for column in table.columns[1:]:
        column.justify = "right"
    table.columns[0].overflow, table.columns[0].no_wrap = "ellipsis", True
    for impl in shown:
        cells = [f"[{s.colour}]{counts[impl][s]}[/]" if counts[impl][s] else "-"
                 for s in statuses]
        table.add_row(escape(impl), *cells, str(fastest[impl] or "-"))
    return table, lines


def failures(records: Sequence[ResultRecord]) -> list[ResultRecord]:
    """The records an implementation or the harness is to blame for, in order."""
    return [r for r in records if r.status.failing or r.status is Status.HARNESS_ERROR]


def _line(console: Console, text: str, style: str = "") -> None:
    """One line cut with an ellipsis to the console's width."""
    console.print(Text(text, style=style), overflow="ellipsis", no_wrap=True, soft_wrap=False)


def print_summary(console: Console, records: Sequence[ResultRecord], title: str, *,
                  files: Sequence[tuple[str, Path]] = (),
                  group: Callable[[ResultRecord], str] = group_of,
                  group_title: str | None = None,
                  max_failures: int = MAX_FAILURES, write_cases: bool = True) -> None:
    """Print the summary of ``records`` under ``title`` (see the module docstring).

    Parameters
    ----------
    console : rich.console.Console
        Where to print; its width bounds every line but a replay command or a path
        (:func:`terminal` makes one).
    records : sequence of ResultRecord
        The results, e.g. one run's; for each (implementation, case) the last one counts.
    title : str
        The heading, e.g. ``"pagedbench run 20261204T142036Z-17717 (cpu)"``.
    files : sequence of (str, pathlib.Path)
        What was written and where (``("results", path)``, ``("report", path)``).
    group : callable, optional
        The row group of a record (default :func:`group_of`: workload or preset).
    group_title : str, optional
        The heading of the group column (default: ``workload`` for bench results, else
        ``preset``).
    max_failures : int, optional
        Failures listed with their replay commands; past it they are counted.
    write_cases : bool, optional
        Write the case file of a failure whose reason names none (a crash, a timeout),
        for its replay command; False for a command that writes nothing (``gate``).
    """
    latest = list({(r.impl, r.env.device, r.case_id): r for r in records}.values())
    console.rule(escape(title), style="dim")
    if group_title is None:
        group_title = "workload" if any(r.workload for r in latest) else "preset"
    fastest = fastest_table(latest, group, group_title, console.width)
    if fastest is not None:
        console.print(fastest)
    else:
        _line(console, "No ranked pass: nothing was timed, or nothing passed.", "yellow")
    verdicts, unavailable = verdict_table(latest)
    if verdicts is not None:
        console.print(verdicts)
    for text in unavailable:
        _line(console, text, "dim")
    failed = failures(latest)
    if failed:
        console.print(Text(f"\nFailures ({len(failed)})", style="bold red"))
    for record in failed[:max_failures]:
        reason = _REPLAY.sub("", record.reason).replace("\n", " ")
        _line(console, f"{record.status} {record.impl} {record.case_id}: {reason}",
              record.status.colour)
        command = replay_command(record, write_cases)
        if command is not None:
            console.print(f"  {escape(command)}", soft_wrap=True)
    if len(failed) > max_failures:
        _line(console, f"... and {len(failed) - max_failures} more failures: every one "
              "is in the files below", "red")
    for label, path in files:
        console.print(f"{escape(label)}: {escape(str(path))}", soft_wrap=True)


__all__ = ["DEFAULT_WIDTH", "MAX_FAILURES", "case_label", "duration", "failures", "fastest_table", "fitted_table",
           "group_of", "print_summary", "ranked", "replay_command", "terminal",
           "verdict_table"]
