"""Shards that follow the CI (harness/results/shard.py): ``--shard auto`` takes K and N from
Buildkite, a Slurm array, a Kubernetes indexed Job or ``PAGEDBENCH_SHARD``, refusing an
incomplete set with the variable it lacks (exit 2); ``--balance-from`` balances the shards
by the seconds each pair took in earlier results; and the examples of examples/ci/."""

from __future__ import annotations

import shlex
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
import yaml

from pagedbench.harness.cli import _parser, main
from pagedbench.harness.results import shard, shard_spec
from pagedbench.harness.results.record import SCHEMA_VERSION, RunRecord
from pagedbench.harness.results.store import ResultsFile
from pagedbench.harness.run.runner import make_plan
from pagedbench.harness.verdict.status import ExitCode
from pagedbench.reference import PagedValueError

from ..conftest import ENV, result
from .test_shard import BENCH, CASES

ROOT = Path(__file__).resolve().parents[3]
EXAMPLES = ROOT / "examples" / "ci"
T0 = datetime(2026, 12, 1, tzinfo=timezone.utc)


@pytest.mark.parametrize("environ, expected", [
    ({"BUILDKITE_PARALLEL_JOB": "0", "BUILDKITE_PARALLEL_JOB_COUNT": "4"}, (1, 4)),
    ({"BUILDKITE_PARALLEL_JOB": "3", "BUILDKITE_PARALLEL_JOB_COUNT": "4"}, (4, 4)),
    ({"SLURM_ARRAY_TASK_ID": "5", "SLURM_ARRAY_TASK_COUNT": "4",
      "SLURM_ARRAY_TASK_MIN": "3", "SLURM_ARRAY_TASK_MAX": "6"}, (3, 4)),
    ({"SLURM_ARRAY_TASK_ID": "6", "SLURM_ARRAY_TASK_MIN": "3",
      "SLURM_ARRAY_TASK_MAX": "6"}, (4, 4)),  # the count from min and max
    ({"SLURM_ARRAY_TASK_ID": "7", "SLURM_ARRAY_TASK_MIN": "1", "SLURM_ARRAY_TASK_MAX": "9",
      "SLURM_ARRAY_TASK_STEP": "2"}, (4, 5)),  # --array=1-9:2: tasks 1, 3, 5, 7, 9
    ({"PAGEDBENCH_SHARD": "2/3"}, (2, 3)),  # a GitHub matrix value passed through
])
def test_auto_reads_the_ci_index_and_count(environ, expected) -> None:
    spec = shard_spec.resolve("auto", environ)
    assert (spec.index, spec.count) == expected


def test_a_kubernetes_indexed_job_gives_the_index_and_auto_n_the_count() -> None:
    assert str(shard_spec.resolve("auto/3", {"JOB_COMPLETION_INDEX": "2"})) == "3/3"
    assert str(shard_spec.resolve("auto/4", {"BUILDKITE_PARALLEL_JOB": "1",
                                        "BUILDKITE_PARALLEL_JOB_COUNT": "4"})) == "2/4"


@pytest.mark.parametrize("text, environ, lacking", [
    ("auto", {"BUILDKITE_PARALLEL_JOB": "1"}, "not BUILDKITE_PARALLEL_JOB_COUNT"),
    ("auto", {"SLURM_ARRAY_TASK_ID": "1"}, "not SLURM_ARRAY_TASK_COUNT, nor "
                                           "SLURM_ARRAY_TASK_MIN and SLURM_ARRAY_TASK_MAX"),
    ("auto", {"SLURM_ARRAY_TASK_ID": "1", "SLURM_ARRAY_TASK_MIN": "0"},
     "nor SLURM_ARRAY_TASK_MAX"),
    ("auto", {"JOB_COMPLETION_INDEX": "1"}, "give it as --shard auto/N"),
    ("auto", {}, "no CI index variable is set"),
    ("auto", {"BUILDKITE_PARALLEL_JOB": "0", "BUILDKITE_PARALLEL_JOB_COUNT": "2",
              "SLURM_ARRAY_TASK_ID": "0", "SLURM_ARRAY_TASK_COUNT": "2"}, "both"),
    ("auto/3", {"BUILDKITE_PARALLEL_JOB": "0", "BUILDKITE_PARALLEL_JOB_COUNT": "2"},
     "Buildkite says 2 shards"),
    ("auto", {"BUILDKITE_PARALLEL_JOB": "2", "BUILDKITE_PARALLEL_JOB_COUNT": "2"},
     "index 2 (from BUILDKITE_PARALLEL_JOB) is not below its count 2"),
    ("auto", {"SLURM_ARRAY_TASK_ID": "x", "SLURM_ARRAY_TASK_COUNT": "2"}, "not an integer"),
])
def test_an_incomplete_set_is_refused_naming_what_it_lacks(text, environ, lacking) -> None:
    with pytest.raises(PagedValueError, match="--shard") as refused:
        shard_spec.resolve(text, environ)
    assert lacking in str(refused.value)


def test_an_incomplete_set_on_the_command_line_is_a_usage_error(monkeypatch, capsys) -> None:
    for name in [n for _, n, *_ in shard_spec.CI_VARIABLES]:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("BUILDKITE_PARALLEL_JOB", "1")
    with pytest.raises(SystemExit) as exit_:
        main([*BENCH, "--shard", "auto"])
    assert exit_.value.code == ExitCode.USAGE_ERROR
    assert "BUILDKITE_PARALLEL_JOB_COUNT" in capsys.readouterr().err


def _timed_run(path: Path, run_id: str, seconds: dict[tuple[str, int, str | None], float]):
    """A results file of run ``run_id``: started at T0, then one result per (impl, index
    into CASES, device slot) of ``seconds``, each that many seconds after the one before
    it in its slot."""
    results = ResultsFile(path)
    results.append(RunRecord(kind="run", schema_version=SCHEMA_VERSION, run_id=run_id,
                             event="started", timestamp=T0, plan=None, config=None,
                             exit_code=None, counts=None))
    clock: dict[str | None, datetime] = {}
    for (impl, case, slot), took in seconds.items():
        clock[slot] = clock.get(slot, T0) + timedelta(seconds=took)
        results.append(result(impl, CASES[case], run_id=run_id,
                              env={**ENV, "device_index": slot}, timestamp=clock[slot]))


def test_measured_seconds_are_the_time_from_the_record_before_in_its_slot(tmp_path) -> None:
    taken = {("a", 0, "0"): 1.5, ("a", 1, "1"): 0.25, ("b", 0, "0"): 2.5, ("b", 1, "1"): 4.0}
    _timed_run(tmp_path / "r.jsonl", "r", taken)
    assert shard.measured_seconds([tmp_path / "r.jsonl"]) == pytest.approx(
        {(impl, CASES[case].case_id): took for (impl, case, _), took in taken.items()})


def test_balance_from_seconds_evens_out_what_bytes_mislead(tmp_path) -> None:
    """Six cases of 1 to 6 sequences (bytes grow with them) timed the other way round,
    32, 16, 8, 4, 2 and 1 s, for two implementations: by bytes, 5 shards take up to 49 s;
    by the seconds measured, 32 s, the slowest pair alone. A pair the results lack costs
    its bytes at the measured seconds per byte."""
    plan = make_plan({"a": "m:A", "b": "m:B"}, CASES)
    taken = {(impl, k, None): 2.0 ** (5 - k) for impl in ("a", "b") for k in range(6)}
    _timed_run(tmp_path / "r.jsonl", "r", taken)
    seconds = shard.measured_seconds([tmp_path / "r.jsonl"])

    def longest(parts) -> float:
        return max(sum(seconds[pair] for pair in part) for part in parts)

    assert longest(shard.assign(plan, 5, seconds)) == 32.0
    assert longest(shard.assign(plan, 5)) == 49.0
    partial = {pair: s for pair, s in seconds.items() if pair != ("b", CASES[5].case_id)}
    costs = shard.pair_costs(plan, partial)
    per_us = sum(partial.values()) * 1e6 / sum(
        shard.pair_cost(c) for (_, case) in partial for c in CASES if c.case_id == case)
    assert costs[("b", CASES[5].case_id)] == round(shard.pair_cost(CASES[5]) * per_us)
    assert costs[("a", CASES[0].case_id)] == 32_000_000
    assert shard.balance_of(plan, seconds).startswith("seconds:")
    assert shard.balance_of(plan) is None and shard.assign(plan, 2) == shard.assign(plan, 2, {})


def test_shards_balanced_differently_do_not_merge(tmp_path, capsys) -> None:
    plan = make_plan({"a": "m:A"}, CASES[:2])
    files = []
    for index, balance in ((1, None), (2, "seconds:" + "0" * 64)):
        path = tmp_path / f"s{index}.jsonl"
        record = shard.shard_record(plan, shard_spec.ShardSpec(index, 2))
        ResultsFile(path).append(RunRecord(
            kind="run", schema_version=SCHEMA_VERSION, run_id=f"s{index}", event="started",
            timestamp=T0, plan=plan, config=None, exit_code=None, counts=None,
            shard=record.model_copy(update={"balance": balance})))
        files.append(path)
    with pytest.raises(shard.ShardMergeError, match="give every shard the same --balance-from"):
        shard.merged_lines(files)


def test_a_resume_must_balance_as_its_shard_did(tmp_path) -> None:
    plan = make_plan({"a": "m:A", "b": "m:B"}, CASES)
    _timed_run(tmp_path / "old.jsonl", "old", {("a", 0, None): 3.0})
    seconds = shard.measured_seconds([tmp_path / "old.jsonl"])
    started = RunRecord(kind="run", schema_version=SCHEMA_VERSION, run_id="r",
                        event="started", timestamp=T0, plan=plan, config=None,
                        exit_code=None, counts=None,
                        shard=shard.shard_record(plan, shard_spec.ShardSpec(1, 2), seconds))
    assert shard.recorded_pairs(plan, [started], "r", seconds) == shard.pairs_of(
        plan, shard_spec.ShardSpec(1, 2), seconds)
    with pytest.raises(PagedValueError, match="--balance-from FILE it ran with"):
        shard.recorded_pairs(plan, [started], "r")


def _pagedbench_commands(text: str) -> list[list[str]]:
    """Every ``pagedbench`` command line of a shell script (continuations joined)."""
    joined = text.replace("\\\n", " ")
    return [shlex.split(line.strip())[1:] for line in joined.splitlines()
            if line.strip().startswith("pagedbench ")]


@pytest.mark.parametrize("examples, environ", [
    (["buildkite.yml"], lambda k, n: {"BUILDKITE_PARALLEL_JOB": str(k - 1),
                                      "BUILDKITE_PARALLEL_JOB_COUNT": str(n)}),
    (["slurm-array.sh", "slurm-merge.sh"], lambda k, n: {
        "SLURM_ARRAY_TASK_ID": str(k - 1), "SLURM_ARRAY_TASK_MIN": "0",
        "SLURM_ARRAY_TASK_MAX": str(n - 1), "SLURM_ARRAY_TASK_COUNT": str(n)}),
])
def test_the_ci_examples_run_their_parallel_jobs_as_shards(examples, environ,
                                                            monkeypatch) -> None:
    """Each example's shard command parses with pagedbench's own parser and, in the CI's
    variables of its k-th job of 4 (Buildkite's ``parallelism``, the Slurm ``--array``),
    runs shard k/4; its merge runs report and gate."""
    text = "\n".join((EXAMPLES / name).read_text() for name in examples)
    if examples[0].endswith(".yml"):
        steps = yaml.safe_load(text)["steps"]
        count = next(s for s in steps if s.get("parallelism"))["parallelism"]
        text = "\n".join(c for s in steps for c in s.get("commands", []))
    else:
        count = int(text.split("--array=0-")[1].split()[0]) + 1
    commands = _pagedbench_commands(text)
    benches = [c for c in commands if c[0] == "bench"]
    assert benches and all("auto" in c[c.index("--shard") + 1] for c in benches)
    assert {c[0] for c in commands} >= {"bench", "report", "gate"}
    for k in (1, count):
        for name in [n for _, n, *_ in shard_spec.CI_VARIABLES]:
            monkeypatch.delenv(name, raising=False)
        for name, value in environ(k, count).items():
            monkeypatch.setenv(name, value)
        args = _parser().parse_args(benches[0])
        assert (args.shard.index, args.shard.count) == (k, count)
