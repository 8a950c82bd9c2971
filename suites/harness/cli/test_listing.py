"""``pagedbench list``: by default one row per implementation within the terminal's width
(name, available or why not, version, build); ``list NAME`` shows what one declares, whole;
an unknown NAME is a usage error naming the known ones."""

from __future__ import annotations

import io

from rich.console import Console

from pagedbench.adapters import BUILTIN, load
from pagedbench.harness.cli import main
from pagedbench.harness.cli.listing import compact, declared
from pagedbench.harness.results.record import ListingRow
from pagedbench.harness.verdict.status import ExitCode

#: A reason as long as a missing peer's (flash-mla's names its build steps).
LONG = ("flash_mla not installed (build it from github.com/deepseek-ai/FlashMLA (`pip "
        "install -v .` in its checkout; SM90, CUDA 12.8 or newer))")


def _row(name: str, target: str, available: bool) -> ListingRow:
    return ListingRow(name=name, target=target, status="available" if available
                      else "unavailable", description="d", available=available,
                      reason="" if available else LONG, version="1.0" if available else "",
                      details={"library": "_C; " + "vec16 " * 20} if available else {},
                      interpreted=False,
                      capabilities=load(target).capabilities("cpu").to_dict())


def _text(renderable, width: int) -> list[str]:
    console = Console(file=io.StringIO(), width=width, record=True)
    console.print(renderable)
    return console.export_text().splitlines()


def test_the_default_table_fits_120_columns_one_row_each() -> None:
    rows = [_row(name, target, i % 2 == 0) for i, (name, target) in enumerate(BUILTIN.items())]
    for width in (120, 80):
        lines = _text(compact(rows, width), width)
        assert max(map(len, lines)) <= width
        rule = next(i for i, line in enumerate(lines) if line.strip().startswith("─"))
        named = [line.split()[0] for line in lines[rule + 1:] if line.strip()]
        assert named == list(BUILTIN)
        assert any(" no: flash_mla not " in line and "…" in line and line.rstrip().endswith("-")
                   for line in lines)  # the reason cut, the build column still there


def test_list_name_shows_what_it_declares_whole() -> None:
    name, target = next(iter(BUILTIN.items()))
    text = " ".join(" ".join(_text(declared(_row(name, target, False)), 60)).split())
    assert LONG in text  # wrapped, not cut
    caps = load(target).capabilities("cpu")
    assert f"dtypes {', '.join(sorted(caps.dtypes))}" in text
    assert f"target{target}" in "".join(text.split())  # folded where it is too long


def test_an_unknown_name_is_a_usage_error(capsys) -> None:
    assert main(["list", "torch-gathr"]) == ExitCode.USAGE_ERROR
    err = capsys.readouterr().err
    assert "no implementation named torch-gathr" in err and "torch-gather" in err
