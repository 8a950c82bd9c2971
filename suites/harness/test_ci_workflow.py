"""``examples/ci/gpu.yml`` runs commands that exist: every ``pagedbench`` line parses with
the CLI's own parser, the conformance step uses the pytest plugin's options and known
implementations, and the gate reads the baselines' folder (issue 8, "For CI on GPU
runners")."""

from __future__ import annotations

import shlex
from pathlib import Path

import yaml

from pagedbench.adapters import BUILTIN
from pagedbench.harness import gate
from pagedbench.harness.cli import _parser

WORKFLOW = Path(__file__).resolve().parents[2] / "examples" / "ci" / "gpu.yml"


def _commands() -> list[list[str]]:
    """Every shell command of every step, split as the shell would (``\\`` joins lines),
    up to its first pipe or redirection."""
    (job,) = yaml.safe_load(WORKFLOW.read_text())["jobs"].values()
    out = []
    for step in job["steps"]:
        script = step.get("run", "").replace("\\\n", " ")
        for line in filter(str.strip, script.splitlines()):
            words = list(shlex.shlex(line, posix=True, punctuation_chars=True))
            cut = next((i for i, w in enumerate(words) if w in ("|", ">", ">>", "&&", ";")),
                       len(words))
            out.append(words[:cut])
    return out


def test_every_pagedbench_command_parses() -> None:
    parser = _parser()
    subcommands = next(a for a in parser._actions if a.dest == "command").choices
    used = [argv for argv in _commands() if argv[0] == "pagedbench"]
    assert {argv[1] for argv in used} == {"bench", "report", "gate"}
    assert {argv[1] for argv in used} <= set(subcommands)
    for argv in used:
        parser.parse_args(argv[1:])
    gates = [argv for argv in used if argv[1] == "gate" and "--update-baseline" not in argv]
    assert [argv[argv.index("--baseline") + 1] for argv in gates] == [str(gate.BASELINES_DIR)]


def test_conformance_runs_the_installed_suite_with_the_plugin_options() -> None:
    (argv,) = [a for a in _commands() if a[0] == "pytest"]
    assert argv[argv.index("--pyargs") + 1] == "pagedbench.suites.conformance"
    assert argv[argv.index("--pagedbench-device") + 1] == "cuda"
    impls = [argv[i + 1] for i, a in enumerate(argv) if a == "--impl"]
    assert impls and set(impls) <= set(BUILTIN), set(impls) - set(BUILTIN)
