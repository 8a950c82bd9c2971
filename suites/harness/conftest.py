"""Fixtures of the harness suite: registering test-only plug-ins as an out-of-tree package
would, finding the worker processes of a parent, and pagedbench's wheel with a folder
outside the checkout to install it in (:mod:`.installed`)."""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from pagedbench.harness.calibration.gate import plugin_environment

from . import installed

PLUGINS = "pagedbench.suites.harness.plugins"
BROKEN = "pagedbench.suites.conformance.broken_adapters"
#: Fewer objects than importing torch alone makes: a process that froze what it imported
#: (``heavy_imports``) has at least this many frozen; one that froze none, 0.
TORCH_OBJECTS_AT_LEAST = 10_000
#: Test-only plug-ins by entry-point name.
FAULTS = {
    "exits-at-import": f"{PLUGINS}.exits_at_import:Anything",
    "os-exits-at-import": f"{PLUGINS}.os_exits_at_import:Anything",
    "segfaults-at-import": f"{PLUGINS}.segfaults_at_import:Anything",
    "hangs-at-import": f"{PLUGINS}.hangs_at_import:Anything",
    "numpy-metadata": f"{PLUGINS}.misbehaving:NumpyAndSetMetadata",
    "unpicklable-describe": f"{PLUGINS}.misbehaving:UnpicklableDescribe",
    "int-version": f"{PLUGINS}.misbehaving:IntegerVersion",
    "object-version": f"{PLUGINS}.misbehaving:ObjectVersion",
    "slow-available": f"{PLUGINS}.misbehaving:SlowAvailable",
    "hangs-in-run": f"{PLUGINS}.misbehaving:HangsInRun",
    "slow-correct": f"{PLUGINS}.misbehaving:SlowCorrect",
    "reports-environment": f"{PLUGINS}.misbehaving:ReportsEnvironment",
    "reports-collector": f"{PLUGINS}.misbehaving:ReportsCollector",
    "writes-into-the-channel": f"{PLUGINS}.misbehaving:WritesIntoTheChannel",
    "starts-daemons": f"{PLUGINS}.misbehaving:StartsDaemons",
    "reads-past": f"{BROKEN}:ReadsPastKvLen",
    "missing-module": "not_installed_mod:Thing",
}


class RunsCode:
    """Unpickling it creates the folder ``marker``: a stand-in for a planted pickle that
    runs code."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.mkdir, (self.marker,))


def register(site: Path, entries: dict[str, str]) -> dict[str, str]:
    """Write a minimal installed distribution under ``site`` whose entry points register
    ``entries``; return this process's environment with ``site`` on ``PYTHONPATH``."""
    return plugin_environment(site, entries)


@pytest.fixture
def plugin_env(tmp_path: Path) -> dict[str, str]:
    """An environment in which every plug-in of :data:`FAULTS` is installed."""
    return register(tmp_path / "site", FAULTS)


def workers_of(parent_pid: int) -> list[int]:
    """Live pagedbench worker processes started by ``parent_pid`` (from ``/proc``: their
    command line names it with ``--parent``; zombies do not count)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
            state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if (b"pagedbench.harness.run.protocol" in argv and b"--parent" in argv
                and argv[argv.index(b"--parent") + 1] == str(parent_pid).encode()
                and state != "Z"):
            found.append(int(proc.name))
    return found


ENV = {"device": "cpu0", "device_type": "cpu", "cc": None, "driver": None, "threads": 2,
       "python": "3.11", "torch": "2", "triton": None, "vllm": None, "flashinfer": None,
       "flash_attn": None, "xformers": None, "git_sha": None, "dirty": False, "host": "h"}


def result(impl: str, case_id_or_case="c1", status: str = "pass", ms: float | None = None, *,
           method: str = "perf_counter", device: str = "cpu", reason: str | None = None,
           run_id: str = "r1", env: dict | None = None, **changes):
    """A valid result record for report and store tests: ``impl`` on a small case named
    ``case_id_or_case`` (or that PagedCase), with ``status`` and a median of ``ms``."""
    from pagedbench.harness.results.outcome import result_record
    from pagedbench.harness.results.record import Environment
    from pagedbench.harness.verdict.status import Status
    from pagedbench.harness.measure.timing import Timing
    from pagedbench.reference import PagedCase

    case = case_id_or_case if isinstance(case_id_or_case, PagedCase) else PagedCase(
        kv_lens=(3,), num_q_heads=2, num_kv_heads=1, head_dim=8, block_size=4,
        dtype="float32", name=case_id_or_case)
    timing = None if ms is None else Timing((ms, ms, ms), method)
    record = result_record(
        run_id=run_id, env=Environment.model_validate(env or ENV),
        suite="default", device=device, name=impl, target="t:T", case=case,
        status=Status(status), reason=("" if status == "pass" else "why") if reason is None
        else reason, timing=timing)
    if method == "interpreted":
        changes.setdefault("interpreted", True)
    return record.model_copy(update=changes) if changes else record


@pytest.fixture(scope="session")
def wheel(tmp_path_factory) -> Path:
    """pagedbench's wheel, built from the checkout once per session (per pytest-xdist
    worker). setuptools builds in the checkout's ``build/`` (``bdist.*``, ``lib``), so the
    workers take turns under a lock there: two at once failed one of them ("File exists:
    'build/bdist.linux-x86_64/wheel/pagedbench-0.1.0.dist-info'", a fresh-clone make test),
    each from an empty ``build/lib``, so that the wheel holds only what the checkout has."""
    dist = tmp_path_factory.mktemp("dist")
    lock = installed.ROOT / "build" / "wheel-build.lock"
    lock.parent.mkdir(exist_ok=True)
    with lock.open("w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # released when the file closes
        # setuptools copies into build/lib and never removes what the checkout dropped.
        shutil.rmtree(installed.ROOT / "build" / "lib", ignore_errors=True)
        installed.pip("wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w",
                      str(dist), str(installed.ROOT),
                      env=installed.quiet_env(TMPDIR=str(dist)), cwd=dist)
    (built,) = dist.glob("pagedbench-*.whl")
    return built


@pytest.fixture(scope="session")
def outside() -> Path:
    """A folder with no pytest configuration above it, removed after the session."""
    markers = ("pytest.ini", ".pytest.ini", "pyproject.toml", "tox.ini", "setup.cfg")
    for candidate in (tempfile.gettempdir(), "/tmp", "/var/tmp"):
        base = Path(candidate).resolve()
        if base.is_dir() and os.access(base, os.W_OK) and not any(
                (d / m).exists() for d in (base, *base.parents) for m in markers):
            break
    else:
        pytest.skip("no writable folder outside any pytest configuration")
    folder = Path(tempfile.mkdtemp(prefix="pagedbench-installed-", dir=base))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)
