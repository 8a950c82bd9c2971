"""The fault catalogue is what it claims: registered through entry points, exact on
everyday inputs, and every fault caught in the ``ci`` profile (``pagedbench selftest
--first-catch``: pinned properties first, each fault checked until its first catch, a few
minutes in all) within 60 s: by the conformance suite with a shrunk case small enough to
read, and, for a fault that keeps state across calls of one pool, by the serving loop
alone (``suites/serving``), which proves what the loop adds."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from importlib.metadata import distributions
from pathlib import Path

import pytest
import torch

from pagedbench.adapters import ENTRY_POINT_GROUP, load
from pagedbench.harness.run import selftest
from pagedbench.harness.verdict import conformance
from pagedbench.reference import PagedCase

from pagedbench.suites import plugin
from pagedbench.suites.faults import SITE
from pagedbench.suites.faults.kernel import FAULT_LOG, PagedKernel

ENTRY_POINTS = {ep.name: ep.value for dist in distributions(path=[str(SITE)])
                for ep in dist.entry_points if ep.group == ENTRY_POINT_GROUP}
FAULTS = sorted(n for n in ENTRY_POINTS if n != selftest.CONTROL)
#: Cases a serving engine sends every step: none is the trigger of every fault.
EVERYDAY = (
    PagedCase(kv_lens=(32, 48), num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16,
              dtype="float32", name="everyday-decode"),
    PagedCase(kv_lens=(16, 64), num_q_heads=8, num_kv_heads=8, head_dim=128,
              block_size=16, dtype="bfloat16", name="everyday-mha"),
    PagedCase(kv_lens=(16, 32), q_lens=(16, 32), num_q_heads=4, num_kv_heads=1, head_dim=64,
              block_size=16, dtype="float32", name="everyday-prompts"),
)
#: Bounds on a fault's shrunk case: a batch and a case id a reader takes in at a glance
#: (the batch at least the fault's ``trigger_batch``).
MAX_SHRUNK_BATCH, MAX_SHRUNK_ID = 8, 80
MAX_SECONDS = 60.0
#: The per-call property whose timed calls reuse one pool, new values written into it.
TIMED_PROPERTY = "test_timed_calls_are_the_judged_calls"




def test_every_kernel_class_is_registered_once() -> None:
    """entry_points.txt names every PagedKernel subclass of the catalogue by its
    ``name``, and nothing else."""
    classes = {}
    for module in ("kernel", "addressing", "masking", "numerics", "lifecycle", "timing"):
        tree = ast.parse((Path(__file__).parent / f"{module}.py").read_text())
        for node in tree.body:
            if isinstance(node, ast.ClassDef) and node.name not in ("State", "PoolState"):
                classes[f"pagedbench.suites.faults.{module}:{node.name}"] = node.name
    assert sorted(ENTRY_POINTS.values()) == sorted(classes)
    for name, target in ENTRY_POINTS.items():
        adapter = load(target)
        assert isinstance(adapter, PagedKernel) and adapter.name == name
        if name != selftest.CONTROL:
            assert adapter.imitates and adapter.imitates in type(adapter).__doc__, name


@pytest.mark.parametrize("fault", FAULTS)
def test_fault_is_exact_on_everyday_inputs(fault, tmp_path, monkeypatch) -> None:
    """On every everyday case where the fault's faulty branch does not run (at least
    one), its output is the control's, bit for bit."""
    log = tmp_path / "fired.log"
    monkeypatch.setenv(FAULT_LOG, str(log))
    control, adapter = load(ENTRY_POINTS[selftest.CONTROL]), load(ENTRY_POINTS[fault])
    quiet = 0
    for case in EVERYDAY:
        inputs = conformance.inputs_for(adapter, case, "cpu")
        out = adapter.run(adapter.prepare(inputs))
        if adapter.output_exact:  # fires everywhere, beside an output that is exact
            assert torch.equal(out, control.run(control.prepare(inputs))), (fault, case.case_id)
            quiet += 1
            continue
        if log.exists():  # fired on this case: not everyday for this fault
            log.unlink()
            adapter._logged = False
            continue
        quiet += 1
        assert torch.equal(out, control.run(control.prepare(inputs))), (fault, case.case_id)
    assert quiet, f"{fault} fires on every everyday case"


@pytest.fixture(scope="module")
def selftest_rows(tmp_path_factory, pytestconfig) -> dict[str, dict]:
    """``pagedbench selftest`` in the ci profile, with this session's search seconds
    (``--pagedbench-search-seconds``, as ``make test`` passes), its rows by implementation."""
    out = tmp_path_factory.mktemp("selftest")
    seconds = plugin.search_seconds(pytestconfig)
    proc = subprocess.run(
        [sys.executable, "-m", "pagedbench.harness.cli", "selftest", "--first-catch", "--json",
         str(out / "rows.json"), "--output-dir", str(out / "run"),
         *([] if seconds is None else ["--search-seconds", str(seconds)])],
        capture_output=True, text=True, timeout=1800)
    assert proc.returncode in (0, 1), proc.stdout + proc.stderr
    rows = {r["name"]: r for r in json.loads((out / "rows.json").read_text())}
    for name, row in rows.items():  # the table names every fault and its report
        assert name in proc.stdout and (row["imitates"] or "-") in proc.stdout
    # Exit 0 exactly when the control passes both suites and each fault is caught: by the
    # loop when it keeps state across calls, else by either suite.
    assert (proc.returncode == 0) == all(
        (r["verdict"], r["loop_verdict"]) == ("passed", "passed") if r["name"] == selftest.CONTROL
        else r["loop_verdict"] == "caught" or (r["verdict"] == "caught" and not r["keeps_state"])
        for r in rows.values())
    caught = re.search(r"(\d+) of (\d+) faults caught \((\d+) by the per-call suite, (\d+) by "
                       r"the serving loop", proc.stdout)
    faults = [r for r in rows.values() if r["name"] != selftest.CONTROL]
    assert caught and [int(n) for n in caught.groups()] == [
        sum(r["loop_verdict"] == "caught" or (r["verdict"] == "caught" and not r["keeps_state"])
            for r in faults), len(faults), sum(r["verdict"] == "caught" for r in faults),
        sum(r["loop_verdict"] == "caught" for r in faults)], proc.stdout[-500:]
    return rows


def test_selftest_control_passes(selftest_rows) -> None:
    assert selftest_rows[selftest.CONTROL]["verdict"] == "passed", selftest_rows[selftest.CONTROL]


def test_selftest_control_passes_the_loop(selftest_rows) -> None:
    assert selftest_rows[selftest.CONTROL]["loop_verdict"] == "passed", \
        selftest_rows[selftest.CONTROL]


@pytest.mark.parametrize("fault", FAULTS)
def test_selftest_catches_fault(selftest_rows, fault) -> None:
    """A fault that keeps state across calls is caught by the serving loop, and by no
    property of the per-call suite but the one that rewrites a pool in place between the
    timed calls of one prepared case (the suite's only second call on one pool); every
    other fault by the per-call suite, with a small shrunk case."""
    row = selftest_rows[fault]
    assert row["seconds"] < MAX_SECONDS, row
    if row["keeps_state"]:
        assert row["loop_verdict"] == "caught", row
        assert row["verdict"] == "missed" or row["properties"] == [TIMED_PROPERTY], row
        assert row["loop_trace"].startswith("pagedbench replay "), row
        return
    assert row["verdict"] == "caught", row
    case = PagedCase.from_dict(row["case"])
    bound = max(MAX_SHRUNK_BATCH, type(load(ENTRY_POINTS[fault])).trigger_batch)
    assert case.batch_size <= bound and len(case.case_id) <= MAX_SHRUNK_ID, row
