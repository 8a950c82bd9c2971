"""Replaying one case: the files that conformance failures write, the command that
replays them, and the regression cases kept under ``suites/regressions/cases/``.

Every conformance failure (a pytest assertion of the conformance suites, a ``fail`` or
``error`` reason of ``pagedbench run``) writes its case as JSON, exactly
:meth:`PagedCase.to_dict` (what a result line's ``case`` holds), to :func:`replay_dir`
(``PAGEDBENCH_REPLAY_DIR``, which every pagedbench process sets to ``build/replay`` unless
the user has set it), named by the case id and a hash of its fields, and ends its
message with ``replay: pagedbench replay FILE --impl NAME``. :func:`load` reads such a
file, a whole result line, or a regression case; ``pagedbench replay`` runs it through
:mod:`pagedbench.harness.verdict.conformance` in a worker, as ``pagedbench run`` does.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shlex
import tempfile
from dataclasses import dataclass
from pathlib import Path

from pagedbench.adapters import Adapter
from pagedbench.reference import PagedCase, PagedInputError, PagedValueError

from pagedbench.harness.verdict import conformance
from pagedbench.harness.verdict.judging import Verdict
from pagedbench.harness.verdict.truth import compute_truth

#: The truth of a case, kept for the rest of the process: the pytest suites check many
#: implementations on the same pinned and derandomized cases (the runner caches on disk).
_truth = functools.lru_cache(maxsize=128)(compute_truth)

#: The variable naming the folder failing cases are written to.
REPLAY_DIR_VARIABLE = "PAGEDBENCH_REPLAY_DIR"
#: Where it points when unset (relative to the working directory).
DEFAULT_REPLAY_DIR = Path("build") / "replay"


def replay_dir() -> Path:
    """The folder failing cases are written to: ``$PAGEDBENCH_REPLAY_DIR`` or
    ``build/replay``."""
    return Path(os.environ.get(REPLAY_DIR_VARIABLE) or DEFAULT_REPLAY_DIR)


def case_file_name(case: PagedCase) -> str:
    """``<case id>-<8 hex digits of a hash of every field>.json``: distinct for cases
    that differ only in their seed or options the id leaves out."""
    digest = hashlib.sha256(json.dumps(case.to_dict(), sort_keys=True).encode()).hexdigest()
    return f"{case.case_id}-{digest[:8]}.json"


def write_case(case: PagedCase, folder: Path | None = None) -> Path:
    """Write ``case`` as JSON into ``folder`` (default :func:`replay_dir`, created) and
    return the file's path."""
    folder = replay_dir() if folder is None else Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / case_file_name(case)
    # Written beside it and renamed: processes failing on the same case (pytest-xdist's
    # workers) never show a reader half a file.
    fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}.", suffix=".tmp", dir=folder)
    with os.fdopen(fd, "w") as out:
        out.write(json.dumps(case.to_dict(), indent=1) + "\n")
    os.replace(tmp, path)
    return path


def command(path: Path, impl: str, timed: bool = False) -> str:
    """The shell command that replays the case file ``path`` on ``impl`` (``--timed``: with
    its timed calls judged)."""
    return (f"pagedbench replay {shlex.quote(str(path))} --impl {shlex.quote(impl)}"
            + (" --timed" if timed else ""))


def hint(case: PagedCase, impl: str, folder: Path | None = None, timed: bool = False) -> str:
    """Write ``case`` (:func:`write_case`) and return the line every conformance failure
    message ends with: ``replay: pagedbench replay FILE --impl IMPL [--timed]``."""
    return f"replay: {command(write_case(case, folder), impl, timed)}"


def check(adapter: Adapter, case: PagedCase, device: str, impl: str) -> Verdict:
    """:func:`pagedbench.harness.verdict.conformance.assert_conforms` whose failure message ends
    with the replay command (:func:`hint`); ``impl`` is the name the implementation is selected by.
    The truth of each case is computed once per process. Returns the verdict of a pass.

    Raises
    ------
    Nonconforming
        As ``assert_conforms`` does, chained to what the adapter raised.
    AssertionError
        If the check itself ended without a verdict.
    """
    try:
        return conformance.assert_conforms(adapter, case, device, truth=_truth)
    except conformance.Nonconforming as exc:
        raise conformance.Nonconforming(f"{exc}\n{hint(case, impl)}",
                                        exc.verdict) from exc.__cause__
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{hint(case, impl)}") from exc.__cause__


@dataclass(frozen=True)
class Replayable:
    """What a case file holds: the case, and the implementation a result line or
    regression case names (``None`` for a bare case)."""

    case: PagedCase
    impl: str | None = None


def load(path: Path) -> Replayable:
    """Read a case file: a bare :class:`PagedCase` as JSON, a result line (its ``case``
    and ``impl``) or a regression case (the same keys).

    Raises
    ------
    PagedValueError
        Naming ``CASE`` when the file is missing, is not JSON, or holds no case.
    PagedTypeError, PagedValueError
        From :meth:`PagedCase.from_dict`, naming the file and the field that is wrong.
    """
    allowed = "a JSON file holding a PagedCase, a result line or a regression case"
    try:
        data = json.loads(Path(path).read_text())
    except OSError as exc:
        raise PagedValueError("CASE", str(path), allowed,
                              f"CASE {path}: cannot read it ({exc.strerror or exc})") from None
    except json.JSONDecodeError as exc:
        several = exc.msg == "Extra data"  # a second value after the first: a results file
        raise PagedValueError("CASE", str(path), allowed, (
            f"CASE {path} holds more than one JSON value (line {exc.lineno} starts another): "
            "a results file? put the one result line to replay in a file of its own"
            if several else f"CASE {path} is not JSON ({exc})")) from None
    except ValueError as exc:  # not UTF-8
        raise PagedValueError("CASE", str(path), allowed,
                              f"CASE {path} is not JSON ({exc})") from None
    if not isinstance(data, dict):
        raise PagedValueError("CASE", str(path), allowed,
                              f"CASE {path} holds a {type(data).__name__}, not an object")
    impl = data.get("impl") if "case" in data else None
    try:
        case = PagedCase.from_dict(data["case"] if "case" in data else data)
    except PagedInputError as exc:
        raise type(exc)(exc.parameter, exc.value, exc.allowed, f"CASE {path}: {exc}") from None
    return Replayable(case, impl if isinstance(impl, str) else None)


def save_regression(case: PagedCase, impl: str, found_by: str, reason: str, folder: Path,
                    status: str = "fail") -> Path:
    """Keep ``case`` as a regression case in ``folder``: ``{"case", "impl", "found_by",
    "reason", "status"}`` as JSON (``status``: what ``impl`` gets when the case is replayed
    alone), named ``<impl>-<case file name>``; returns its path."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{impl}-{case_file_name(case)}"
    record = {"case": case.to_dict(), "impl": impl, "found_by": found_by, "reason": reason,
              "status": status}
    path.write_text(json.dumps(record, indent=1) + "\n")
    return path


__all__ = ["DEFAULT_REPLAY_DIR", "REPLAY_DIR_VARIABLE", "Replayable", "case_file_name",
           "check", "command", "hint", "load", "replay_dir", "save_regression",
           "write_case"]
