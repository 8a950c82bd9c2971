"""What scripts/gpu_lane.sh hands the lane from its carry: the vllm-triton folder in
``PAGEDBENCH_VLLM_TRITON_CARRY`` (only when the carry has one), the carried wheels'
scripts (FlashInfer's ninja) first on ``PATH``, and FlashInfer's JIT cache under build/.

``PYTHON`` is a stand-in that records its environment and succeeds, so the script's
own logic runs in milliseconds (the full CPU rehearsal is suites/harness/test_gpu_lane.py).
"""

from __future__ import annotations

import os
import subprocess
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
