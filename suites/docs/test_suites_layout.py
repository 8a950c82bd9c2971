"""The harness's tests are where docs/ARCHITECTURE.md says a newcomer finds them: the tests
of ``harness/<subpackage>/<module>.py`` in ``suites/harness/<subpackage>/test_<module>.py``
(or ``test_<module>_<property>.py``; ``test_<subpackage>_<property>.py`` for the
sub-package as a whole), the pytest plugin's in ``suites/harness/pytest_plugin/`` and the
end-to-end ones in ``suites/harness/end_to_end/``; none loose in ``suites/harness/``."""

from __future__ import annotations

from pathlib import Path

from pagedbench.suites.docs.markdown import ROOT

TESTS = ROOT / "suites" / "harness"
#: Folders of suites/harness/ that are not named after a sub-package of harness/.
OWN_FOLDERS = {"pytest_plugin", "end_to_end"}


def misplaced(tests: Path, harness: Path) -> list[str]:
    """The test files under ``tests`` (a ``suites/harness/``) that break the layout against
    ``harness`` (the ``harness/`` they test), each with why."""
    subpackages = {d.name for d in harness.iterdir() if (d / "__init__.py").is_file()}
    found = [f"{f.name}: loose in suites/harness/" for f in tests.glob("test_*.py")]
    for f in sorted(tests.glob("*/test_*.py")):
        folder = f.parent.name
        if folder in OWN_FOLDERS:
            continue
        if folder not in subpackages:
            found.append(f"{folder}/{f.name}: harness/ has no sub-package {folder}")
            continue
        names = {m.stem for m in (harness / folder).glob("*.py")} - {"__init__"} | {folder}
        if not any(f.stem == f"test_{n}" or f.stem.startswith(f"test_{n}_") for n in names):
            found.append(f"{folder}/{f.name}: named after no module of harness/{folder}/")
    found += [f"{d.name}/: no __init__.py" for d in tests.iterdir()
              if d.is_dir() and any(d.glob("test_*.py")) and not (d / "__init__.py").is_file()]
    return found


def test_every_harness_test_is_where_the_map_says() -> None:
    assert len(list(TESTS.glob("*/test_*.py"))) > 40
    assert misplaced(TESTS, ROOT / "harness") == []


def test_a_misplaced_test_is_named(tmp_path) -> None:
    harness, tests = tmp_path / "harness", tmp_path / "suites" / "harness"
    for path in ("gate/__init__.py", "gate/compare.py", "cli/__init__.py"):
        (harness / path).parent.mkdir(parents=True, exist_ok=True)
        (harness / path).touch()
    for path in ("gate/__init__.py", "gate/test_compare.py", "gate/test_compare_defaults.py",
                 "cli/__init__.py", "cli/test_cli_startup.py", "end_to_end/__init__.py",
                 "end_to_end/test_anything.py", "test_loose.py", "gate/test_comparison.py",
                 "verdicts/__init__.py", "verdicts/test_status.py", "lane/test_steps.py"):
        (tests / path).parent.mkdir(parents=True, exist_ok=True)
        (tests / path).touch()
    assert sorted(misplaced(tests, harness)) == [
        "gate/test_comparison.py: named after no module of harness/gate/",
        "lane/: no __init__.py",
        "lane/test_steps.py: harness/ has no sub-package lane",
        "test_loose.py: loose in suites/harness/",
        "verdicts/test_status.py: harness/ has no sub-package verdicts"]
