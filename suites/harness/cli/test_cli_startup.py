"""The command line answers ``--help`` and a wrong command without importing torch (what a
command's module brings), and each command's own parser is built from the module the table
names."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pagedbench.harness import cli

HEAVY = ("torch", "numpy", "pandas", "pydantic", "triton", "pagedbench.reference")


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


def test_a_command_imports_what_it_needs() -> None:
    """The counter-check: ``schema`` runs, and what its module needs was imported (the
    modules ``importlib.import_module`` loads itself are not in ``-X importtime``'s log)."""
    proc, modules = _imported("schema")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert {"pydantic", "torch", "pagedbench.harness.results.store"} <= modules


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
