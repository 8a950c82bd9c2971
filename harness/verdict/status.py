"""Statuses of one (implementation, case) and the exit codes of a run: the one place
that says what each means, whether it counts against the implementation, its colour and
its order in reports.

An implementation is to blame for ``fail``, ``error``, ``crash`` and ``timeout``
(:attr:`Status.failing`); ``harness-error`` is pagedbench's own fault (computing the
truth, building the inputs, timing) and never the implementation's; ``unsupported`` and
``unavailable`` are no verdict at all. :func:`exit_code` turns a run's statuses into the
CLI's exit code (:class:`ExitCode`, README "Verdicts and exit codes"); ``pagedbench gate`` has its
own outcomes (:mod:`pagedbench.harness.gate.compare`) and exits 0, 1, 2,
:attr:`ExitCode.NOTHING_COMPARABLE` or :attr:`ExitCode.UNJUDGED`. Any command that cannot write an
output file (disk full, I/O error, a symbolic link it refuses) exits :attr:`ExitCode.WRITE_ERROR`,
naming the file.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable


class Status(enum.StrEnum):
    """Outcome of one (implementation, case); the order of definition is the order of
    report columns."""

    PASS = "pass"
    FAIL = "fail"
    ERROR = "error"
    CRASH = "crash"
    TIMEOUT = "timeout"
    HARNESS_ERROR = "harness-error"
    UNSUPPORTED = "unsupported"
    UNAVAILABLE = "unavailable"

    @property
    def meaning(self) -> str:
        """One line for README, ``--help`` and report legends."""
        return _MEANING[self]

    @property
    def failing(self) -> bool:
        """True when the implementation got a case it claims to support wrong."""
        return self in (Status.FAIL, Status.ERROR, Status.CRASH, Status.TIMEOUT)

    @property
    def colour(self) -> str:
        """The rich colour of progress lines."""
        if self is Status.PASS:
            return "green"
        if self.failing:
            return "red"
        return "yellow" if self is Status.HARNESS_ERROR else "dim"


_MEANING = {
    Status.PASS: "output within tolerance of the float64 truth; only then is its speed shown",
    Status.FAIL: "wrong output: error above tolerance, NaN/Inf anywhere, wrong shape or dtype",
    Status.ERROR: "the implementation raised (at import, in available, prepare, run or "
                  "describe), or returned metadata that is not JSON data",
    Status.CRASH: "its worker process died (segfault, abort, exit at import, illegal address)",
    Status.TIMEOUT: "its own available/prepare/run took longer than --case-timeout",
    Status.HARNESS_ERROR: "pagedbench's own work (truth, inputs, timing) failed or took "
                          "longer than --harness-timeout: not the implementation's fault",
    Status.UNSUPPORTED: "outside the capabilities it declares (the reason is recorded)",
    Status.UNAVAILABLE: "cannot run here at all (not installed, no GPU; the reason is recorded)",
}


class ExitCode(enum.IntEnum):
    """Exit codes of ``pagedbench run`` and ``gate`` (and of every command: 2 is any usage
    error). ``REGRESSION`` is another name of 1."""

    CLEAN = 0
    CONFORMANCE_FAILURE = 1
    REGRESSION = 1
    USAGE_ERROR = 2
    NOTHING_RAN = 3
    HARNESS_FAULT = 4
    NOTHING_COMPARABLE = 5
    WRITE_ERROR = 6
    UNJUDGED = 7

    @property
    def meaning(self) -> str:
        return _EXIT_MEANING[self]


_EXIT_MEANING = {
    ExitCode.CLEAN: "every verdict is pass (or unsupported/unavailable) and at least one passed",
    ExitCode.CONFORMANCE_FAILURE: "some implementation failed a case: fail, error, crash or "
                                  "timeout",
    ExitCode.USAGE_ERROR: "bad command line or input file (nothing was run)",
    ExitCode.NOTHING_RAN: "nothing was checked: every case unavailable or unsupported",
    ExitCode.HARNESS_FAULT: "pagedbench itself failed (harness-error, or an internal fault)",
    ExitCode.NOTHING_COMPARABLE: "gate: no point in common with the baseline (another "
                                 "device or thread count, or other cases)",
    ExitCode.WRITE_ERROR: "an output file could not be written (disk full, I/O error, a "
                          "symbolic link refused; the file is named): not a pagedbench bug, "
                          "and what was written before is intact",
    ExitCode.UNJUDGED: "gate: no regression found, but some points could not be judged "
                       "(too noisy, not timed alike, or in only one of baseline and "
                       "current); --allow-unjudged exits 0 for them",
}


def exit_code(statuses: Iterable[Status | str]) -> ExitCode:
    """The exit code of a run with these statuses: a conformance failure wins over a
    harness fault (the kernel is wrong whatever else happened), which wins over "nothing
    ran"; a run without a single ``pass`` never exits 0."""
    seen = {Status(s) for s in statuses}
    if any(s.failing for s in seen):
        return ExitCode.CONFORMANCE_FAILURE
    if Status.HARNESS_ERROR in seen:
        return ExitCode.HARNESS_FAULT
    if Status.PASS not in seen:
        return ExitCode.NOTHING_RAN
    return ExitCode.CLEAN


#: What the exit codes of ``pagedbench gate`` mean.
GATE_EXIT_MEANING = {
    ExitCode.CLEAN: "every point was judged and none broke or slowed down (with "
                    "--allow-unjudged: none of those judged)",
    ExitCode.REGRESSION: "a point broke (pass -> anything else, or a new fail, error, crash "
                         "or timeout) or got slower beyond noise and --min-effect",
    ExitCode.USAGE_ERROR: "bad command line or results file (nothing was compared)",
    ExitCode.HARNESS_FAULT: "pagedbench itself failed (an internal fault)",
    ExitCode.NOTHING_COMPARABLE: _EXIT_MEANING[ExitCode.NOTHING_COMPARABLE],
    ExitCode.WRITE_ERROR: _EXIT_MEANING[ExitCode.WRITE_ERROR],
    ExitCode.UNJUDGED: _EXIT_MEANING[ExitCode.UNJUDGED],
}


def exit_codes_help(meanings: dict[ExitCode, str] | None = None) -> str:
    """The exit-code table for ``--help``: every code (``run`` and the others), or the
    codes and ``meanings`` given (``gate``: :data:`GATE_EXIT_MEANING`)."""
    meanings = meanings or {c: c.meaning for c in ExitCode}
    return "exit codes:\n" + "\n".join(f"  {int(c)}  {m}" for c, m in meanings.items())


__all__ = ["GATE_EXIT_MEANING", "ExitCode", "Status", "exit_code", "exit_codes_help"]
