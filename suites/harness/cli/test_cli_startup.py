"""The command line answers ``--help`` and a wrong command without importing any command's
module, and each command's ``--help`` and its usage errors without torch or pandas (what
a command's body brings); each command's own parser is built from the module the table
names; a case, the input errors and the implementations' names come without torch."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

from pagedbench.harness import cli

HEAVY = ("torch", "numpy", "pandas", "pydantic", "triton", "pagedbench.reference")
#: What a command's parser must not import: only its body needs them.
BODY_ONLY = ("torch", "pandas", "triton", "matplotlib")
#: A stored run's results, as a user's report reads them.
LEADERBOARD = Path(__file__).resolve().parents[3] / "results" / "leaderboard-cpu"


def _imported(*argv: str) -> tuple[subprocess.CompletedProcess[str], set[str]]:
    """Run ``python -X importtime -m pagedbench ARGV``; the modules it imported."""
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "pagedbench", *argv],
                          capture_output=True, text=True, timeout=120)
    modules = {line.rsplit("|", 1)[1].strip() for line in proc.stderr.splitlines()
               if line.startswith("import time:") and "|" in line}
    return proc, modules


@pytest.mark.parametrize("argv, code", [(["--help"], 0), (["nonsense"], 2), ([], 2)])
def test_help_and_usage_errors_import_nothing_heavy(argv, code) -> None:
    proc, modules = _imported(*argv)
    assert proc.returncode == code, proc.stderr[-2000:]
    assert len(modules) > 20, "no import times read"  # the reading itself works
    heavy = {m for m in modules if m.split(".")[0] in HEAVY or m.startswith(HEAVY)}
    assert not heavy, sorted(heavy)


def _body_only(modules: set[str]) -> list[str]:
    return sorted(m for m in modules if m.split(".")[0] in BODY_ONLY)


@pytest.mark.parametrize("command", list(cli.COMMANDS))
def test_each_commands_help_imports_no_torch(command) -> None:
    proc, modules = _imported(command, "--help")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith(f"usage: pagedbench {command}")
    assert _body_only(modules) == []


@pytest.mark.parametrize("argv", [["run", "--block-size", "x"], ["run", "--dtype", "nope"],
                                  ["bench", "--mode", "nope"], ["list", "--timeout", "0"],
                                  ["gate", "--alpha", "2"], ["tune", "--block-sizes", "x"]])
def test_a_usage_error_imports_no_torch(argv) -> None:
    """argparse's refusal (exit 2) comes before the command's body imports anything heavy."""
    proc, modules = _imported(*argv)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"pagedbench {argv[0]}: error: argument" in proc.stderr
    assert _body_only(modules) == []


@pytest.mark.parametrize("argv", [
    ["schema"],
    ["report", str(LEADERBOARD), "--format", "csv", "--output", "{tmp}/board.csv"],
    ["list", "torch-gather"],
], ids=lambda argv: argv[0])
def test_a_command_that_only_reads_imports_what_it_needs_and_no_torch(argv,
                                                                       tmp_path) -> None:
    """``schema``, a ``report`` of the committed CPU leaderboard and ``list`` (whose worker
    imports the implementations) run without torch in the command's process; the
    counter-check: what their modules need was imported (the modules
    ``importlib.import_module`` loads itself are not in ``-X importtime``'s log)."""
    proc, modules = _imported(*(a.format(tmp=tmp_path) for a in argv))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert {"pydantic", "pandas", "pagedbench.harness.results.store"} <= modules
    assert "torch" not in modules


def test_the_help_lists_every_command_and_each_command_answers_help(capsys) -> None:
    with pytest.raises(SystemExit) as top:
        cli.main(["--help"])
    listing = capsys.readouterr().out
    assert top.value.code == 0
    for name, command in cli.COMMANDS.items():
        assert name in listing and command.help.split()[0] in listing
        with pytest.raises(SystemExit) as own:
            cli.main([name, "--help"])
        assert own.value.code == 0
        assert capsys.readouterr().out.startswith(f"usage: pagedbench {name}")


@pytest.mark.parametrize("package", ["pagedbench.reference", "pagedbench.adapters"])
def test_a_lazy_package_imports_each_name_from_the_module_its_table_names(package) -> None:
    """The packages whose names are imported when first used: every name the table
    (``_NAMES_BY_MODULE``) lists comes from the module it names, is public, and the imports
    the type checkers and the import graph read (``if TYPE_CHECKING:``) say the same."""
    module = importlib.import_module(package)
    declared: dict[str, list[str]] = {}
    for node in ast.walk(ast.parse(Path(module.__file__).read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            declared[node.module] = [alias.name for alias in node.names]
    assert declared == module._NAMES_BY_MODULE
    for where, names in declared.items():
        for name in names:
            assert name in module.__all__ and name in dir(module)
            assert getattr(module, name) is getattr(
                importlib.import_module(f"{package}.{where}"), name)


def test_a_case_its_errors_and_the_implementations_come_without_torch() -> None:
    """What a command's options and its refusals use: a case, its axes, the input errors,
    the presets and workloads, and the implementations' names and targets."""
    script = ("import sys; from pagedbench.reference import DTYPES, PagedCase, PagedValueError; "
              "from pagedbench.adapters import entries; "
              "from pagedbench.harness.cases.presets import default_cases; "
              "from pagedbench.harness.cases.workloads import MODES; "
              "assert entries() and default_cases()[0].case_id; "
              "print(sorted(m for m in sys.modules if m.split('.')[0] in "
              f"{BODY_ONLY!r}))")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "[]"
