"""docs/ARCHITECTURE.md names every module of the four package folders (``reference/``,
``kernels/``, ``adapters/``, ``harness/`` and its sub-packages), so that a module added or
moved shows here; that no import closes a cycle and that ``harness/``'s sub-packages import
only downward, as its layer table says;
that every path it names exists is checked for every page (``test_docs_links.py``)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from pagedbench.suites.docs.markdown import ROOT, named_paths

PAGE = ROOT / "docs" / "ARCHITECTURE.md"
PACKAGES = ("reference", "kernels", "adapters", "harness")


def test_every_module_is_named() -> None:
    named = named_paths(PAGE.read_text())
    modules = {f.relative_to(ROOT).as_posix() for package in PACKAGES
               for f in (ROOT / package).rglob("*.py")}
    assert sorted(modules - named) == [], "modules docs/ARCHITECTURE.md does not name"



def _imports() -> dict[str, set[str]]:
    """``{module: the pagedbench modules it imports}`` over the four package folders, the
    imports inside functions included (a lazy import closes a cycle all the same)."""
    modules: dict[str, Path] = {}
    for package in PACKAGES:
        for f in (ROOT / package).rglob("*.py"):
            parts = f.relative_to(ROOT).with_suffix("").parts
            parts = parts[:-1] if parts[-1] == "__init__" else parts
            modules[".".join(("pagedbench", *parts))] = f

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for name, f in modules.items():
        package = name if f.name == "__init__.py" else name.rpartition(".")[0]
        found = set()
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1]
                                    + ([base] if base else []))
                targets = [base, *(f"{base}.{a.name}" for a in node.names)]
            else:
                continue
            found |= {r for t in targets if t.startswith("pagedbench.")
                      and (r := resolve(t)) not in (None, name)}
        graph[name] = found
    return graph


def test_no_import_cycle() -> None:
    """No module imports one that imports it back, directly or through others (Tarjan's
    strongly connected components; a cycle is one of more than one module)."""
    graph = _imports()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while (w := stack.pop()) != v:
                component.append(w)
            if component:
                cycles.append(sorted([v, *component]))

    for v in graph:
        if v not in index:
            visit(v)
    assert cycles == [], "import cycles"


def test_harness_layers_match_the_page() -> None:
    """Each sub-package of ``harness/`` imports only those of lower layers than its own,
    as the page's layer table says, and the table names every sub-package."""
    layer = {}
    for line in PAGE.read_text().splitlines():
        row = re.fullmatch(r"\| (\d+) \| (.*) \| .* \|", line)
        if row:
            for name in re.findall(r"`(\w+)/`", row.group(2)):
                layer[name] = int(row.group(1))
    packages = {f.parent.name for f in (ROOT / "harness").glob("*/__init__.py")}
    assert sorted(packages - set(layer)) == [], "sub-packages the layer table leaves out"
    upward = []
    for module, imported in _imports().items():
        here = module.split(".")
        for target in imported:
            there = target.split(".")
            if (here[1] == there[1] == "harness" and len(here) > 2 and len(there) > 2
                    and here[2] != there[2] and layer[there[2]] >= layer[here[2]]):
                upward.append(f"{module} -> {target}")
    assert sorted(upward) == [], "imports of a sub-package of the same or a higher layer"


#: Most harness modules one case may pass through on its way to the leaderboard.
CASE_PATH_MODULES = 12


def test_the_path_of_one_case_is_the_code() -> None:
    """The page's path of one case (between its ``case-path`` markers) names at most
    :data:`CASE_PATH_MODULES` modules, each a module of the checkout that imports, or is
    imported by, a module before it on the path: a module the case crosses that the page
    leaves out, or one it names that is not on the way, shows here."""
    text = PAGE.read_text()
    section = text[text.index("<!-- case-path -->"):text.index("<!-- /case-path -->")]
    path = re.findall(r"^\d+\. `([^`]+\.py)`", section, flags=re.M)
    assert 0 < len(path) <= CASE_PATH_MODULES, path
    graph = _imports()
    names = ["pagedbench." + p.removesuffix(".py").replace("/", ".") for p in path]
    assert [n for n in names if n not in graph] == [], "the path names no such module"
    unlinked = [b for i, b in enumerate(names[1:], 1)
                if not any(b in graph[a] or a in graph[b] for a in names[:i])]
    assert unlinked == [], "modules of the path that no module before them imports or is "\
                           "imported by"
