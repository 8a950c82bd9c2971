"""``pagedbench selftest``: run the conformance suite and the serving loop on every fault
of the catalogue and report which caught each one (suites that prove their strength).

The catalogue (``suites/faults``) is an out-of-tree distribution that is not installed:
:func:`run` puts its metadata folder on ``PYTHONPATH`` of two pytest runs, of
``suites/conformance`` and of ``suites/serving``, whose ``--impl`` options name the
control and every fault, with a JUnit report each (each test records its ``impl``) and
``PAGEDBENCH_FAULT_LOG`` (a fault writes its name there the first time it takes its faulty
branch). What each fault imitates, and whether it keeps state across calls of one pool,
comes from its ``available()`` details, asked in a worker like ``pagedbench list`` asks
them, so no plug-in is imported here. Each suite's column says:

- ``caught`` when a test failed on it (for the per-call suite: the properties that caught
  it, its shrunk case the smallest case the failures' replay commands name; for the loop:
  the replay command of its trace);
- ``missed`` otherwise: a gap, unless the fault keeps state across calls, which the
  per-call suite (a fresh pool per call) cannot meet and the loop must catch.

The control (``catalogue-control``) must pass both suites: a failure there is a suite's
fault or the catalogue's, never a catch.

With ``first_catch`` (what ``make test`` runs, to stay within minutes) this module is
also the per-call run's pytest plug-in: the pinned properties run before the search, and
once a test failed on an implementation, its remaining tests are skipped; the table then
names the first property that caught each fault. The loop then runs in the ``catch``
profile (``ci`` without shrinking).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ElementTree
from dataclasses import asdict, dataclass, field
from importlib.metadata import distributions
from pathlib import Path
from typing import Any

import pytest

from pagedbench.adapters import ENTRY_POINT_GROUP, Entry
from pagedbench.reference import PagedCase, PagedValueError

from pagedbench.harness.results.record import Environment, ResultRecord
from pagedbench.harness.results.store import environment
from pagedbench.harness.run import list_job, replay, runner
from pagedbench.harness.run.config import CHECKOUT, DEFAULT_CATALOGUE

CONFORMANCE_SUITE = CHECKOUT / "suites" / "conformance"
SERVING_SUITE = CHECKOUT / "suites" / "serving"
#: The profile the serving loop runs in under first-catch: ``ci`` without shrinking.
CATCH_PROFILE = "catch"
CONTROL = "catalogue-control"
#: The variable the faults append their name to when they fire (suites/faults/kernel.py).
FAULT_LOG = "PAGEDBENCH_FAULT_LOG"
_REPLAY = re.compile(r"pagedbench replay (\S+\.json) --impl (\S+)")
_LOOP_REPLAY = re.compile(r"pagedbench replay \S+\.jsonl --impl \S+")
#: The hypothesis search, which first-catch runs last (the pinned properties are cheaper).
SEARCH = "test_paged_matches_dense"
#: Implementations a test has failed on, in a first-catch run (this module as plug-in).
_caught: set[str] = set()


@dataclass
class FaultRow:
    """One line of the self-test table.

    Attributes
    ----------
    name, target : str
        The implementation's entry-point name and ``"module:Class"``.
    imitates, trigger : str
        From its ``available()`` details.
    verdict : str
        ``caught`` or ``missed`` for a fault; ``passed`` or ``failed`` for
        the control.
    properties : list[str]
        The tests that failed on it, as ``test[parameters]`` without the implementation.
    case : dict or None
        Its shrunk case (:meth:`PagedCase.to_dict`): the smallest failing case.
    reason : str
        The first line of the failure that named the shrunk case.
    search_case : dict or None
        The smallest failing case the hypothesis search found (what
        :func:`save_regressions` keeps; pinned cases are run on every adapter anyway).
    seconds : float
        Its tests' durations summed (s), both suites.
    exercised : bool
        Whether its faulty branch ran.
    keeps_state : bool
        Whether the fault lives in state kept across calls of one pool (its details).
    loop_verdict : str
        The serving loop's (``suites/serving``): ``caught`` or ``missed`` for a fault,
        ``passed`` or ``failed`` for the control.
    loop_trace : str
        The replay command of the loop that caught it.
    """

    name: str
    target: str
    imitates: str
    trigger: str
    verdict: str = "missed"
    properties: list[str] = field(default_factory=list)
    case: dict[str, Any] | None = None
    reason: str = ""
    search_case: dict[str, Any] | None = None
    seconds: float = 0.0
    exercised: bool = False
    keeps_state: bool = False
    loop_verdict: str = "missed"
    loop_trace: str = ""

    @property
    def case_id(self) -> str:
        return PagedCase.from_dict(self.case).case_id if self.case else ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"case_id": self.case_id}


def catalogue_entries(site: Path) -> list[Entry]:
    """The implementations the catalogue at ``site`` registers, found without import.

    Raises
    ------
    PagedValueError
        Naming ``--catalogue`` when ``site`` registers none.
    """
    found = _registered(site)
    if not found:
        raise PagedValueError("--catalogue", str(site),
                              f"a folder holding a distribution with {ENTRY_POINT_GROUP} "
                              "entry points", f"--catalogue {site}: no implementation is "
                              f"registered there (entry-point group {ENTRY_POINT_GROUP})")
    return found


def register_catalogue(site: Path = DEFAULT_CATALOGUE) -> None:
    """Register the catalogue at ``site`` in this process and the processes it starts:
    put it first on ``sys.path`` (entry points are read from there at every call) and on
    ``PYTHONPATH``."""
    if str(site) not in sys.path:
        sys.path.insert(0, str(site))
    paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    if str(site) not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(site), *paths) if p)


def register_catalogue_if_named(names: list[str], site: Path = DEFAULT_CATALOGUE) -> None:
    """:func:`register_catalogue` when ``names`` include an implementation it registers
    (how ``--impl fault-...`` reaches the catalogue without a manual ``PYTHONPATH``)."""
    if site.is_dir() and {e.name for e in _registered(site)} & set(names):
        register_catalogue(site)


def _registered(site: Path) -> list[Entry]:
    return [Entry(ep.name, ep.value, False) for dist in distributions(path=[str(site)])
            for ep in dist.entry_points if ep.group == ENTRY_POINT_GROUP]


def _pytest_command(names: list[str], profile: str, junit: Path, first_catch: bool,
                    search_seconds: float | None = None,
                    suite: Path = CONFORMANCE_SUITE) -> list[str]:
    impls = [arg for name in names for arg in ("--impl", name)]
    plugin = ["-p", __name__] if first_catch else []
    seconds = [] if search_seconds is None else ["--pagedbench-search-seconds",
                                                 str(search_seconds)]
    return [sys.executable, "-m", "pytest", str(suite), "-q", "-p",
            "no:cacheprovider", *plugin, "--hypothesis-profile", profile, *seconds,
            f"--junitxml={junit}", "-o", "junit_family=xunit1", *impls]


def _impl_of(item: pytest.Item) -> str | None:
    callspec = getattr(item, "callspec", None)
    return callspec.params.get("impl") if callspec else None


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """First-catch plug-in: the search after every pinned property."""
    items.sort(key=lambda item: item.originalname == SEARCH)


def pytest_runtest_setup(item: pytest.Item) -> None:
    """First-catch plug-in: skip an implementation a test has already failed on."""
    if _impl_of(item) in _caught:
        pytest.skip(f"{_impl_of(item)} already failed a property (first-catch run)")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    report = yield
    if report.failed and _impl_of(item) is not None:
        _caught.add(_impl_of(item))
    return report


def _testcases(junit: Path) -> list[dict[str, Any]]:
    """``{impl, property, seconds, failure}`` of each test in a JUnit report."""
    out = []
    for case in ElementTree.parse(junit).getroot().iter("testcase"):
        props = {p.get("name"): p.get("value") for p in case.iter("property")}
        impl = props.get("impl")
        if impl is None:
            continue
        name = case.get("name", "")
        base, _, params = name.partition("[")
        rest = "-".join(p for p in params.rstrip("]").replace(impl, "").split("-") if p)
        failed = [e for e in case if e.tag in ("failure", "error")]
        text = "\n".join((e.get("message") or "") + "\n" + (e.text or "") for e in failed)
        out.append({"impl": impl, "property": f"{base}[{rest}]" if rest else base,
                    "seconds": float(case.get("time") or 0.0),
                    "failure": text if failed else None})
    return out


def _smallest_case(failures: list[str]) -> tuple[dict[str, Any] | None, str]:
    """The smallest case the replay commands in ``failures`` name (by batch size, longest
    context, query rows) and the first line of the failure that named it."""
    best: tuple[tuple[int, int, int], dict[str, Any], str] | None = None
    for text in failures:
        found = _REPLAY.findall(text)
        if not found:
            continue
        case = replay.load(Path(found[-1][0])).case
        size = (case.batch_size, max(case.kv_lens), case.total_q)
        first = next((line for line in text.splitlines() if line.strip()), "")
        if best is None or size < best[0]:
            best = (size, case.to_dict(), first)
    return (None, "") if best is None else (best[1], best[2])


def run(site: Path, output_dir: Path, cache_dir: Path, profile: str = "ci",
        first_catch: bool = False, search_seconds: float | None = None) -> list[FaultRow]:
    """Run the self-test on the catalogue at ``site``, writing the JUnit report, the
    fault log and the failing cases under ``output_dir``; one row per implementation,
    the control first (``first_catch``: see the module docstring); ``search_seconds``
    per implementation, or the profile's. Registers ``site``
    in this process (:func:`register_catalogue`:
    the worker that asks the faults about themselves imports them from there).

    Raises
    ------
    PagedValueError
        If ``site`` registers nothing.
    RuntimeError
        If pytest did not run the suite (usage error, collection error, interruption).
    """
    found = catalogue_entries(site)
    output_dir.mkdir(parents=True, exist_ok=True)
    junit, log = output_dir / "conformance.xml", output_dir / "fired.log"
    for stale in (junit, log):
        stale.unlink(missing_ok=True)
    register_catalogue(site)
    env = dict(os.environ)
    env[replay.REPLAY_DIR_VARIABLE] = str((output_dir / "replay").resolve())
    env[FAULT_LOG] = str(log.resolve())
    listing = {row.name: row for row in list_job.list_adapters(found, "cpu", cache_dir)}
    targets = {e.name: e.target for e in found}
    names = sorted(targets, key=lambda n: (n != CONTROL, n))
    tests = _suite(_pytest_command(names, profile, junit, first_catch, search_seconds),
                   junit, env)
    loop_junit = output_dir / "serving.xml"
    loop_junit.unlink(missing_ok=True)
    loops = _suite(_pytest_command(names, CATCH_PROFILE if first_catch else profile,
                                   loop_junit, False, search_seconds, SERVING_SUITE),
                   loop_junit, env)
    fired = set(log.read_text().split()) if log.is_file() else set()
    rows = []
    for name in names:
        details = listing[name].details if name in listing else {}
        row = FaultRow(name, targets[name], str(details.get("imitates", "")),
                       str(details.get("trigger", "")), exercised=name in fired)
        mine = [t for t in tests if t["impl"] == name]
        failures = [t for t in mine if t["failure"] is not None]
        row.seconds = sum(t["seconds"] for t in mine)
        row.properties = sorted({t["property"] for t in failures})
        row.case, row.reason = _smallest_case([t["failure"] for t in failures])
        row.search_case = _smallest_case([t["failure"] for t in failures
                                          if t["property"] == SEARCH])[0]
        row.keeps_state = bool(details.get("keeps_state"))
        looped = [t for t in loops if t["impl"] == name]
        loop_failures = [t["failure"] for t in looped if t["failure"] is not None]
        row.seconds += sum(t["seconds"] for t in looped)
        row.loop_trace = next((found.group(0) for text in loop_failures
                               if (found := _LOOP_REPLAY.search(text))), "")
        if name == CONTROL:
            row.verdict = "failed" if failures or not mine else "passed"
            row.loop_verdict = "failed" if loop_failures or not looped else "passed"
        else:
            row.verdict = "caught" if failures else "missed"
            row.loop_verdict = "caught" if loop_failures else "missed"
        rows.append(row)
    return rows


def _suite(command: list[str], junit: Path, env: dict[str, str]) -> list[dict[str, Any]]:
    """Run one pytest suite of the self-test; its test cases (:func:`_testcases`).

    Raises
    ------
    RuntimeError
        If pytest did not run the suite (usage error, collection error, interruption).
    """
    proc = subprocess.run(command, cwd=CHECKOUT, env=env, stdin=subprocess.DEVNULL)
    if proc.returncode not in (0, 1) or not junit.is_file():
        raise RuntimeError(f"pytest exited {proc.returncode} without running {command[4]}")
    return _testcases(junit)


def save_regressions(rows: list[FaultRow], folder: Path,
                     config: runner.RunConfig) -> list[Path]:
    """Keep the case the search found for each caught fault in ``folder`` as a
    regression case, with the status the fault gets when the case is replayed alone in
    a worker, replacing the fault's earlier ones; the paths."""
    env = Environment.model_validate(environment(config.device) | {"threads": config.threads})
    saved = []
    for row in rows:
        if row.verdict != "caught" or row.search_case is None:
            continue
        case = PagedCase.from_dict(row.search_case)
        records: list[ResultRecord] = []
        runner.run_target(row.name, row.target, [case], config, "selftest", env, records.append)
        for old in folder.glob(f"{row.name}-*.json"):
            old.unlink()
        saved.append(replay.save_regression(case, row.name, SEARCH,
                                            records[0].reason or row.reason, folder,
                                            str(records[0].status)))
    return saved


def caught(row: FaultRow) -> bool:
    """Whether the fault of ``row`` was caught: by the serving loop when it keeps state
    across calls, else by either suite."""
    return row.loop_verdict == "caught" or (not row.keeps_state and row.verdict == "caught")


def passed(rows: list[FaultRow]) -> bool:
    """True when the control passed both suites and every fault was :func:`caught`."""
    return all((row.verdict, row.loop_verdict) == ("passed", "passed") if row.name == CONTROL
               else caught(row) for row in rows)


def table(rows: list[FaultRow]) -> list[dict[str, str]]:
    """The rows as the printed table has them: fault, the report it imitates, caught by,
    shrunk case, seconds."""
    def per_call(row: FaultRow) -> str:
        if row.name == CONTROL:
            return "control: passes" if row.verdict == "passed" else "CONTROL FAILED"
        if row.verdict == "missed":
            return ("missed (state across calls)" if row.keeps_state else "MISSED"
                    + ("" if row.exercised else " (never triggered)"))
        return ", ".join(row.properties)

    def loop(row: FaultRow) -> str:
        if row.name == CONTROL:
            return "passes" if row.loop_verdict == "passed" else "CONTROL FAILED"
        if row.loop_verdict == "caught":
            return "caught"
        return "MISSED" if row.keeps_state or row.verdict != "caught" else "missed"

    return [{"fault": r.name, "imitates": r.imitates or "-", "per-call suite": per_call(r),
             "serving loop": loop(r), "shrunk case": r.case_id or "-",
             "seconds": f"{r.seconds:.1f}"} for r in rows]


__all__ = ["CONTROL", "FAULT_LOG", "FaultRow",
           "catalogue_entries", "passed", "register_catalogue", "register_catalogue_if_named",
           "run", "save_regressions", "table"]
