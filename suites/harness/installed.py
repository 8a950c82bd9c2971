"""A fresh virtual environment holding pagedbench's wheel and a user's adapter package,
as a CI runner installs them (``suites/harness/end_to_end/test_installed_plugin.py`` and
``test_ci_workflow.py``).

The dependencies come from this interpreter's site-packages, linked into a folder of
their own without pagedbench (and, for an environment with its own pytest, without
pytest and its plug-ins): nothing is downloaded.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

#: The checkout whose wheel is installed.
ROOT = Path(__file__).resolve().parents[2]
#: What a user's out-of-tree kernel package looks like: its own distribution registering
#: two implementations through the ``pagedbench.adapters`` entry points. ``mine`` gathers
#: through the block table (pagedbench's torch-gather); ``mine-broken`` returns it 2% too
#: large, a numerical fault the suite must catch.
USER_PACKAGE = {
    "pyproject.toml": """\
[build-system]
requires = ["setuptools>=69"]
build-backend = "setuptools.build_meta"

[project]
name = "mykernel"
version = "1.0"

[project.entry-points."pagedbench.adapters"]
mine = "mykernel:Mine"
mine-broken = "mykernel:MineBroken"
""",
    "mykernel.py": """\
from pagedbench.adapters.torch_sdpa import TorchGather


class Mine(TorchGather):
    name = "mine"


class MineBroken(TorchGather):
    name = "mine-broken"

    def run(self, prepared):
        return prepared.launch() * 1.02
""",
}
#: Host folders a fresh environment does not get: pagedbench itself (the wheel brings
#: it) and, where an environment brings its own pytest, pytest and its plug-ins.
PAGEDBENCH_ENTRIES = ("pagedbench", "__editable__")
PYTEST_ENTRIES = ("_pytest", "pytest", "py.py", "xdist", "pytest_xdist", "pytest_benchmark")


def tree(folder: Path) -> dict[str, int]:
    """Every file under ``folder`` with its modification time (ns)."""
    return {str(p.relative_to(folder)): p.stat().st_mtime_ns
            for p in folder.rglob("*") if p.is_file()}


def quiet_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTEST_ADDOPTS", "PYTEST_PLUGINS")
           and not k.startswith("PYTEST_XDIST_")}  # this session's worker, under -n N
    return {**env, "PIP_DISABLE_PIP_VERSION_CHECK": "1", **extra}


def pip(*args: str, env: dict[str, str], cwd: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "pip", "--no-cache-dir", *args], env=env,
                          cwd=cwd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]


class Venv:
    """A fresh virtual environment: the wheel and the user's package installed in it,
    every other dependency taken from this interpreter's site-packages (linked into a
    folder of its own, so neither the editable pagedbench nor, with ``own_pytest``, this
    interpreter's pytest is seen)."""

    def __init__(self, base: Path, wheel: Path, own_pytest: Path | None = None) -> None:
        self.base = base
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(base / "venv")],
                       check=True, capture_output=True)
        self.python = base / "venv" / "bin" / "python"
        self.site = Path(subprocess.run(
            [self.python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True, capture_output=True, text=True).stdout.strip())
        skipped = PAGEDBENCH_ENTRIES + (PYTEST_ENTRIES if own_pytest else ())
        deps = base / "deps"
        deps.mkdir()
        for entry in Path(sysconfig.get_paths()["purelib"]).iterdir():
            if not entry.name.startswith(skipped):
                (deps / entry.name).symlink_to(entry)
        (self.site / "host-dependencies.pth").write_text(f"{deps}\n")
        user = base / "mykernel"
        user.mkdir()
        for name, text in USER_PACKAGE.items():
            (user / name).write_text(text)
        self.env = quiet_env(PIP_NO_INDEX="1", TMPDIR=str(base))
        packages = [str(wheel), str(user), *([str(own_pytest)] if own_pytest else [])]
        pip("install", "--no-deps", "--no-build-isolation", "--target", str(self.site),
             *packages, env=self.env, cwd=base)
        for script, module in (("pytest", "pytest"), ("pagedbench", "pagedbench")):
            # The console scripts an install puts on the venv's PATH.
            path = base / "venv" / "bin" / script
            path.write_text(f'#!/bin/sh\nexec "$(dirname "$0")/python" -m {module} "$@"\n')
            path.chmod(0o755)
        self.installed = tree(self.site)

    def pytest(self, *args: str, folder: str = "work") -> subprocess.CompletedProcess[str]:
        """``python -m pytest ARGS`` in a fresh working folder ``folder``."""
        work = self.base / folder
        work.mkdir()
        return subprocess.run([self.python, "-m", "pytest", *args], env=self.env, cwd=work,
                              capture_output=True, text=True, timeout=300)
