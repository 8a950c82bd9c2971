"""Workers die with their parent, whatever signal ends it, leave no file behind, and hold
only the environment they need; processes an implementation starts in a new session die with
its worker; a run killed with SIGKILL and resumed gives the verdicts of an uninterrupted run
without redoing finished pairs; a signal while the judge computes still exits 128 + its
number."""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from pagedbench.harness.results.record import Environment, ResultRecord, RunRecord
from pagedbench.harness.results.report import markdown
from pagedbench.harness.results.store import environment, read_lines
from pagedbench.harness.run.environment import cache_environment
from pagedbench.harness.run.runner import RunConfig, run_target
from pagedbench.harness.verdict.status import ExitCode, Status
from pagedbench.harness.verdict.truth import cache_path
from pagedbench.reference import PagedCase

from ..conftest import FAULTS, RunsCode, workers_of

CLI = [sys.executable, "-m", "pagedbench.harness.cli"]
ONE_PRESET = ["--preset", "llama3.1-70b-tp8", "--block-size", "16", "--no-timing"]


def _wait_for(condition, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = condition()
        if found:
            return found
        time.sleep(0.2)
    raise AssertionError(f"gave up waiting for {what} after {timeout_s} s")


def _results(folder: Path) -> list[ResultRecord]:
    files = list(folder.glob("*.jsonl"))
    return [r for r in read_lines(files) if isinstance(r, ResultRecord)] if files else []


@pytest.mark.parametrize("signum", [signal.SIGTERM,
                                    pytest.param(signal.SIGINT, marks=pytest.mark.nightly),
                                    signal.SIGKILL],
                         ids=lambda s: signal.Signals(s).name)
def test_no_worker_survives_its_parent(signum, tmp_path, plugin_env) -> None:
    cache = tmp_path / "build"
    scratch = Path(cache_environment(cache, plugin_env)["TMPDIR"])  # the workers' TMPDIR
    started = time.time()
    parent = subprocess.Popen(
        [*CLI, "run", *ONE_PRESET, "--impl", "hangs-in-run", "--results-dir",
         str(tmp_path / "r"), "--cache-dir", str(cache)],
        env=plugin_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        # The truth of the first case is cached just before its run() (which hangs).
        _wait_for(lambda: list((cache / "truth").glob("*.npz")), 240, "the worker's run")
        (worker,) = workers_of(parent.pid)
        parent.send_signal(signum)
        out, err = parent.communicate(timeout=60)
    finally:
        parent.kill()
    expected = -signal.SIGKILL if signum == signal.SIGKILL else 128 + signum
    assert parent.returncode == expected, err
    _wait_for(lambda: not workers_of(parent.pid), 10, f"worker {worker} to die")
    if signum != signal.SIGKILL:
        assert "pagedbench run --resume" in out
    assert not [p.name for p in scratch.glob("job-*") if p.stat().st_mtime >= started]


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_processes_an_implementation_starts_die_with_its_worker(tmp_path, monkeypatch) -> None:
    pid_file = tmp_path / "pids"
    monkeypatch.setenv("PAGEDBENCH_TEST_PID_FILE", str(pid_file))
    config = RunConfig(timing=False, cache_dir=tmp_path / "build", threads=1)
    env = Environment.model_validate(environment("cpu"))
    records: list[ResultRecord] = []
    case = PagedCase(kv_lens=(5,), num_q_heads=2, num_kv_heads=1, head_dim=16,
                     block_size=8, dtype="float32", name="daemons")
    run_target("starts-daemons", FAULTS["starts-daemons"], [case], config, "t", env,
               records.append)
    assert [r.status for r in records] == [Status.PASS], records[0].reason
    pids = [int(line) for line in pid_file.read_text().split()]
    assert len(pids) == 2
    _wait_for(lambda: not any(_alive(pid) for pid in pids), 10, f"{pids} to die")


def test_sigkill_then_resume_finishes_the_run_with_the_uninterrupted_verdicts(
        tmp_path, plugin_env) -> None:
    """Killed while ``slow-correct`` works on its second case: resuming keeps the three
    results on disk, runs the rest, and every pair ends with the verdict an uninterrupted
    run gives it (torch-gather and slow-correct pass, reads-past fails: see
    test_broken_adapters_fail.py); no pair is recorded twice."""
    results = tmp_path / "r"
    common = ["--results-dir", str(results), "--cache-dir", str(tmp_path / "build")]
    parent = subprocess.Popen(
        [*CLI, "run", *ONE_PRESET, "--impl", "torch-gather", "--impl", "slow-correct",
         "--impl", "reads-past", *common],
        env=plugin_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(lambda: len(_results(results)) >= 3, 240, "three results")
        parent.send_signal(signal.SIGKILL)
        parent.wait(timeout=30)
    finally:
        parent.kill()
    _wait_for(lambda: not workers_of(parent.pid), 10, "the worker to die")
    (jsonl,) = results.glob("*.jsonl")
    before = _results(results)
    assert (f"Unfinished run {jsonl.stem}: {len(before)} of 6 results"
            in markdown(list(read_lines([jsonl]))))

    resumed = subprocess.run([*CLI, "run", "--resume", jsonl.stem, *common], env=plugin_env,
                             capture_output=True, text=True, timeout=600)
    assert resumed.returncode == ExitCode.CONFORMANCE_FAILURE, resumed.stdout + resumed.stderr
    after = _results(results)
    assert after[: len(before)] == before
    pairs = Counter((r.impl, r.case_id) for r in after)
    assert set(pairs.values()) == {1} and len(pairs) == 6
    assert {r.impl: r.status for r in after} == {
        "torch-gather": Status.PASS, "slow-correct": Status.PASS, "reads-past": Status.FAIL}
    assert len({r.status for r in after if r.impl == "reads-past"}) == 1
    assert "Unfinished" not in markdown(list(read_lines([jsonl])))


def test_worker_environment_is_what_it_needs_and_a_planted_truth_never_runs(
        tmp_path, monkeypatch) -> None:
    """The worker gets PATH and the caches, not a credential of the parent nor
    TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD; with that variable set, a pickle planted where the
    truth is cached is replaced, never executed."""
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "do-not-leak")
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    case = PagedCase(kv_lens=(5, 17), num_q_heads=4, num_kv_heads=2, head_dim=32,
                     block_size=16, dtype="float32", name="env")
    marker = tmp_path / "pwned"
    pickle.loads(pickle.dumps(RunsCode(tmp_path / "proof")))  # the plant does run code
    assert (tmp_path / "proof").is_dir()
    planted = cache_path(case, tmp_path / "build")
    planted.parent.mkdir(parents=True)
    planted.write_bytes(pickle.dumps({"truth": RunsCode(marker)}))
    config = RunConfig(timing=False, cache_dir=tmp_path / "build", threads=1)
    env = Environment.model_validate(environment("cpu"))
    records: list[ResultRecord] = []
    run_target("reports-environment", FAULTS["reports-environment"], [case], config, "t", env,
               records.append)
    (record,) = records
    assert record.status is Status.PASS, record.reason
    names = set(record.impl_details["environment"])
    assert {"PATH", "TRITON_INTERPRET", "TMPDIR", "TRITON_CACHE_DIR"} <= names
    assert not names & {"AWS_SECRET_ACCESS_KEY", "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"}
    assert not marker.exists()
    assert planted.read_bytes()[:2] == b"PK"  # replaced by a valid .npz (a zip)


#: A ``sitecustomize`` that makes the judge's truth a 30 s torch loop in the ``pagedbench``
#: process (not in its workers, which never import the run command), touching ``MARKER``
#: when it begins.
SLOW_TRUTH = '''
import importlib.abc, os, sys, time

class _Hook(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "pagedbench.harness.cli.run":
            sys.meta_path.remove(self)
            from pathlib import Path
            import torch
            from pagedbench.harness.run import runner
            truth_for = runner.truth_for

            def slow(*args, **kwargs):
                Path(os.environ["MARKER"]).touch()
                x, end = torch.randn(256, 256, dtype=torch.float64), time.monotonic() + 30
                while time.monotonic() < end:
                    x = (x @ x).tanh()
                return truth_for(*args, **kwargs)

            runner.truth_for = slow

sys.meta_path.insert(0, _Hook())
'''


def test_a_signal_while_the_judge_computes_exits_128_plus_its_number(tmp_path) -> None:
    """SIGINT while the judge's thread is inside torch: the run records ``interrupted``
    with exit code 130 and the process exits 130, its message printed (the interpreter's
    exit tore torch down under that thread: ``terminate called``, exit 134)."""
    site, marker = tmp_path / "site", tmp_path / "truth-began"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SLOW_TRUTH)
    env = {**os.environ, "PYTHONPATH": str(site), "MARKER": str(marker)}
    parent = subprocess.Popen(
        [*CLI, "run", *ONE_PRESET, "--impl", "torch-gather", "--results-dir",
         str(tmp_path / "r"), "--cache-dir", str(tmp_path / "build")],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(marker.exists, 120, "the judge's first truth")
        parent.send_signal(signal.SIGINT)
        out, err = parent.communicate(timeout=60)
    finally:
        parent.kill()
    assert parent.returncode == 128 + signal.SIGINT, (parent.returncode, err[-2000:])
    assert "terminate called" not in err and "interrupted by SIGINT" in out + err
    (jsonl,) = (tmp_path / "r").glob("*.jsonl")
    (stop,) = [line for line in read_lines([jsonl])
               if isinstance(line, RunRecord) and line.event == "interrupted"]
    assert stop.exit_code == 128 + signal.SIGINT
