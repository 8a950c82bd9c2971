"""The pytest plugin from an installed package (issue 8, "For CI on GPU runners"):
``pytest --pyargs pagedbench.suites.conformance --impl X`` runs from a wheel installed
outside the checkout, in a folder of its own, and writes nothing beside the installed
files (caches and hypothesis's database go under the working directory's ``build/``)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _tree(folder: Path) -> dict[str, int]:
    """Every file under ``folder`` with its modification time (ns)."""
    return {str(p.relative_to(folder)): p.stat().st_mtime_ns
            for p in folder.rglob("*") if p.is_file()}


@pytest.mark.slow
def test_conformance_runs_from_an_installed_wheel_and_writes_nothing_there(tmp_path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTEST_ADDOPTS")}
    env.update(PIP_NO_INDEX="1", PIP_DISABLE_PIP_VERSION_CHECK="1", TMPDIR=str(tmp_path))
    pip = [sys.executable, "-m", "pip", "--no-cache-dir"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w",
                    str(tmp_path / "dist"), str(ROOT)], env=env, check=True,
                   capture_output=True, cwd=tmp_path)
    (wheel,) = (tmp_path / "dist").glob("pagedbench-*.whl")
    site = tmp_path / "site"
    subprocess.run([*pip, "install", "--no-deps", "--target", str(site), str(wheel)],
                   env=env, check=True, capture_output=True, cwd=tmp_path)
    before = _tree(site)
    work = tmp_path / "elsewhere"
    work.mkdir()
    env["PYTHONPATH"] = str(site)
    located = subprocess.run([sys.executable, "-c", "import pagedbench.suites.plugin as p; "
                              "print(p.__file__)"], env=env, cwd=work, capture_output=True,
                             text=True, check=True)
    assert Path(located.stdout.strip()).is_relative_to(site)  # not the checkout's
    selection = ["--impl", "torch-gather", "--pagedbench-device", "cpu", "-q"]
    proc = subprocess.run([sys.executable, "-m", "pytest", "--pyargs",
                           "pagedbench.suites.conformance", *selection],
                          env=env, cwd=work, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # Every test the checkout's suite has for this selection ran: passed, or skipped where
    # torch-gather declares a case unsupported (a layout it cannot take, for example).
    collected = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-p",
                                "no:cacheprovider", "suites/conformance", *selection],
                               cwd=ROOT, capture_output=True, text=True, timeout=120)
    count = re.search(r"(\d+) tests? collected", collected.stdout)
    assert count, collected.stdout[-2000:] + collected.stderr[-2000:]
    summary = re.search(r"(\d+) passed(?:, (\d+) skipped)? in", proc.stdout)
    assert summary, proc.stdout[-2000:]
    passed, skipped = int(summary.group(1)), int(summary.group(2) or 0)
    assert passed > 0 and passed + skipped == int(count.group(1)), proc.stdout[-2000:]
    assert _tree(site) == before, "the run wrote into the installed package"
    # Whatever the run wrote in its working directory is under build/ (no .pytest_cache,
    # no .hypothesis, no __pycache__).
    written = {p.relative_to(work).parts[0] for p in work.rglob("*") if p.is_file()}
    assert written <= {"build"}, written
    unknown = subprocess.run(
        [sys.executable, "-m", "pytest", "--pyargs", "pagedbench.suites.conformance",
         "--pagedbench-device", "tpu"], env=env, cwd=work, capture_output=True, text=True,
        timeout=120)
    assert unknown.returncode == pytest.ExitCode.USAGE_ERROR
    assert "--pagedbench-device tpu" in unknown.stderr
