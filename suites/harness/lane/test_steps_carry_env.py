"""What scripts/gpu_lane.sh hands the lane from its carry: the vllm-triton folder in
``PAGEDBENCH_VLLM_TRITON_CARRY`` (only when the carry has one), the carried wheels'
scripts (FlashInfer's ninja) first on ``PATH``, FlashInfer's JIT cache under build/, its
modules compiled ahead of time where FlashInfer loads them; and the arguments it passes
on.

``PYTHON`` is a stand-in that records its environment and succeeds, so the script's
own logic runs in milliseconds (the full CPU rehearsal is suites/harness/lane/test_steps.py).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from pagedbench.adapters.vllm_triton_carry import CARRY_ENV
from pagedbench.harness.lane.steps import ROOT

FAKE_SHA = "0123456789abcdef0123456789abcdef01234567"


def lane_environment(tmp_path: Path, carry: Path) -> dict[str, str]:
    """The environment the lane's python gets from scripts/gpu_lane.sh with ``carry``."""
    record = tmp_path / "env.txt"
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\nenv -0 > "{record}"\nexit 0\n')
    python.chmod(0o755)
    env = {k: v for k, v in os.environ.items()
           if k not in (CARRY_ENV, "FLASHINFER_WORKSPACE_BASE")}
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_lane.sh"), "--out",
                           str(tmp_path / "out"), "--git-sha", FAKE_SHA, "--dirty", "0",
                           "--carry", str(carry)],
                          env=env | {"PYTHON": str(python)}, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    return dict(line.split("=", 1) for line in record.read_text().split("\0") if "=" in line)


@pytest.mark.parametrize("with_vllm_triton", [True, False])
def test_lane_names_the_carried_vllm_triton_folder(tmp_path: Path,
                                                  with_vllm_triton: bool) -> None:
    carry = tmp_path / "carry"
    carry.mkdir()
    if with_vllm_triton:
        (carry / "vllm-triton").mkdir()
    env = lane_environment(tmp_path, carry)
    if with_vllm_triton:
        assert env[CARRY_ENV] == str((carry / "vllm-triton").resolve())
    else:
        assert CARRY_ENV not in env
    build = ROOT / "build"
    assert env["PATH"].split(os.pathsep)[0] == str(build / "gpu-site" / "bin")
    assert env["FLASHINFER_WORKSPACE_BASE"] == str(build)


def test_lane_forwards_impl_and_points_and_its_start(tmp_path: Path) -> None:
    """``--impl`` and ``--points`` reach the lane's steps, with the launcher's start time
    (its setup counts against the lane's budget); anything else is refused."""
    args = tmp_path / "args.txt"
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" > "{args}"\nexit 0\n')
    python.chmod(0o755)
    launcher = ["bash", str(ROOT / "scripts" / "gpu_lane.sh"), "--out", str(tmp_path / "out"),
                "--git-sha", FAKE_SHA, "--dirty", "0", "--carry", str(tmp_path / "none")]
    before = time.time()
    done = subprocess.run([*launcher, "--impl", "flashinfer-nhd", "--points", "3", "--impl",
                           "xformers"], env=os.environ | {"PYTHON": str(python)},
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    passed = args.read_text().splitlines()
    assert passed[:2] == ["-m", "pagedbench.harness.lane.steps"]
    assert passed[-6:] == ["--impl", "flashinfer-nhd", "--points", "3", "--impl", "xformers"]
    started = float(passed[passed.index("--started-at") + 1])
    assert before - 2 <= started <= time.time()
    done = subprocess.run([*launcher, "--shard", "1/2"], env=os.environ | {"PYTHON": str(python)},
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "unknown argument '--shard'" in done.stderr


def test_lane_puts_the_carried_flashinfer_modules_where_flashinfer_loads_them(
        tmp_path: Path) -> None:
    """A copy of the launcher in a checkout of its own: the carry's
    ``flashinfer-aot/<name>/`` folders land in the installed package's ``data/aot/``."""
    checkout = tmp_path / "checkout"
    (checkout / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "gpu_lane.sh", checkout / "scripts" / "gpu_lane.sh")
    site = checkout / "build" / "gpu-site"
    (site / "flashinfer").mkdir(parents=True)
    module = tmp_path / "carry" / "flashinfer-aot" / "batch_decode_x"
    module.mkdir(parents=True)
    (module / "batch_decode_x.so").write_bytes(b"\x7fELF module")
    python = tmp_path / "python"
    python.write_text("#!/bin/sh\nexit 0\n")
    python.chmod(0o755)
    done = subprocess.run(["bash", str(checkout / "scripts" / "gpu_lane.sh"), "--out",
                           str(tmp_path / "out"), "--git-sha", FAKE_SHA, "--dirty", "0",
                           "--carry", str(tmp_path / "carry")],
                          env=os.environ | {"PYTHON": str(python)}, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    loaded = site / "flashinfer" / "data" / "aot" / "batch_decode_x" / "batch_decode_x.so"
    assert loaded.read_bytes() == b"\x7fELF module"
