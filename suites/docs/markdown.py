"""What the docs tests read from a Markdown page: its links, its headings' anchors, the
repository paths it names. Parsed with markdown-it-py (CommonMark and tables), so that
text inside code blocks is never taken for a link or a heading."""

from __future__ import annotations

import re
from collections import Counter
from functools import cache
from pathlib import Path

from markdown_it import MarkdownIt

ROOT = Path(__file__).resolve().parents[2]
#: The pages: README.md and every Markdown file of docs/.
PAGES = (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")))
_PARSER = MarkdownIt("commonmark").enable("table")
#: A path in the repository: one of its top-level folders, then names, not inside a
#: longer path (``tests/kernels/...`` is another project's); a ``<placeholder>`` or ``*``
#: right after it (``adapters/<peer>.py``) makes it a pattern, not a path.
_PATH = re.compile(r"(?<![\w/.-])((?:reference|kernels|adapters|harness|suites|scripts|docs|"
                   r"results|examples)/[\w./-]*+)(?![<*])")


@cache
def _tokens(page: Path) -> list:
    return _PARSER.parse(page.read_text())


def _inline_children(page: Path):
    for token in _tokens(page):
        if token.type == "inline":
            yield from token.children or ()


def links(page: Path) -> list[str]:
    """Every link target and image source of ``page``, in order."""
    return [child.attrGet("href") or child.attrGet("src") for child in _inline_children(page)
            if child.type in ("link_open", "image")]


def named_paths(text: str) -> set[str]:
    """Every repository path ``text`` names (code blocks included), a sentence's final
    period dropped."""
    return {match.group(1).rstrip(".") for match in _PATH.finditer(text)}


def slug(heading: str) -> str:
    """GitHub's anchor of a heading's text: lower case, every character but letters,
    digits, ``_``, ``-`` and spaces dropped, spaces made ``-`` (github-slugger's rule)."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


@cache
def anchors(page: Path) -> frozenset[str]:
    """The anchors of ``page``'s headings; a repeated one gets ``-1``, ``-2``, ... as on
    GitHub."""
    tokens = _tokens(page)
    seen: Counter[str] = Counter()
    found = set()
    for opening, inline in zip(tokens, tokens[1:]):
        if opening.type != "heading_open":
            continue
        anchor = slug("".join(child.content for child in inline.children or ()
                              if child.type in ("text", "code_inline")))
        found.add(anchor if not seen[anchor] else f"{anchor}-{seen[anchor]}")
        seen[anchor] += 1
    return frozenset(found)
