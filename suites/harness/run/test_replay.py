"""``pagedbench replay``: a failure's case file, a bare case and a whole result line all
reproduce the verdict; exit 1 on ``fail``; the pytest and runner failure messages end with
the command that replays the case."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pagedbench.adapters import load
from pagedbench.harness import cli
from pagedbench.harness.results.record import Environment, ResultRecord
from pagedbench.harness.results.store import environment
from pagedbench.harness.run import replay
from pagedbench.harness.run.runner import RunConfig, run_target
from pagedbench.harness.verdict import conformance
from pagedbench.reference import PagedCase, PagedValueError
from pagedbench.suites.faults import SITE
from pagedbench.suites.faults.masking import CausalOneAhead

FAULT, FAULT_TARGET = "fault-causal-one-ahead", "pagedbench.suites.faults.masking:CausalOneAhead"
CONTROL_TARGET = "pagedbench.suites.faults.kernel:PagedKernel"
#: A prefill chunk of 2 rows over 7 keys: fault-causal-one-ahead's first row sees key 6.
CASE = PagedCase(kv_lens=(7,), q_lens=(2,), num_q_heads=1, num_kv_heads=1, head_dim=32,
                 block_size=8, dtype="float32", name="replay")


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pagedbench.harness.cli", *args],
                          capture_output=True, text=True, timeout=600, cwd=cwd)


def test_check_message_ends_with_a_replay_command_of_the_same_case(tmp_path, monkeypatch):
    monkeypatch.setenv(replay.REPLAY_DIR_VARIABLE, str(tmp_path))
    with pytest.raises(AssertionError) as failure:
        replay.check(CausalOneAhead(), CASE, "cpu", FAULT)
    last = str(failure.value).splitlines()[-1]
    assert last.startswith("replay: pagedbench replay ") and last.endswith(f"--impl {FAULT}")
    path = Path(last.split()[3])
    assert path.parent == tmp_path
    assert replay.load(path) == replay.Replayable(CASE, None)


def test_load_reads_a_case_a_result_line_and_refuses_the_rest(tmp_path):
    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps(CASE.to_dict()))
    line = tmp_path / "line.json"
    line.write_text(json.dumps({"case": CASE.to_dict(), "impl": FAULT, "status": "fail"}))
    assert replay.load(bare) == replay.Replayable(CASE)
    assert replay.load(line) == replay.Replayable(CASE, FAULT)
    (tmp_path / "list.json").write_text("[1]")
    (tmp_path / "text.json").write_text("kv_lens: 7")
    for name in ("list.json", "text.json", "absent.json"):
        with pytest.raises(PagedValueError, match="CASE"):
            replay.load(tmp_path / name)
    # A results file of two lines, and a case of a bad value: said as such, with the file.
    (tmp_path / "two.jsonl").write_text(line.read_text() + "\n" + line.read_text() + "\n")
    with pytest.raises(PagedValueError, match=r"two\.jsonl holds more than one JSON value "
                                              r"\(line 2 starts another\): a results file\?"):
        replay.load(tmp_path / "two.jsonl")
    (tmp_path / "bad.json").write_text(json.dumps({**CASE.to_dict(), "block_size": 0}))
    with pytest.raises(PagedValueError, match=r"^CASE \S+bad\.json: block_size must be") as bad:
        replay.load(tmp_path / "bad.json")
    assert bad.value.parameter == "block_size"


def test_replay_reproduces_a_failure_from_its_result_line(tmp_path):
    """The runner's ``fail`` record names the replay command; its whole result line,
    replayed without ``--impl``, fails again with exit 1; the bare case passes on the
    control (exit 0)."""
    config = RunConfig(timing=False, cache_dir=tmp_path / "cache", suite="test")
    env = Environment.model_validate(environment("cpu") | {"threads": config.threads})
    records: list[ResultRecord] = []
    run_target(FAULT, FAULT_TARGET, [CASE], config, "r", env, records.append)
    (record,) = records
    assert str(record.status) == "fail" and "replay: pagedbench replay " in record.reason
    line = tmp_path / "line.json"
    line.write_text(record.model_dump_json() + "\n")

    failed = _cli("replay", str(line), "--cache-dir", str(tmp_path / "cache"), cwd=tmp_path)
    assert failed.returncode == 1, failed.stdout + failed.stderr
    assert f"{FAULT} on {CASE.case_id} (cpu): fail" in failed.stdout
    assert "max_err_ulps" in failed.stdout and "flashinfer-ai/flashinfer#348" in failed.stdout

    bare = Path(record.reason.rsplit("pagedbench replay ", 1)[1].split()[0])
    assert replay.load(bare).case == CASE
    assert str(conformance.check(load(CONTROL_TARGET), CASE, "cpu").status) == "pass"


def test_replay_of_a_bare_case_needs_an_implementation(tmp_path, capsys):
    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps(CASE.to_dict()))
    saved = dict(os.environ)  # main() sets the cache variables of the process
    try:
        assert cli.main(["replay", str(bare), "--cache-dir", str(tmp_path)]) == 2
    finally:
        os.environ.clear()
        os.environ.update(saved)
    assert "--impl NAME is needed" in capsys.readouterr().err


def test_the_catalogue_is_not_registered_unless_named():
    """Importing the harness leaves the fault catalogue off the path: no fault shows up
    among the implementations a plain run would check."""
    from pagedbench.adapters import entries

    assert str(SITE) not in sys.path
    assert not [e.name for e in entries() if e.name.startswith("fault-")]
    assert load(CONTROL_TARGET).name == "catalogue-control"
