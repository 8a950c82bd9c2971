"""Every relative link of README.md and docs/*.md resolves: to a file or folder of the
repository, and, with ``#anchor``, to a heading of that page (GitHub's anchors). Every
repository path a page names (``harness/run/runner.py``, in a code span or a code block)
exists, but under ``results/``, which holds what commands write; every ``from pagedbench...
import ...`` a page shows resolves.

The pages are plain Markdown read where the repository is (GitHub renders them); this
is the check a documentation site's strict build would give. Links to the pages that
:data:`PENDING` names are allowed while those pages do not exist yet:
:func:`test_pending_page_exists` skips, naming each, until it does, and from then on its
links and anchors are checked like every other.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

from pagedbench.suites.docs.markdown import PAGES, ROOT, anchors, links, named_paths, slug

#: Pages README links to that are written on other branches (CI, the gate, trust,
#: findings, robustness); each must exist once those are merged.
PENDING = tuple(ROOT / "docs" / name for name in (
    "ci.md", "gate.md", "trust.md", "findings.md", "robustness.md"))


def broken_links(page: Path) -> list[str]:
    """The relative links of ``page`` that do not resolve, each with why."""
    broken = []
    for link in links(page):
        parts = urlsplit(link)
        if parts.scheme or parts.netloc:
            continue  # https:, mailto: ...: not this repository's
        target = (page.parent / unquote(parts.path)).resolve() if parts.path else page
        if target in PENDING and not target.exists():
            continue
        if not target.exists():
            broken.append(f"{link}: no such file")
        elif parts.fragment and target.suffix == ".md" and parts.fragment not in anchors(target):
            broken.append(f"{link}: no heading with anchor #{parts.fragment} in {target.name}")
    return broken


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path) -> None:
    assert broken_links(page) == []


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_named_paths_exist(page: Path) -> None:
    missing = sorted(path for path in named_paths(page.read_text())
                     if not path.startswith("results/") and not (ROOT / path).exists()
                     and ROOT / path not in PENDING)
    assert missing == [], f"{page.relative_to(ROOT)} names paths that do not exist"


@pytest.mark.parametrize("page", PENDING, ids=lambda p: str(p.relative_to(ROOT)))
def test_pending_page_exists(page: Path) -> None:
    if not page.exists():
        pytest.skip(f"{page.relative_to(ROOT)} is linked from README but written on another "
                    "branch: its links are checked once it is merged")


def test_broken_links_are_found(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    (tmp_path / "other.md").write_text("# Other page\n\n## `code` and † marks\n")
    page.write_text("# Title\n\n[a](other.md) [b](other.md#other-page) "
                    "[c](other.md#code-and--marks) [d](#title) [e](https://example.com/x)\n\n"
                    "[f](missing.md) [g](other.md#nowhere) [h](#nowhere)\n\n"
                    "```\n[not a link](missing-too.md)\n```\n")
    assert broken_links(page) == [
        "missing.md: no such file",
        "other.md#nowhere: no heading with anchor #nowhere in other.md",
        "#nowhere: no heading with anchor #nowhere in page.md",
    ]


@pytest.mark.parametrize("heading, anchor", [
    ("Verdicts and exit codes", "verdicts-and-exit-codes"),
    ("† NaN-unsafe tails", "-nan-unsafe-tails"),
    ("The reference allocator and pagedbench simulate", "the-reference-allocator-and-pagedbench-simulate"),
    ("Caches and temporary files", "caches-and-temporary-files"),
    ("What the paper claims, and what it measures", "what-the-paper-claims-and-what-it-measures"),
])
def test_slug_is_githubs(heading: str, anchor: str) -> None:
    assert slug(heading) == anchor


def test_named_paths_reads_paths_and_skips_patterns() -> None:
    text = ("`harness/run/runner.py`'s run, `suites/adapters/`, `adapters/<peer>.py`, "
            "`suites/adapters/test_<peer>_x.py`, results/gpu/<device>/, suites/x_*.py, "
            "vLLM's tests/kernels/attention/a.py and docs/KERNELS.md.")
    assert named_paths(text) == {"harness/run/runner.py", "suites/adapters/", "docs/KERNELS.md"}


#: ``from pagedbench.<module> import <names>`` on one line (of a page's code, a make recipe's
#: ``python -c``, a script), up to a ``;``, ``"`` or the line's end.
_IMPORT = re.compile(r"from (pagedbench(?:\.\w+)*) import ([\w, ]+?)\s*(?:[;\"\\]|$)",
                     re.MULTILINE)
#: What a reader or a make target runs beside the pages: the Makefile, the scripts, examples.
COMMAND_FILES = (ROOT / "Makefile", *sorted((ROOT / "scripts").glob("*.sh")),
                 *sorted((ROOT / "examples").rglob("*.yml")))


@pytest.mark.parametrize("page", PAGES + COMMAND_FILES, ids=lambda p: p.name)
def test_the_imports_a_page_shows_resolve(page: Path) -> None:
    """What a page, the Makefile or a script imports exists under that name (a page once
    imported ``flops`` from the module that re-exported ``bytes_moved`` only, and
    ``make leaderboard`` a constant that had moved)."""
    missing = []
    for module, names in _IMPORT.findall(page.read_text()):
        for name in (n.strip() for n in names.split(",")):
            if not hasattr(importlib.import_module(module), name):
                missing.append(f"{name} from {module}")
    assert not missing, missing
