"""docs/ARCHITECTURE.md names every module of the four package folders (``reference/``,
``kernels/``, ``adapters/``, ``harness/``), so that a module added or moved shows here;
that every path it names exists is checked for every page (``test_docs_links.py``)."""

from __future__ import annotations

from pagedbench.suites.docs.markdown import ROOT, named_paths

PAGE = ROOT / "docs" / "ARCHITECTURE.md"
PACKAGES = ("reference", "kernels", "adapters", "harness")


def test_every_module_is_named() -> None:
    named = named_paths(PAGE.read_text())
    modules = {f"{package}/{f.name}" for package in PACKAGES for f in (ROOT / package).glob("*.py")}
    assert sorted(modules - named) == [], "modules docs/ARCHITECTURE.md does not name"

