"""``examples/ci/gpu-matrix.yml`` shards one sweep over a matrix of GPU kinds and shards and
merges them: its commands parse with the CLI's own parser, every GPU kind runs every shard
of one N, the merge job reads what the shard jobs upload. Its steps run on a CPU stand-in in
``results/test_shard.py`` (two shards at once, then the merge job's report and gate), whose
shards they are."""

from __future__ import annotations

import itertools
import shlex
from pathlib import Path

import yaml

from pagedbench.harness.cli import _parser

ROOT = Path(__file__).resolve().parents[3]
WORKFLOW = yaml.safe_load((ROOT / "examples" / "ci" / "gpu-matrix.yml").read_text())
SHARD_JOB, MERGE_JOB = WORKFLOW["jobs"]["shard"], WORKFLOW["jobs"]["merge"]
MATRIX = SHARD_JOB["strategy"]["matrix"]
#: The CPU stand-in of each GPU-only piece (as test_ci_workflow.py's for gpu.yml); the
#: bench is results/test_shard.py's.
CPU_STAND_INS = (
    ("pagedbench bench --device cuda --devices all",
     "pagedbench bench --device cpu --devices cpu:2 --quick --workload 'decode-*' --no-peaks "
     "--impl torch-gather"),
    # The committed baselines are another machine's: the union is its own golden.
    ("--baseline results/baselines", "--baseline build/shards"),
)


def _filled(text: str, gpu: str, index: int) -> str:
    return (text.replace("${{ matrix.gpu }}", gpu).replace("${{ matrix.shard }}", str(index))
            .replace("$SHARDS", str(SHARD_JOB["env"]["SHARDS"])))


def _commands(step: dict) -> list[list[str]]:
    script = step.get("run", "").replace("\\\n", " ")
    out = []
    for line in filter(str.strip, script.splitlines()):
        words = shlex.split(line, comments=True)
        out.append(words[:next((i for i, w in enumerate(words) if w == "|"), len(words))])
    return out


def step(job: dict, name: str) -> dict:
    """The step of ``job`` named ``name``."""
    (step,) = [s for s in job["steps"] if s.get("name") == name]
    return step


def test_every_gpu_kind_runs_every_shard_of_one_plan() -> None:
    shards = MATRIX["shard"]
    assert sorted(shards) == list(range(1, SHARD_JOB["env"]["SHARDS"] + 1))
    parser = _parser()
    seen = set()
    for gpu, index in itertools.product(MATRIX["gpu"], shards):
        (bench,) = [c for c in _commands({"run": _filled(step(
            SHARD_JOB, "One shard of the sweep")["run"], gpu, index)}) if c[0] == "pagedbench"]
        args = parser.parse_args(bench[1:])
        assert (args.command, args.device) == ("bench", "cuda")
        seen.add((gpu, str(args.shard)))
    assert seen == {(g, f"{k}/{len(shards)}") for g in MATRIX["gpu"] for k in shards}


def test_the_merge_job_reports_and_gates_what_every_shard_uploaded() -> None:
    assert MERGE_JOB["needs"] == "shard" and MERGE_JOB["if"] == "always()"
    upload = step(SHARD_JOB, "Upload the shard's results")["with"]
    assert upload["path"] == "build/bench/*.jsonl"
    (download,) = [s for s in MERGE_JOB["steps"]
                   if s.get("uses", "").startswith("actions/download-artifact")]
    assert download["with"]["pattern"] == upload["name"].split("${{")[0] + "*"
    assert download["with"]["merge-multiple"] is True
    folder = download["with"]["path"]
    parser = _parser()
    (report, _) = _commands(step(MERGE_JOB, "Leaderboard of every device"))
    (gate,) = _commands(step(MERGE_JOB, "Gate against results/baselines/<device>/"))
    assert parser.parse_args(report[1:]).paths == [Path(folder)]
    assert parser.parse_args(gate[1:]).current == Path(folder)
    assert "cat build/gate.md" in step(MERGE_JOB, "Gate report")["run"]


def stand_in(script: str) -> str:
    """``script`` with :data:`CPU_STAND_INS` applied; refused when the workflow no longer
    holds one of them."""
    scripts = "\n".join(s.get("run", "") for job in (SHARD_JOB, MERGE_JOB) for s in job["steps"])
    unused = [gpu for gpu, _ in CPU_STAND_INS if gpu not in scripts]
    assert not unused, f"the workflow no longer runs {unused}: update CPU_STAND_INS"
    for gpu, cpu in CPU_STAND_INS:
        script = script.replace(gpu, cpu)
    return script
