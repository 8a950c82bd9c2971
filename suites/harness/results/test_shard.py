"""``--shard K/N`` (harness/results/shard.py): a plan's (implementation, point) pairs split into N
balanced parts, the same on every machine, and merged back by ``report`` and ``gate``,
which refuse a missing shard, a pair measured twice and a shard of another plan (exit 2,
the files named). The shards are run by examples/ci/gpu-matrix.yml's steps, on a CPU."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from pagedbench.harness.results import shard, shard_spec
from pagedbench.harness.cli import _parser, main
from pagedbench.harness.results.record import Plan, ResultRecord, RunRecord
from pagedbench.harness.run.runner import make_plan
from pagedbench.harness.verdict.status import ExitCode
from pagedbench.harness.results.store import read_lines
from pagedbench.reference import PagedCase, PagedValueError

from ..end_to_end import test_ci_matrix_workflow as matrix

#: Six points of very different sizes: 1 to 6 sequences of 64 keys, 2 KV heads of 32.
CASES = [PagedCase(kv_lens=(64,) * n, num_q_heads=4, num_kv_heads=2, head_dim=32,
                   block_size=16, dtype="float32", name=f"b{n}") for n in range(1, 7)]
IMPLS = {"a": "m:A", "b": "m:B"}
#: The quick sweep's decode workload (3 points) with its baseline: 6 pairs, seconds each.
BENCH = ["bench", "--quick", "--workload", "decode-*", "--impl", "torch-gather",
         "--no-peaks"]


def test_shards_partition_the_plan_and_balance_it_within_one_pair() -> None:
    plan = make_plan(IMPLS, CASES)
    every = {(i, c.case_id) for i in IMPLS for c in CASES}
    for count in (1, 2, 3, 5, 12, 13):
        shards = shard.assign(plan, count)
        assert len(shards) == count and set().union(*shards) == every
        assert sum(map(len, shards)) == len(every)  # disjoint
        cost = {c.case_id: shard.pair_cost(c) for c in CASES}
        loads = [sum(cost[case] for _, case in part) for part in shards]
        assert max(loads) - min(loads) <= max(cost.values())  # greedy, largest first


def test_the_same_plan_gives_the_same_shards_and_hash_whatever_its_order() -> None:
    plan = make_plan(IMPLS, CASES)
    again = Plan.model_validate_json(plan.model_dump_json())
    assert shard.assign(again, 3) == shard.assign(plan, 3)
    assert shard.plan_sha256(again) == shard.plan_sha256(plan)
    reordered = make_plan(IMPLS, CASES[::-1])
    assert shard.assign(reordered, 3) == shard.assign(plan, 3)  # pairs sorted by cost
    assert shard.plan_sha256(reordered) != shard.plan_sha256(plan)  # another plan


def test_two_shards_of_two_equal_pairs_take_one_each() -> None:
    plan = make_plan({"a": "m:A"}, [CASES[0], replace(CASES[0], name="twin")])
    first, second = shard.assign(plan, 2)
    assert len(first) == len(second) == 1 and first != second


@pytest.mark.parametrize("text", ["0/2", "3/2", "1/0", "a/b", "1", "1/2/3", "-1/2"])
def test_a_bad_shard_is_refused_naming_the_option(text) -> None:
    with pytest.raises(PagedValueError, match="--shard"):
        shard_spec.parse_spec(text)


def test_a_bad_shard_on_the_command_line_is_a_usage_error(capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        main([*BENCH, "--shard", "3/2"])
    assert exit_.value.code == ExitCode.USAGE_ERROR
    assert "--shard" in capsys.readouterr().err


def _bench(tmp_path: Path, folder: str, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "pagedbench.harness.cli", *BENCH, "--results-dir",
         str(tmp_path / folder), "--cache-dir", str(tmp_path / "build"), *extra],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait(proc: subprocess.Popen) -> None:
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == ExitCode.CLEAN, out[-3000:]


def _verdicts(*paths: Path) -> dict[tuple[str, str], str]:
    return {(r.impl, r.case_id): str(r.status) for r in read_lines(paths)
            if isinstance(r, ResultRecord)}


def _started(folder: Path) -> RunRecord:
    (line,) = [line for line in read_lines([folder])
               if isinstance(line, RunRecord) and line.event == "started"]
    return line


def _shell(script: str, cwd: Path, env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(["bash", "-e", "-o", "pipefail", "-c", script], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _env(base: Path) -> dict[str, str]:
    """This environment's ``pagedbench`` first on ``PATH``, caches under ``base``."""
    bin_dir = str(Path(sys.executable).parent)
    return {**os.environ, "PATH": os.pathsep.join([bin_dir, os.environ["PATH"]]),
            "PAGEDBENCH_CACHE_DIR": str(base / "build"), "SHARDS": "2",
            "GITHUB_STEP_SUMMARY": str(base / "summary.md")}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """The unsharded bench in ``whole/``, and shards 1/2 and 2/2 at the same time in two
    processes, each run by examples/ci/gpu-matrix.yml's shard step (its CPU stand-in: the
    same bench, ``SHARDS`` 2) in a workspace of its own; their results folders are then
    ``one/`` and ``two/``."""
    base = tmp_path_factory.mktemp("shards")
    script = matrix.stand_in(matrix.step(matrix.SHARD_JOB, "One shard of the sweep")["run"])
    argv = [a.replace("${{ matrix.shard }}/$SHARDS", "1/2")
            for a in shlex.split(script[script.index("pagedbench bench"):].split("\\")[0])[1:]]
    assert vars(_parser().parse_args(argv)) == vars(_parser().parse_args(BENCH)) | {
        "shard": shard_spec.ShardSpec(1, 2), "devices": "cpu:2"}  # the workflow's bench, over
    # two CPU workers: merged, its shards still give the one-worker verdicts
    procs = [_bench(base, "whole")]
    for index in (1, 2):
        workspace = base / f"workspace{index}"
        workspace.mkdir()
        filled = script.replace("${{ matrix.gpu }}", "cpu").replace("${{ matrix.shard }}",
                                                                    str(index))
        procs.append(_shell(filled, workspace, _env(base)))
    for proc in procs:
        _wait(proc)
    for index, name in ((1, "one"), (2, "two")):
        uploaded = list((base / f"workspace{index}" / "build" / "bench").glob("*.jsonl"))
        assert [f.name.split("-")[:2] for f in uploaded] == [["cpu", f"shard{index}"]]
        (base / name).mkdir()
        shutil.copy(uploaded[0], base / name)  # the upload
    return base


def test_merged_shards_give_the_unsharded_verdicts(runs: Path, capsys) -> None:
    whole, one, two = _verdicts(runs / "whole"), _verdicts(runs / "one"), _verdicts(runs / "two")
    assert len(whole) == 6 and set(whole.values()) == {"pass"}
    assert one.keys().isdisjoint(two) and len(one) == len(two) == 3
    assert one | two == whole
    plan = _started(runs / "whole").plan
    for index, folder in ((1, "one"), (2, "two")):
        started = _started(runs / folder)
        assert started.plan == plan  # each shard records the whole plan
        assert (started.shard.index, started.shard.count, started.shard.pairs) == (index, 2, 3)
        assert started.shard.plan_sha256 == shard.plan_sha256(plan)
    assert main(["report", str(runs / "one"), str(runs / "two")]) == ExitCode.CLEAN
    board = capsys.readouterr().out
    for impl, case_id in whole:
        assert impl in board and case_id in board


def test_gate_merges_a_folder_of_shards(runs: Path, tmp_path: Path, capsys) -> None:
    """The merged shards against themselves (the unsharded run's timings, taken at the
    same time on a loaded host, may differ beyond noise): every point judged, none moved."""
    merged = tmp_path / "merged"
    merged.mkdir()
    for folder in ("one", "two"):
        for file in (runs / folder).glob("*.jsonl"):
            shutil.copy(file, merged)
    code = main(["gate", "--baseline", str(merged), "--current", str(merged)])
    out = capsys.readouterr().out
    assert code in (ExitCode.CLEAN, ExitCode.UNJUDGED), out[-2000:]
    assert "6 points compared" in out.strip().splitlines()[-1], out[-2000:]  # both shards'


def _refused(argv: list[str], capsys, *named: object) -> str:
    assert main(argv) == ExitCode.USAGE_ERROR
    err = capsys.readouterr().err
    for thing in named:
        assert str(thing) in err, err
    return err


def test_a_missing_shard_is_refused_by_report_and_gate(runs: Path, capsys) -> None:
    (one,) = (runs / "one").glob("*.jsonl")
    err = _refused(["report", str(runs / "one")], capsys, "shard 2/2 missing", one)
    assert "1/2 in" in err
    _refused(["gate", "--baseline", str(runs / "whole"), "--current", str(runs / "one")],
             capsys, "shard 2/2 missing", one)


def test_a_pair_measured_twice_is_refused_naming_both_files(runs: Path, tmp_path: Path,
                                                            capsys) -> None:
    (one,) = (runs / "one").glob("*.jsonl")
    twice = tmp_path / "twice"
    twice.mkdir()
    for folder in ("one", "two"):
        for file in (runs / folder).glob("*.jsonl"):
            shutil.copy(file, twice)
    copy = tmp_path / "copy.jsonl"
    shutil.copy(one, copy)
    _refused(["report", str(runs / "one"), str(runs / "two"), str(copy)], capsys,
             "measured twice", one, copy)
    shutil.copy(one, twice / "again.jsonl")
    _refused(["gate", "--baseline", str(runs / "whole"), "--current", str(twice)], capsys,
             "measured twice", twice / "again.jsonl", twice / one.name)


def test_a_shard_of_another_plan_is_refused(runs: Path, tmp_path: Path, capsys) -> None:
    (two,) = (runs / "two").glob("*.jsonl")
    other = tmp_path / "other.jsonl"
    lines = []
    for text in two.read_text().splitlines():
        data = json.loads(text)
        if data.get("event") == "started":
            data["plan"]["cases"] = data["plan"]["cases"][:-1]  # one point fewer
            data["shard"]["plan_sha256"] = shard.plan_sha256(Plan.model_validate(data["plan"]))
        lines.append(json.dumps(data))
    other.write_text("\n".join(lines) + "\n")
    _refused(["report", str(runs / "one"), str(other)], capsys, "not a shard of the plan",
             other)


def test_the_matrix_workflow_merge_job_runs_on_the_shards(runs: Path, tmp_path: Path) -> None:
    """examples/ci/gpu-matrix.yml's merge job on the shards' uploads, downloaded into one
    folder: its report and gate steps (the gate against the union itself: the committed
    baselines are another machine's)."""
    shards = tmp_path / "build" / "shards"
    shards.mkdir(parents=True)
    for name in ("one", "two"):
        for file in (runs / name).glob("*.jsonl"):
            shutil.copy(file, shards)
    env = _env(tmp_path)
    for name in ("Leaderboard of every device", "Gate against results/baselines/<device>/"):
        script = matrix.stand_in(matrix.step(matrix.MERGE_JOB, name)["run"])
        out, _ = (proc := _shell(script, tmp_path, env)).communicate(timeout=300)
        allowed = {0, int(ExitCode.UNJUDGED)} if name.startswith("Gate") else {0}
        assert proc.returncode in allowed, (name, out[-3000:])
    board = (tmp_path / "build" / "leaderboard.md").read_text()
    assert "torch-gather" in board and board in (tmp_path / "summary.md").read_text()


def _auto(base: Path, folder: str, environ: dict[str, str]) -> subprocess.Popen:
    env = {k: v for k, v in _env(base).items()
           if k not in [n for _, n, *_ in shard_spec.CI_VARIABLES]} | environ
    return subprocess.Popen(
        [sys.executable, "-m", "pagedbench.harness.cli", *BENCH, "--shard", "auto",
         "--results-dir", str(base / folder), "--cache-dir", str(base / "build")],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_auto_shards_from_slurm_and_buildkite_merge_to_the_k_n_verdicts(runs: Path,
                                                                       capsys) -> None:
    """Shard 1 of 2 as a Slurm array task (``--array=4-5``, task 4) and shard 2 as
    Buildkite's second parallel job, at once: each runs the pairs ``--shard K/N`` ran and
    gets its verdicts, and merged they give the unsharded run's."""
    slurm = {"SLURM_ARRAY_TASK_ID": "4", "SLURM_ARRAY_TASK_MIN": "4",
             "SLURM_ARRAY_TASK_MAX": "5", "SLURM_ARRAY_TASK_COUNT": "2"}
    buildkite = {"BUILDKITE_PARALLEL_JOB": "1", "BUILDKITE_PARALLEL_JOB_COUNT": "2"}
    procs = [_auto(runs, "slurm", slurm), _auto(runs, "buildkite", buildkite)]
    for proc in procs:
        out, _ = proc.communicate(timeout=300)
        assert proc.returncode == ExitCode.CLEAN, out[-3000:]
    for folder, k_n, index in (("slurm", "one", 1), ("buildkite", "two", 2)):
        started = _started(runs / folder)
        assert (started.shard.index, started.shard.count) == (index, 2)
        assert started.shard == _started(runs / k_n).shard
        assert _verdicts(runs / folder) == _verdicts(runs / k_n)
    assert _verdicts(runs / "slurm") | _verdicts(runs / "buildkite") == _verdicts(runs / "whole")
    assert main(["report", str(runs / "slurm"), str(runs / "buildkite")]) == ExitCode.CLEAN
    capsys.readouterr()
