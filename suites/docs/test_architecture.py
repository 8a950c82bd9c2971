"""docs/ARCHITECTURE.md matches the code: every repository path it names exists, and it
names every module of the four package folders (``reference/``, ``kernels/``,
``adapters/``, ``harness/``), so that a module added, moved or removed shows here."""

from __future__ import annotations

import re

from pagedbench.suites.docs.markdown import ROOT

PAGE = ROOT / "docs" / "ARCHITECTURE.md"
PACKAGES = ("reference", "kernels", "adapters", "harness")
#: A path in the repository: a top-level folder, then names; a ``<placeholder>`` right
#: after it (``adapters/<peer>.py``) makes it a pattern, not a path.
PATH = re.compile(r"\b((?:reference|kernels|adapters|harness|suites|scripts|docs|results|examples)"
                  r"/[\w./-]*+)(?!<)")


def named_paths(text: str) -> set[str]:
    return {match.group(1).rstrip(".") for match in PATH.finditer(text)}


def test_every_named_path_exists() -> None:
    missing = sorted(p for p in named_paths(PAGE.read_text()) if not (ROOT / p).exists())
    assert missing == [], f"docs/ARCHITECTURE.md names paths that do not exist: {missing}"


def test_every_module_is_named() -> None:
    named = named_paths(PAGE.read_text())
    modules = {f"{package}/{f.name}" for package in PACKAGES for f in (ROOT / package).glob("*.py")}
    assert sorted(modules - named) == [], "modules docs/ARCHITECTURE.md does not name"


def test_named_paths_reads_paths_and_skips_patterns() -> None:
    text = ("`harness/runner.py`'s run, `suites/adapters/`, `adapters/<peer>.py`, "
            "`suites/adapters/test_<peer>_x.py`, results/gpu/<device>/ and docs/KERNELS.md.")
    assert named_paths(text) == {"harness/runner.py", "suites/adapters/", "docs/KERNELS.md"}
