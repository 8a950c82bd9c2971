"""pytest-xdist's workers each get a temp folder and a GPU of their own from the plugin
(suites/plugin.py), and the GPU a worker takes follows its index
(harness/run/devices.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pagedbench.harness.run.devices import visible_gpus, xdist_worker_gpu

#: A test every worker runs (``--dist each``): it writes what its worker was given.
PROBE = '''
import json, os, tempfile
from pathlib import Path

def test_worker_environment():
    worker = os.environ["PYTEST_XDIST_WORKER"]
    seen = {"CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "tempdir": tempfile.gettempdir()}
    (Path(os.environ["PROBE_OUT"]) / worker).write_text(json.dumps(seen))
'''


@pytest.mark.parametrize(("worker_id", "gpus", "expected"), [
    ("gw0", ["0", "1", "2"], "0"),
    ("gw4", ["0", "1", "2"], "1"),  # more workers than GPUs: 4 mod 3
    ("gw1", ["GPU-aa", "GPU-bb"], "GPU-bb"),
    ("gw7", [], None),
])
def test_a_worker_takes_the_gpu_of_its_index(worker_id, gpus, expected) -> None:
    assert xdist_worker_gpu(worker_id, gpus) == expected


def test_a_worker_id_pytest_xdist_does_not_make_is_refused() -> None:
    with pytest.raises(ValueError, match="worker_id 'main': expected gw<N>"):
        xdist_worker_gpu("main", ["0"])


def test_cuda_visible_devices_when_set_wins_over_nvidia_smi() -> None:
    asked = lambda: ["0", "1", "2", "3"]  # noqa: E731
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "2, 3"}, asked) == ["2", "3"]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": ""}, asked) == []
    assert visible_gpus({}, asked) == ["0", "1", "2", "3"]


def test_two_workers_get_their_own_gpu_and_temp_folder(tmp_path: Path) -> None:
    """``pytest -n 2`` on a machine whose ``nvidia-smi`` lists two GPUs (a stand-in
    script first on ``PATH``): worker gw0 sees GPU 0 and gw1 GPU 1, each under a temp
    folder of its own inside the session's."""
    bin_dir, out, scratch = tmp_path / "bin", tmp_path / "out", tmp_path / "tmp"
    for folder in (bin_dir, out, scratch):
        folder.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text("#!/bin/sh\nprintf '0\\n1\\n'\n")
    smi.chmod(0o755)
    (tmp_path / "test_probe.py").write_text(PROBE)
    env = {k: v for k, v in os.environ.items()
           if k not in ("CUDA_VISIBLE_DEVICES", "PYTEST_ADDOPTS")
           and not k.startswith("PYTEST_XDIST_")}
    env |= {"PATH": f"{bin_dir}{os.pathsep}{env['PATH']}", "TMPDIR": str(scratch),
            "PROBE_OUT": str(out)}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-n", "2", "--dist", "each", "-q", "-p",
         "no:cacheprovider", "--pagedbench-device", "cpu", "--pagedbench-cache-dir",
         str(tmp_path / "build"), "test_probe.py"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    seen = {worker.name: json.loads(worker.read_text()) for worker in out.iterdir()}
    assert seen == {
        "gw0": {"CUDA_VISIBLE_DEVICES": "0", "tempdir": str(scratch / "xdist-gw0")},
        "gw1": {"CUDA_VISIBLE_DEVICES": "1", "tempdir": str(scratch / "xdist-gw1")},
    }
