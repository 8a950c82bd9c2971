"""``--devices`` (harness/run/spread.py): one worker per device at once, pairs handed out as
devices free up, each result naming its device; on the CPU ``cpu:N`` exercises the same
code path as a node's GPUs. The verdicts must be those of one worker at a time, a fault of
one implementation must cost nobody else's results, and a signal must stop every worker
without recording what their killing made of the cases in flight."""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import pytest

from pagedbench.harness.cli import main
from pagedbench.harness.measure.timing import oversubscribed
from pagedbench.harness.results.record import ResultRecord, RunRecord
from pagedbench.harness.results.store import ResultsFile, read_lines
from pagedbench.harness.run.config import RunConfig
from pagedbench.harness.run.protocol import Cancelled, Supervisor
from pagedbench.harness.run.runner import Interrupted, make_plan, missing, run
from pagedbench.harness.verdict.messages import JOB_STEPS
from pagedbench.harness.run.config import check_devices
from pagedbench.harness.run.spread import DeviceSlot, device_slots
from pagedbench.reference import PagedCase, PagedValueError

from ..conftest import BROKEN, FAULTS

CASES = [PagedCase(kv_lens=(16 * n + 3,), num_q_heads=4, num_kv_heads=2, head_dim=32,
                   block_size=16, dtype="float32", name=f"s{n}") for n in range(1, 6)]
#: A correct implementation, a wrong one, one that dies at import.
IMPLS = {"torch-gather": "pagedbench.adapters.torch_sdpa:TorchGather",
         "reads-past": FAULTS["reads-past"],
         "segfaults-at-import": FAULTS["segfaults-at-import"]}


def _run(tmp_path: Path, name: str, devices: str, impls=IMPLS) -> list[ResultRecord]:
    config = RunConfig(timing=False, cache_dir=tmp_path / "cache", devices=devices)
    return run(make_plan(impls, CASES), config, ResultsFile(tmp_path / f"{name}.jsonl"), name)


def test_cpu_workers_give_the_verdicts_of_one_worker_and_name_their_slot(tmp_path) -> None:
    one = _run(tmp_path, "one", "")
    two = _run(tmp_path, "two", "cpu:2")
    verdicts = {(r.impl, r.case_id): r.status for r in one}
    assert len(verdicts) == len(IMPLS) * len(CASES) == len(two)
    assert {(r.impl, r.case_id): r.status for r in two} == verdicts
    assert {impl: status for (impl, _), status in verdicts.items()
            if impl != "reads-past"} == {"torch-gather": "pass", "segfaults-at-import": "crash"}
    assert "fail" in {verdicts["reads-past", c.case_id] for c in CASES}
    assert {r.env.device_index for r in one} == {None}
    # each implementation's cases were dealt to both workers, and each says where it ran
    for impl in IMPLS:
        assert {r.env.device_index for r in two if r.impl == impl} == {"0", "1"}
    assert {r.env.device_uuid for r in two} == {None}
    started = [line for line in read_lines([tmp_path / "two.jsonl"])
               if isinstance(line, RunRecord) and line.event == "started"]
    assert started[0].config["devices"] == "cpu:2"


def test_the_cli_spreads_a_bench_over_cpu_workers(tmp_path, capsys) -> None:
    code = main(["bench", "--quick", "--workload", "decode-*", "--impl", "torch-gather",
                 "--no-peaks", "--devices", "cpu:2", "--results-dir", str(tmp_path),
                 "--cache-dir", str(tmp_path / "cache")])
    assert code == 0, capsys.readouterr().out
    results = [r for r in read_lines(list(tmp_path.glob("*.jsonl")))
               if isinstance(r, ResultRecord)]
    assert results and all(r.status == "pass" for r in results)
    assert {r.env.device_index for r in results} == {"0", "1"}


@pytest.mark.parametrize("devices,device,why", [
    ("cpu:0", "cpu", "cpu:N, N from 1"), ("cpu:257", "cpu", "N from 1 to 256"),
    ("all", "cpu", "must be cpu:N"), ("0,1", "cpu", "must be cpu:N"),
    ("cpu:2", "cuda", "distinct GPU indices"), ("0,0", "cuda", "distinct"),
    ("0;1", "cuda", "comma-separated"), ("0", "cuda:1", "use --device cuda"),
    (2, "cpu", "'cpu:N'"),
])
def test_devices_that_do_not_fit_the_device_are_refused_by_name(devices, device, why) -> None:
    with pytest.raises(PagedValueError, match="--devices") as raised:
        check_devices(devices, device)
    assert why in str(raised.value)
    with pytest.raises(PagedValueError, match="--devices"):
        RunConfig(device=device, devices=devices)


def test_gpu_slots_pin_each_worker_and_judge_on_the_same_gpu() -> None:
    gpus = ["2", "3", "GPU-77ab"]  # the parent's CUDA_VISIBLE_DEVICES
    pci = {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    slots = device_slots("all", "cuda", gpus, {"2": "GPU-aa", "3": "GPU-bb"}, pci)
    assert slots == [DeviceSlot("cuda", "cuda:0", "2", "GPU-aa", "2"),
                     DeviceSlot("cuda", "cuda:1", "3", "GPU-bb", "3"),
                     DeviceSlot("cuda", "cuda:2", "GPU-77ab", "GPU-77ab", "GPU-77ab")]
    assert slots[1].environment() == {"CUDA_VISIBLE_DEVICES": "3"}
    assert device_slots("3", "cuda", gpus, {"3": "GPU-bb"}, pci) == [slots[1]]
    # without PCI order nvidia-smi's index need not be CUDA's: no UUID is guessed
    assert device_slots("3", "cuda", gpus, {"3": "GPU-bb"}, {})[0].uuid is None
    with pytest.raises(PagedValueError, match=r"\['5'\] not among"):
        device_slots("2,5", "cuda", gpus, {}, pci)
    with pytest.raises(PagedValueError, match="may use no GPU"):
        device_slots("all", "cuda", [], {}, pci)
    assert [s.judge_device for s in device_slots("cpu:3", "cpu")] == ["cpu"] * 3
    assert device_slots("", "cuda") == []


def test_a_cancelled_supervisor_starts_no_worker() -> None:
    supervisor = Supervisor({"kind": "list", "device": "cpu", "entries": []}, dict(os.environ),
                            {"impl": 5.0}, JOB_STEPS["evaluate"])
    supervisor.cancel()
    with pytest.raises(Cancelled):
        supervisor.run(lambda message: None)


def test_a_signal_stops_every_worker_and_records_nothing_they_did_not_finish(tmp_path) -> None:
    impls = {"hangs-in-run": FAULTS["hangs-in-run"], "hangs-at-import": FAULTS["hangs-at-import"]}
    plan = make_plan(impls, CASES[:2])
    results = ResultsFile(tmp_path / "r.jsonl")
    config = RunConfig(timing=False, cache_dir=tmp_path / "cache", devices="cpu:2",
                       case_timeout_s=120)
    timer = threading.Timer(8.0, os.kill, (os.getpid(), signal.SIGTERM))
    timer.start()
    try:
        with pytest.raises(Interrupted):
            run(plan, config, results, "r")
    finally:
        timer.cancel()
    lines = list(read_lines([results.path]))
    assert [line.event for line in lines if isinstance(line, RunRecord)] == \
        ["started", "interrupted"]
    assert not [line for line in lines if isinstance(line, ResultRecord)]  # no "crash"
    assert len(missing(plan, [])) == 4
    # None left running (a thread that has ended may still be listed for a moment: seen
    # once as "<Thread(devices-0, stopped daemon ...)>" in a fresh-clone make test).
    assert not [t for t in threading.enumerate()
                if t.name.startswith("devices-") and t.is_alive()]


@pytest.mark.nightly  # one worker: end_to_end/test_plugin_isolation
def test_an_implementation_that_kills_its_worker_costs_only_its_own_cases(tmp_path) -> None:
    impls = {"torch-gather": IMPLS["torch-gather"], "os-exits": FAULTS["os-exits-at-import"],
             "reads-past": f"{BROKEN}:ReadsPastKvLen"}
    records = _run(tmp_path, "faults", "cpu:3", impls)
    assert {r.impl: r.status for r in records if r.impl != "os-exits"} == \
        {"torch-gather": "pass", "reads-past": "fail"}
    assert len(records) == 15


def test_cpu_workers_that_exceed_the_cores_are_warned_of() -> None:
    assert oversubscribed(2, load=0.0, cores=2, workers=2) == ""  # one thread per core
    warning = oversubscribed(4, load=0.5, cores=2, workers=2)
    assert "--devices cpu:2 with --threads 2" in warning and "2 cores" in warning
