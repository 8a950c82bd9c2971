"""The GPU lane's compile warm-up: miniatures keep what compilers specialize on; each
implementation is prepared and run on what it supports, unjudged; one that hangs is
stopped at the budget and recorded, the others' records kept; no process one leaves
outlives its warm-up."""

from __future__ import annotations

import json
import time
from pathlib import Path

from pagedbench.harness.lane import sweep, warmup

from ..conftest import FAULTS

HANGS = "pagedbench.suites.harness.plugins.hangs_at_import:Anything"


def test_miniatures_keep_the_specializations_with_little_memory() -> None:
    """Every point of the CUDA lane: the same block size, dtype, heads and longest context;
    the other sequences short; a pool of at most 256 MiB, with the batch kept where that
    fits and otherwise one Triton specializes alike (a multiple of 16, or 2) or one."""
    kept = 0
    for case in sweep.CUDA_SELECTION.sweep.cases():
        small = warmup.miniature(case)
        assert (small.block_size, small.dtype, small.num_q_heads, small.num_kv_heads,
                small.head_dim, small.kv_lens[0]) == (
            case.block_size, case.dtype, case.num_q_heads, case.num_kv_heads,
            case.head_dim, max(case.kv_lens))
        assert small.kv_lens[1:] == tuple(min(kv, 64) for kv in case.kv_lens[1:small.batch_size])
        assert warmup.pool_bytes(small) <= warmup.MAX_MINIATURE_BYTES or small.batch_size == 1
        if small.batch_size == case.batch_size:
            kept += 1
        else:
            assert small.batch_size in ((16, 1) if case.batch_size % 16 == 0 else (2, 1))
    assert kept >= 40  # every paged point, most contiguous ones


def test_warm_runs_what_it_supports_and_names_what_failed() -> None:
    """In this process, on the CPU: the baseline runs both cases; an unknown module is an
    import error; an implementation unavailable here says why."""
    cases = sweep.CPU_SELECTION.conformance_cases()
    record = warmup.warm("sdpa-contiguous", "pagedbench.adapters.torch_sdpa:SdpaContiguous",
                         "cpu", cases)
    assert (record["status"], record["cases"], record["unsupported"]) == ("ok", 2, 0)
    assert set(record["seconds"]) == {"import", *(c.case_id for c in cases)}
    record = warmup.warm("missing", "not_installed_mod:Adapter", "cpu", cases)
    assert record["status"] == "error" and "ModuleNotFoundError" in record["reason"]
    record = warmup.warm("xformers", "pagedbench.adapters.xformers:XformersSplitK", "cpu", cases)
    assert record["status"] == "unavailable" and record["cases"] == 0 and record["reason"]


def test_one_that_hangs_is_stopped_at_the_budget(tmp_path: Path) -> None:
    """Two at a time at most: the hanging import is stopped at the 2 s budget and
    recorded; the one queued behind it never starts and says so."""
    cases = tmp_path / "cases.json"
    cases.write_text(json.dumps([c.to_dict() for c in sweep.CPU_SELECTION.sweep_cases()]))
    out = tmp_path / "warmup.jsonl"
    records = warmup.warm_all({"hangs": HANGS, "queued": HANGS}, "cpu", cases, out,
                              budget_s=2, parallel=1)
    assert [(r["impl"], r["status"]) for r in records] == [("hangs", "out of budget"),
                                                           ("queued", "out of budget")]
    assert records[0]["reason"] == "stopped at the warm-up's 2 s"
    assert records[1]["reason"] == "not started"
    assert [json.loads(line)["impl"] for line in out.read_text().splitlines()] == [
        "hangs", "queued"]
    assert (tmp_path / "warmup-hangs.log").exists()


def test_no_process_an_implementation_leaves_outlives_its_warm_up(tmp_path: Path,
                                                                   monkeypatch) -> None:
    """``starts-daemons`` starts two ``sleep 600`` per run, one in a new session, one that
    its shell leaves an orphan: its warm-up process kills both before it exits."""
    pid_file = tmp_path / "pids"
    monkeypatch.setenv("PAGEDBENCH_TEST_PID_FILE", str(pid_file))
    cases = tmp_path / "cases.json"
    cases.write_text(json.dumps([c.to_dict() for c in sweep.CPU_SELECTION.conformance_cases()]))
    (record,) = warmup.warm_all({"starts-daemons": FAULTS["starts-daemons"]}, "cpu", cases,
                                tmp_path / "warmup.jsonl", budget_s=120)
    assert record["status"] == "ok", record
    pids = [int(line) for line in pid_file.read_text().split()]
    assert len(pids) == 2 * record["cases"] > 0

    def alive(pid: int) -> bool:
        try:
            return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
        except OSError:
            return False

    deadline = time.monotonic() + 10
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(alive(pid) for pid in pids), pids
