"""docs/implementations.md's ``pagedbench list`` table is what ``pagedbench list`` prints:
one row per built-in implementation, in leaderboard order, and in every column that does
not depend on the machine (all but ``available`` and ``version``) what each adapter
declares for the CPU today, rendered by the command's own formatter."""

from __future__ import annotations

from pagedbench.adapters import BUILTIN, load
from pagedbench.harness.cli.listing import capability_matrix
from pagedbench.harness.results.record import ListingRow
from pagedbench.suites.docs.markdown import ROOT

PAGE = ROOT / "docs" / "implementations.md"
HEADING = "## `pagedbench list --wide` on a CPU-only machine"
#: Columns that depend on the machine the page's table was printed on (the library build
#: and ISA paths a host takes among them).
MACHINE_COLUMNS = ("available", "version", "build, ISA paths")


def table_rows(markdown: str) -> list[dict[str, str]]:
    """The rows of the first Markdown table in ``markdown``, as ``{column: cell}``."""
    lines = [line for line in markdown.splitlines() if line.startswith("|")]
    split = [[cell.strip() for cell in line.strip("|").split("|")] for line in lines]
    header, body = split[0], split[2:]
    return [dict(zip(header, row)) for row in body]


def declared_for_cpu(name: str, target: str) -> ListingRow:
    adapter = load(target)
    return ListingRow(name=name, target=target, status="available", description="",
                      available=True, reason="", version="", details={}, interpreted=False,
                      capabilities=adapter.capabilities("cpu").to_dict())


def without_machine_columns(rows: list[dict[str, str]]) -> list[dict[str, str]]:
    return [{k: v for k, v in row.items() if k not in MACHINE_COLUMNS} for row in rows]


def test_page_lists_every_builtin_as_declared_for_the_cpu() -> None:
    section = PAGE.read_text().split(HEADING, 1)[1].split("\n## ", 1)[0]
    published = table_rows(section)
    assert [row["implementation"] for row in published] == list(BUILTIN)
    printed = table_rows(capability_matrix(
        [declared_for_cpu(name, target) for name, target in BUILTIN.items()]))
    assert without_machine_columns(published) == without_machine_columns(printed), (
        "docs/implementations.md is stale: paste `pagedbench list` there")
