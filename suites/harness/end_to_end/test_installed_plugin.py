"""The pytest plugin from an installed wheel, as a CI job runs it: in a fresh virtual
environment holding only the wheel and a user's adapter package (the dependencies come from
this interpreter's site-packages, without pagedbench), ``python -m pytest --pyargs
pagedbench.suites.conformance --impl NAME`` ends with pytest's summary line and exit 0 on a
correct kernel, 1 on a broken one, writes nothing beside the installed files, and keeps
doing so with the ``-p`` options a user adds, with pytest-xdist and with the oldest pytest
the project allows (``pytest>=8``).

The environments live in a folder outside the checkout: inside it, pytest would find the
checkout's ``pyproject.toml``, whose ``-p no:cacheprovider`` hides what an installed run
meets. The wheel is built once per session (suites/harness/conftest.py); each environment
once per module (suites/harness/installed.py).
"""

from __future__ import annotations

import functools
import json
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import pytest

from pagedbench.suites import plugin

from ..installed import ROOT, Venv, quiet_env, tree

#: Where downloaded wheels are kept between sessions (the oldest allowed pytest).
WHEELHOUSE = ROOT / "build" / "wheels"
OLDEST_PYTEST = "pytest==8.0.*"
CONFORMANCE = ["--pyargs", "pagedbench.suites.conformance", "--pagedbench-device", "cpu"]
#: A quick part of the suite for the runs that vary options (the full suite runs once).
QUICK = ["-k", "test_pinned_probes"]
def _summary(proc: subprocess.CompletedProcess[str]) -> dict[str, int]:
    """Counts of pytest's last line (``3 passed, 1 skipped in 2.0s`` and its ``====``
    framed form) but its warnings, asserting it is the last line printed."""
    last = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    match = re.fullmatch(r"=*\s*((?:\d+ \w+(?:, )?)+) in [\d.]+s(?: \([\d:]+\))?\s*=*", last)
    assert match, f"no summary line last:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return {word: int(n) for n, word in re.findall(r"(\d+) (\w+)", match.group(1))
            if not word.startswith("warning")}  # warnings do not fail a job


@functools.cache
def _collected(*selection: str) -> int:
    """How many tests the checkout's conformance suite has for ``selection``."""
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                           "suites/conformance", "--pagedbench-device", "cpu", *selection],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    count = re.search(r"(\d+)(?:/\d+)? tests? collected", proc.stdout)
    assert count, proc.stdout[-2000:] + proc.stderr[-2000:]
    return int(count.group(1))


def _wrote_only_build(venv: Venv, folder: str) -> None:
    """The run wrote nothing into the installed package, and in its working folder only
    under ``build/`` (no .pytest_cache, .hypothesis or __pycache__)."""
    assert tree(venv.site) == venv.installed, "the run wrote into the installed package"
    work = venv.base / folder
    written = {p.relative_to(work).parts[0] for p in work.rglob("*") if p.is_file()}
    assert written <= {"build"}, written


@pytest.fixture(scope="module")
def venv(outside, wheel) -> Venv:
    """The wheel in a fresh venv, in a folder of its own: a worker that comes back to this
    module (pytest-xdist's ``--dist worksteal``) sets it up again beside the first."""
    return Venv(Path(tempfile.mkdtemp(prefix="newest-", dir=outside)), wheel)


def test_a_correct_kernel_passes_the_whole_suite_and_nothing_is_written_there(
        venv, pytestconfig) -> None:
    """The whole suite, with this session's search seconds (the installed plugin's
    ``--pagedbench-search-seconds``, as ``make test`` passes it; else the profile's)."""
    seconds = plugin.search_seconds(pytestconfig)
    located = subprocess.run([venv.python, "-c", "import pagedbench.suites.plugin as p, "
                              "pytest; print(p.__file__); print(pytest.__file__)"],
                             env=venv.env, capture_output=True, text=True, check=True)
    plugin_file, pytest_file = located.stdout.split()
    assert Path(plugin_file).is_relative_to(venv.site)  # the wheel's, not the checkout's
    given = [] if seconds is None else ["--pagedbench-search-seconds", str(seconds)]
    proc = venv.pytest(*CONFORMANCE, "--impl", "mine", "-q", *given, folder="correct")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    counts = _summary(proc)
    # Every test the checkout's suite has for this kernel ran: passed, or skipped where
    # it declares a case unsupported (a layout it cannot take, for example).
    assert counts["passed"] > 0, counts
    assert counts["passed"] + counts.get("skipped", 0) == _collected("--impl", "torch-gather")
    assert set(counts) <= {"passed", "skipped"}, proc.stdout[-3000:]
    _wrote_only_build(venv, "correct")


def test_a_broken_kernel_fails_with_the_summary_line_last(venv) -> None:
    proc = venv.pytest(*CONFORMANCE, "--impl", "mine-broken", "-q", "-x", folder="broken")
    assert proc.returncode == pytest.ExitCode.TESTS_FAILED, proc.stdout[-3000:]
    assert _summary(proc)["failed"] == 1
    assert "mine-broken" in proc.stdout


@pytest.mark.nightly
@pytest.mark.parametrize("options", [
    ["-p", "no:cacheprovider", "-p", "no:stepwise", "-p", "no:randomly"],
    ["-o", "cache_dir=build/pytest-cache", "--sw"],
], ids=["plugins-blocked", "cache-in-build-stepwise"])
def test_options_a_user_adds_keep_the_run_whole(venv, options) -> None:
    folder = "options-" + re.sub(r"\W", "", "".join(options))
    proc = venv.pytest(*CONFORMANCE, "--impl", "mine", "-q", *QUICK, *options,
                       folder=folder)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert _summary(proc)["passed"] == _collected("--impl", "torch-gather", *QUICK)
    _wrote_only_build(venv, folder)
    if "--sw" in options:  # the cache the user asked for, under build/
        assert (venv.base / folder / "build" / "pytest-cache").is_dir()


def test_a_wrong_impl_or_device_is_one_usage_error(venv) -> None:
    proc = venv.pytest(*CONFORMANCE, "--impl", "yours", folder="wrong-impl")
    assert proc.returncode == pytest.ExitCode.USAGE_ERROR, proc.stdout[-2000:]
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("ERROR: --impl yours: unknown implementation; choose from ")
    assert {"torch-gather", "mine", "mine-broken"} <= set(line.split(": ")[-1].split(", "))
    assert "collect" not in proc.stdout + proc.stderr
    device = venv.pytest("--pyargs", "pagedbench.suites.conformance", "--pagedbench-device",
                         "tpu", folder="wrong-device")
    assert device.returncode == pytest.ExitCode.USAGE_ERROR
    assert "--pagedbench-device tpu" in device.stderr


@pytest.mark.nightly
def test_pytest_xdist_shards_the_suite(venv) -> None:
    pytest.importorskip("xdist")
    proc = venv.pytest(*CONFORMANCE, "--impl", "mine", "--impl", "mine-broken", *QUICK,
                       "-n", "2", "-v", folder="xdist")
    assert proc.returncode == pytest.ExitCode.TESTS_FAILED, proc.stdout[-3000:]
    quick = _collected("--impl", "torch-gather", *QUICK)
    assert _summary(proc) == {"passed": quick, "failed": quick}, proc.stdout[-3000:]
    assert {"[gw0]", "[gw1]"} <= set(re.findall(r"\[gw\d+\]", proc.stdout)), proc.stdout[-3000:]
    _wrote_only_build(venv, "xdist")


@pytest.mark.nightly
def test_the_oldest_allowed_pytest_runs_the_suite(outside, wheel) -> None:
    WHEELHOUSE.mkdir(parents=True, exist_ok=True)
    found = sorted(WHEELHOUSE.glob("pytest-8.0.*-py3-none-any.whl"))
    if not found:
        download = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
             "-d", str(WHEELHOUSE), OLDEST_PYTEST], env=quiet_env(TMPDIR=str(outside)),
            capture_output=True, text=True, timeout=120)
        found = sorted(WHEELHOUSE.glob("pytest-8.0.*-py3-none-any.whl"))
        if not found:
            pytest.skip(f"{OLDEST_PYTEST} could not be downloaded: {download.stderr[-300:]}")
    old = Venv(outside / "oldest", wheel, own_pytest=found[-1])
    version = subprocess.run([old.python, "-m", "pytest", "--version"], env=old.env,
                             capture_output=True, text=True, check=True)
    assert "pytest 8.0." in version.stdout + version.stderr
    passed = old.pytest(*CONFORMANCE, "--impl", "mine", "-q", *QUICK, folder="correct")
    assert passed.returncode == 0, passed.stdout[-3000:] + passed.stderr[-3000:]
    assert _summary(passed)["passed"] == _collected("--impl", "torch-gather", *QUICK)
    _wrote_only_build(old, "correct")
    broken = old.pytest(*CONFORMANCE, "--impl", "mine-broken", "-q", *QUICK,
                        "-p", "no:stepwise", folder="broken")
    assert broken.returncode == pytest.ExitCode.TESTS_FAILED, broken.stdout[-3000:]
    assert "failed" in _summary(broken)
    wrong = old.pytest(*CONFORMANCE, "--impl", "yours", folder="wrong-impl")
    assert wrong.returncode == pytest.ExitCode.USAGE_ERROR, wrong.stdout[-2000:]


#: The checkout's folders that install as ``pagedbench.<folder>`` (setup.py).
INSTALLED_FOLDERS = ("reference", "kernels", "adapters", "harness", "suites")


def test_the_wheel_holds_every_folder_of_the_checkout(wheel) -> None:
    """Every folder holding Python or JSON under the installed top-level folders is in
    the wheel, with each of its files, found by walking the checkout (not setup.py's
    list); and no other top-level folder holds importable code the wheel leaves out."""
    with zipfile.ZipFile(wheel) as archive:
        shipped = set(archive.namelist())
    expected = {"pagedbench/__main__.py"}
    for folder in INSTALLED_FOLDERS:
        for path in (ROOT / folder).rglob("*"):
            if path.suffix in (".py", ".json") and "__pycache__" not in path.parts \
                    and not any(part.endswith(".dist-info") for part in path.parts):
                expected.add(f"pagedbench/{path.relative_to(ROOT)}")
    assert len(expected) > 300 and not expected - shipped, sorted(expected - shipped)
    others = {p.parent.relative_to(ROOT).parts[0] for p in ROOT.glob("*/*.py")}
    assert others <= {*INSTALLED_FOLDERS, "pagedbench", "scripts", "docs"}, others


def test_the_installed_commands_answer_help(venv) -> None:
    """``python -m`` on the modules README tells a user to run, from the wheel."""
    for module in ("pagedbench", "pagedbench.harness.calibration.gate"):
        proc = subprocess.run([venv.python, "-m", module, "--help"], env=venv.env,
                              cwd=venv.base, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert proc.stdout.startswith("usage: "), proc.stdout[:500]


@pytest.mark.nightly
def test_python_m_pagedbench_runs_the_command_from_the_wheel_and_the_checkout(venv) -> None:
    for python, env in ((venv.python, venv.env), (Path(sys.executable), quiet_env())):
        proc = subprocess.run([python, "-m", "pagedbench", "schema"], env=env,
                              cwd=venv.base, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert json.loads(proc.stdout)["title"].startswith("pagedbench results line")
        usage = subprocess.run([python, "-m", "pagedbench", "nonsense"], env=env,
                               cwd=venv.base, capture_output=True, text=True, timeout=120)
        assert usage.returncode == 2 and usage.stderr.startswith("usage: pagedbench")


@pytest.mark.nightly
def test_replay_save_and_list_write_only_where_they_are_told(venv) -> None:
    work = venv.base / "replay"
    work.mkdir()
    case = work / "case.json"
    case.write_text(json.dumps({"kv_lens": [7], "q_lens": [2], "num_q_heads": 1,
                                "num_kv_heads": 1, "head_dim": 32, "block_size": 8,
                                "dtype": "float32", "name": "replay"}))

    def pagedbench(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([venv.python, "-m", "pagedbench", *args], env=venv.env,
                              cwd=work, capture_output=True, text=True, timeout=300)

    refused = pagedbench("replay", str(case), "--impl", "mine-broken", "--save",
                         "--cache-dir", "caches")
    assert refused.returncode == 2, refused.stdout[-2000:] + refused.stderr[-2000:]
    assert "--save needs a folder" in refused.stderr
    saved = pagedbench("replay", str(case), "--impl", "mine-broken", "--save", "kept",
                       "--cache-dir", "caches")
    assert saved.returncode == 1, saved.stdout[-2000:] + saved.stderr[-2000:]
    (kept,) = (work / "kept").glob("mine-broken-*.json")
    assert json.loads(kept.read_text())["impl"] == "mine-broken"
    listed = pagedbench("list", "--json", "--cache-dir", "listing")
    assert listed.returncode == 0, listed.stderr[-2000:]
    assert {"mine", "mine-broken"} <= {row["name"] for row in json.loads(listed.stdout)}
    assert {p.name for p in work.iterdir()} == {"case.json", "kept", "caches", "listing"}
    assert tree(venv.site) == venv.installed, "a command wrote into the installed package"
