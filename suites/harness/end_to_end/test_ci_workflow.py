"""``examples/ci/gpu.yml`` runs commands that exist: every ``pagedbench`` line parses with
the CLI's own parser, the conformance step uses the pytest plugin's options and known
implementations, and the gate reads the baselines' folder; and the workflow's steps run,
through bash, on a CPU stand-in of the runner."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from junitparser import JUnitXml

from pagedbench.adapters import BUILTIN
from pagedbench.harness.cli import _parser
from pagedbench.harness.gate import baselines
from pagedbench.harness.verdict.status import ExitCode

ROOT = Path(__file__).resolve().parents[3]
WORKFLOW = ROOT / "examples" / "ci" / "gpu.yml"


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
    assert [argv[argv.index("--baseline") + 1] for argv in gates] == [str(baselines.BASELINES_DIR)]


def test_conformance_runs_the_installed_suite_with_the_plugin_options() -> None:
    (argv,) = [a for a in _commands() if a[0] == "pytest"]
    assert argv[argv.index("--pyargs") + 1] == "pagedbench.suites.conformance"
    assert argv[argv.index("--pagedbench-device") + 1] == "cuda"
    impls = [argv[i + 1] for i, a in enumerate(argv) if a == "--impl"]
    assert impls and set(impls) <= set(BUILTIN), set(impls) - set(BUILTIN)


#: The CPU stand-in of each GPU-only piece of the workflow (docs/ci.md, "The workflow on
#: a CPU"): what the runner's command says, and what the stand-in runs instead.
CPU_STAND_INS = (
    # Installing from the index: the session's wheel with this interpreter's dependencies.
    ("build/venv/bin/pip install '.[gpu,test]'", "cp -r \"$STANDIN_VENV\"/. build/venv/"),
    ("python -m venv build/venv", "mkdir -p build/venv"),
    ("nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv", "true"),
    ("--pagedbench-device cuda", "--pagedbench-device cpu -k test_pinned_probes"),
    ("--impl pagedbench-triton --impl pagedbench-triton-split "
     "--impl flashinfer-nhd --impl flash-attn2 --impl xformers",
     "--impl torch-gather --impl sdpa-contiguous"),
    ("pagedbench bench --device cuda",
     "pagedbench bench --device cpu --quick --no-peaks --repetitions 10 "
     "--impl torch-gather --impl sdpa-contiguous"),
    # The committed baselines are another machine's: gate against this run's golden.
    ("--baseline results/baselines", "--baseline build/baselines"),
)


#: Exit codes a step may end with on the stand-in, where not only 0: this run's results
#: against their own golden never regress (1), but on a loaded CPU a noisy point may be
#: left unjudged (7, which the job then fails on, as it should).
EXITS = {"Gate against results/baselines/<device>/": {0, int(ExitCode.UNJUDGED)}}


def _stand_in(script: str) -> str:
    for gpu, cpu in CPU_STAND_INS:
        script = script.replace(gpu, cpu)
    return script


def test_the_workflow_runs_its_commands_on_a_cpu_stand_in(outside, wheel) -> None:
    """Every ``run:`` step in order, through bash as the runner would (``${{ }}``
    expressions filled in), the new golden before the gate (the two steps are
    exclusive on the runner; here the golden gives the gate a baseline of this host)."""
    from ..installed import Venv

    venv = Venv(outside / "ci", wheel)
    workspace, temp = outside / "ci" / "workspace", outside / "ci" / "runner-temp"
    temp.mkdir()
    shutil.copytree(ROOT, workspace, ignore=shutil.ignore_patterns(
        "build", ".venv", ".git", "__pycache__", "results"))
    (workspace / "build").mkdir()
    summary, path_file = temp / "summary.md", temp / "path"
    (job,) = yaml.safe_load(WORKFLOW.read_text())["jobs"].values()
    expressions = {"${{ github.workspace }}": str(workspace), "${{ runner.temp }}": str(temp)}
    steps = [s for s in job["steps"] if "run" in s]
    names = [s["name"] for s in steps]
    golden = names.index("New golden")
    steps.insert(names.index("Gate against results/baselines/<device>/"), steps.pop(golden))
    env = {**venv.env, "GITHUB_WORKSPACE": str(workspace), "GITHUB_STEP_SUMMARY": str(summary),
           "GITHUB_PATH": str(path_file), "STANDIN_VENV": str(venv.base / "venv")}
    for name, value in job["env"].items():
        for expression, text in expressions.items():
            value = value.replace(expression, text)
        env[name] = value
    scripts = "\n".join(s["run"] for s in steps)
    unused = [gpu for gpu, _ in CPU_STAND_INS if gpu not in scripts]
    assert not unused, f"the workflow no longer runs {unused}: update CPU_STAND_INS"
    ran = {}
    for step in steps:
        script = _stand_in(step["run"])
        cwd = step.get("working-directory", str(workspace))
        for expression, text in expressions.items():
            cwd = cwd.replace(expression, text)
        path = path_file.read_text().split() if path_file.exists() else []
        step_env = {**env, "PATH": os.pathsep.join([*path, env["PATH"]])}
        proc = subprocess.run(["bash", "-e", "-c", script], cwd=cwd, env=step_env,
                              capture_output=True, text=True, timeout=600)
        ran[step["name"]] = proc
        assert proc.returncode in EXITS.get(step["name"], {0}), (
            step["name"], script, proc.stdout[-3000:], proc.stderr[-3000:])
    conformance = ran["Conformance (pytest plugin, from the installed package)"]
    last = conformance.stdout.splitlines()[-1]
    assert re.match(r"\d+ passed, \d+ deselected\b", last) and "failed" not in last, last
    (suite,) = JUnitXml.fromfile(str(workspace / "build" / "junit" / "conformance.xml"))
    assert suite.tests > 0 and suite.failures == suite.errors == 0
    (bench,) = JUnitXml.fromfile(str(workspace / "build" / "junit" / "bench.xml"))
    assert bench.tests == 12 and all(case.time > 0 for case in bench)
    board = (workspace / "build" / "leaderboard.md").read_text()
    assert "torch-gather" in board and board in summary.read_text()
    assert list((workspace / "build" / "baselines").rglob("baseline.jsonl"))
    verdict = ran["Gate against results/baselines/<device>/"].stdout.strip().splitlines()[-1]
    gate_report = (workspace / "build" / "gate.md").read_text()
    assert verdict.startswith("gate: ") and verdict in gate_report
    assert gate_report.strip() in summary.read_text()
