"""No code names an item of a tracker that is not in the repository ("see issue N, item
M"): a docstring or comment states the rule, the fault or the peer's behaviour itself,
and history goes in commit messages. A public issue is cited by its repository
(``vllm-project/vllm#641``), which this check lets through. Checked: every ``.py`` file of
the package folders, ``scripts/``, ``docs/`` and ``setup.py``, the Makefile and ``.ci/``;
this file's own examples of the pattern are left out."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pagedbench.suites.docs.markdown import ROOT

#: A reference to a tracker item without a repository: "issue 20", "Issues 7 and 20",
#: "issue #8", "issue-8"; never ``owner/repo#N``.
TRACKER_REFERENCE = re.compile(r"(?<![\w/.-])issues?[ \t-]*#?\d+", re.IGNORECASE)
FOLDERS = ("reference", "kernels", "adapters", "harness", "suites", "pagedbench", "scripts",
           "docs")
FILES = ("setup.py", "Makefile")


def checked_files(root: Path) -> list[Path]:
    """The files this check reads under ``root`` (a checkout)."""
    found = [f for folder in FOLDERS for f in (root / folder).rglob("*.py")
             if "__pycache__" not in f.parts]
    found += [f for f in (root / "scripts").glob("*") if f.is_file() and f.suffix != ".py"]
    found += [f for f in (root / ".ci").glob("*") if f.is_file()]
    return found + [root / name for name in FILES if (root / name).is_file()]


def tracker_references(root: Path) -> list[str]:
    """``path:line: text`` of every tracker reference in :func:`checked_files`."""
    return [f"{f.relative_to(root)}:{number}: {line.strip()}"
            for f in checked_files(root) if f.resolve() != Path(__file__).resolve()
            for number, line in enumerate(f.read_text(errors="replace").splitlines(), 1)
            if TRACKER_REFERENCE.search(line)]


@pytest.mark.parametrize("text, found", [
    ("``.to()`` of the same bytes (issue 20, item 6).", True),
    ('"""Issue 24 item 17: numpy scalars', True),
    ("Pinned probes (issues 7 and 20), for every", True),
    ("the issue-8 target", True),
    ("# see Issue #31", True),
    ("CUDA kernel (vllm-project/vllm#641).", False),
    ("Imitates flashinfer-ai/flashinfer#725", False),
    ("an issue with 3 sequences", False),
])
def test_the_pattern_tells_tracker_references_from_public_ones(text, found) -> None:
    assert bool(TRACKER_REFERENCE.search(text)) is found


def test_no_code_names_a_tracker_item() -> None:
    assert len(checked_files(ROOT)) > 300  # the checkout's code, not an empty folder
    assert tracker_references(ROOT) == [], (
        "state the rule or the reason itself, not the tracker item that asked for it")


def test_a_reference_in_any_checked_file_is_found(tmp_path) -> None:
    for name in (*(f"{folder}/a/m.py" for folder in FOLDERS), *FILES, ".ci/run",
                 "scripts/lane.sh"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text('"""Fine."""\n# the rule (issue 3)\n')
    found = tracker_references(tmp_path)
    assert len(found) == len(FOLDERS) + len(FILES) + 2
    assert all(line.endswith(":2: # the rule (issue 3)") for line in found)
