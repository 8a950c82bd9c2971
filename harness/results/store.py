"""The results store: append-only JSON-lines files of typed records (:mod:`.record`).

One line per (implementation, case), plus a run's events, in ``<results_dir>/<run_id>.jsonl``
(default ``results/runs/``). Each line is written with a single ``os.write`` on a file
opened ``O_APPEND`` and then fsync'ed, so concurrent writers never interleave within a
line and a kill loses at most the line being written. Files merge by concatenation. A
write that fails (disk full, I/O error) cuts the file back to its last whole line and
raises :class:`OutputError` naming it; a symbolic link where pagedbench writes is refused
(``O_NOFOLLOW``), never written through nor replaced. One process writes a run's file at a
time (:meth:`ResultsFile.locked`). :func:`write_output` writes a report atomically.

Reading validates every line against the schema and names the file and line of anything
refused (:class:`ResultsFileError`): bad JSON, a newer ``schema_version``, an unknown
status, a missing or mistyped field, a line nested too deeply to parse. A torn line (a
write cut off by a kill: the last line of a file without its newline, or such a fragment
glued to the next record when files were concatenated) is skipped with a warning naming
the file; the rest is read. A line of an older ``schema_version`` is read as the current
one, the fields added since empty or at their defaults (:func:`_upgrade`).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import json
import os
import platform
import subprocess
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from pagedbench.reference import PagedValueError

from pagedbench.harness.results import floor
from pagedbench.harness.results.record import (COMPARISON_FIELDS, LINE, SCHEMA_VERSION,
                                               VERSION_FIELDS, ResultRecord, RunRecord)
from pagedbench.harness.verdict.messages import validation_problem

#: The commit and dirtiness of a checkout without ``.git`` (the GPU lane's copy), set by
#: whoever made the copy: a 40-hex commit, and ``1``/``0``. Taken over what git says.
GIT_SHA_ENV = "PAGEDBENCH_GIT_SHA"
GIT_DIRTY_ENV = "PAGEDBENCH_GIT_DIRTY"


class ResultsFileError(PagedValueError):
    """A results file or line that is not what :mod:`.record` describes; the message
    starts with ``file:line``."""

    def __init__(self, file: Path, line: int | None, problem: str) -> None:
        where = f"{file}:{line}" if line is not None else str(file)
        super().__init__("results file", where, "lines of the results schema",
                         f"{where}: {problem}")
        self.file, self.line = file, line


class OutputError(Exception):
    """A file pagedbench writes could not be written: a failed write (disk full, I/O
    error) or a symbolic link it refuses; the message starts with the file. Exit code
    :attr:`~pagedbench.harness.verdict.status.ExitCode.WRITE_ERROR`: what was written before is
    intact."""

    def __init__(self, file: Path, problem: str) -> None:
        super().__init__(f"{file}: {problem}")
        self.file = file

    @classmethod
    def of(cls, file: Path, exc: OSError) -> OutputError:
        """The error of ``exc`` raised writing ``file``."""
        if exc.errno == errno.ELOOP:
            return cls(file, "is a symbolic link; pagedbench does not write through links "
                       "(remove it, or give another folder)")
        return cls(file, f"cannot write ({exc.strerror or exc}); nothing torn was left")


def _write_all(fd: int, data: bytes) -> None:
    """Write all of ``data`` (a short write, as on a nearly full disk, is continued; the
    next write then raises) and fsync it."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
    os.fsync(fd)


def _refuse_link(path: Path) -> None:
    if path.is_symlink():
        raise OutputError.of(path, OSError(errno.ELOOP, os.strerror(errno.ELOOP)))


def write_output(path: Path, text: str | bytes) -> None:
    """Write ``text`` (UTF-8 when a ``str``) to ``path`` atomically: a temporary file
    beside it, fsync'ed, then renamed over it, so a failed write leaves the previous file
    (or none) and never an empty or torn one.

    Raises
    ------
    OutputError
        ``path`` is a symbolic link (refused: its target is never written), or a write
        failed (the temporary file is removed).
    """
    path = Path(path)
    _refuse_link(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        try:
            _write_all(fd, text.encode() if isinstance(text, str) else text)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise OutputError.of(path, exc) from None


def new_run_id() -> str:
    """A sortable, unique-enough run id: UTC time plus process id, e.g.
    ``20261130T041502Z-12345``."""
    return datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ") + f"-{os.getpid()}"


def _git(*args: str) -> str:
    try:
        out = subprocess.run(["git", *args], capture_output=True, text=True, timeout=10,
                             cwd=Path(__file__).resolve().parent)
    except (OSError, subprocess.SubprocessError):
        return ""
    return out.stdout.strip() if out.returncode == 0 else ""


@functools.cache
def nvidia_driver_version() -> str | None:
    """The NVIDIA kernel driver's version as ``nvidia-smi`` reports it (``"580.159.03"``),
    or None without ``nvidia-smi`` (``torch.version.cuda`` is the CUDA build of torch, not
    the driver)."""
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=driver_version",
                               "--format=csv,noheader"], capture_output=True, text=True,
                              timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = done.stdout.split()
    return lines[0] if done.returncode == 0 and lines else None


def environment(device: str) -> dict[str, Any]:
    """Facts about where results were measured on ``device`` (``cuda:N``: that GPU),
    recorded in every result line.

    Keys: ``device`` (CPU model or GPU name), ``device_type``, ``cc`` (CUDA compute
    capability or None), ``driver`` (CUDA driver/runtime version or None), ``threads``,
    ``python``, the version of each library of
    :data:`~pagedbench.harness.results.record.VERSION_FIELDS` (None when absent), ``git_sha``,
    ``dirty`` (from :data:`GIT_SHA_ENV` and :data:`GIT_DIRTY_ENV` when set, else from git),
    ``host`` (:class:`~pagedbench.harness.results.record.Environment`).
    """
    import torch  # here, not at the top: reading and listing results needs no torch

    from pagedbench.adapters.cuda_probe import installed_distribution  # imports torch

    where = torch.device(device)
    env: dict[str, Any] = {"device_type": where.type, "cc": None, "driver": None}
    if where.type == "cuda" and torch.cuda.is_available():
        env["device"] = torch.cuda.get_device_name(where)
        env["cc"] = ".".join(map(str, torch.cuda.get_device_capability(where)))
        env["driver"] = nvidia_driver_version()
    else:
        env["device"] = platform.processor() or platform.machine()
        try:
            for line in Path("/proc/cpuinfo").read_text().splitlines():
                if line.startswith("model name"):
                    env["device"] = line.split(":", 1)[1].strip()
                    break
        except OSError:
            pass
    env["threads"] = torch.get_num_threads()
    env["python"] = platform.python_version()
    for name in VERSION_FIELDS:  # the distribution that provides each module, its version
        found = installed_distribution(name)
        env[name] = found[1] or None if found else None
    env["torch"] = torch.__version__
    env["git_sha"] = os.environ.get(GIT_SHA_ENV) or _git("rev-parse", "HEAD") or None
    given_dirty = os.environ.get(GIT_DIRTY_ENV)
    env["dirty"] = (given_dirty == "1" if given_dirty in ("0", "1") else
                    bool(_git("status", "--porcelain", "--untracked-files=no")))
    env["host"] = platform.node()
    return env


class ResultsFile:
    """Append-only JSON-lines file of :mod:`.record` lines.

    Parameters
    ----------
    path : Path
        The ``.jsonl`` file; its folder is created if missing.
    """

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._checked_tail = False

    def append(self, line: BaseModel) -> None:
        """Write one record as one line, atomically (one O_APPEND write + fsync);
        non-finite figures are ``null``, so every line is strict JSON. Before the first
        write, a torn last line left by a killed writer is dropped (:meth:`drop_torn_tail`)
        so that the new line does not glue onto it.

        Raises
        ------
        OutputError
            The file is a symbolic link, or the write failed (the file is cut back to
            the size it had, so no torn line is left).
        """
        if not self._checked_tail:
            self.drop_torn_tail()
            self._checked_tail = True
        data = (line.model_dump_json() + "\n").encode()
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW,
                         0o644)
        except OSError as exc:
            raise OutputError.of(self.path, exc) from None
        try:
            size = os.fstat(fd).st_size
            _write_all(fd, data)
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, size)
            raise OutputError.of(self.path, exc) from None
        finally:
            os.close(fd)

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Hold the run's write lock while the block runs: ``flock`` on a lock file beside
        the results file (``.<name>.lock``, holding the holder's pid, removed on exit).

        Raises
        ------
        ResultsFileError
            Another process holds it (naming its pid): two writers of one run would
            duplicate its results.
        """
        lock = self.path.with_name(f".{self.path.name}.lock")
        while True:
            try:
                fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
            except OSError as exc:
                raise OutputError.of(lock, exc) from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
                os.close(fd)
                raise ResultsFileError(self.path, None, f"is being written by another "
                                       f"pagedbench (pid {holder}); wait for it to end or "
                                       "stop it") from None
            try:  # the lock file a holder removes on exit may be the one just locked
                if os.stat(lock).st_ino == os.fstat(fd).st_ino:
                    break
            except FileNotFoundError:
                pass
            os.close(fd)
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            yield
        finally:
            with contextlib.suppress(OSError):
                lock.unlink()
            os.close(fd)

    def drop_torn_tail(self) -> None:
        """If the file does not end with a newline, rewrite it without its last partial
        line (atomically, through a temporary file), with a warning naming it; raises
        :class:`OutputError` for a symbolic link (never replaced) or a failed write."""
        _refuse_link(self.path)
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return
        if not data or data.endswith(b"\n"):
            return
        keep = data[: data.rfind(b"\n") + 1]
        warnings.warn(f"{self.path}: dropping a torn last line ({len(data) - len(keep)} bytes "
                      "written by a run that was killed mid-write)", stacklevel=3)
        write_output(self.path, keep)

    def lines(self) -> list[ResultRecord | RunRecord]:
        """Every line of this file (none when it does not exist yet)."""
        return [line for _, line in self.numbered_lines()]

    def numbered_lines(self) -> list[tuple[int, ResultRecord | RunRecord]]:
        """Every line of this file with its line number (from 1)."""
        if not self.path.exists():
            return []
        return [(number, line) for _, number, line in numbered_lines([self.path])]


#: Result fields added by schema 3 (bench workloads, roofline figures), empty when upgraded.
_ADDED_IN_3 = ("workload", "bench_mode", "batch_spec", "arithmetic_intensity", "peaks",
               "frac_of_peak_bandwidth", "frac_of_peak_tflops", "roofline_floor_ms",
               "frac_of_roofline")


def _upgrade(data: dict[str, Any], found: int) -> dict[str, Any]:
    """A line of an older version as the current version. Version 1 had no ``kind``,
    ``step`` or comparison figures; versions 1 and 2 had no bench fields, and their
    timings no samples (``[]``), IQR or noise flag (null); versions 1 to 3 no drift probe
    (``[]``); fields added later with a default (``truth``, a run's ``shard``, the
    environment's ``device_index`` and ``device_uuid``, the peaks' ``cache_copy_gbps``,
    a shard's ``balance``, a timing's ``copies``, clocks, temperatures and ``fallback``)
    take it."""
    data = {**data, "schema_version": SCHEMA_VERSION}
    if found == 1:
        data = {"kind": "result", **data}
        data.setdefault("step", None)
        for name in COMPARISON_FIELDS:
            data.setdefault(name, None)
    if data.get("kind") == "result":
        if found < 3:
            for name in _ADDED_IN_3:
                data.setdefault(name, None)
        if isinstance(data.get("time_ms"), dict):
            older = {"iqr": None, "samples": [], "noisy": None} if found < 3 else {}
            data["time_ms"] = {**older, "probe": [], **data["time_ms"]}
    return data


#: Why a line nested deeper than Python's recursion limit is refused.
TOO_DEEP = "nested too deeply to be a record (no results line nests more than a few levels)"


def parse_line(data: object, file: Path, number: int) -> ResultRecord | RunRecord:
    """One decoded JSON line as a record.

    Raises
    ------
    ResultsFileError
        Naming ``file:number``: a newer or unknown ``schema_version``, or a line that does
        not match the schema (unknown status, missing or mistyped field, unknown field),
        or one nested too deeply for Python to parse (:data:`TOO_DEEP`).
    """
    if not isinstance(data, dict):
        raise ResultsFileError(file, number, f"a {type(data).__name__}, not a record object")
    found = data.get("schema_version")
    if isinstance(found, bool) or not isinstance(found, int):
        raise ResultsFileError(file, number, f"schema_version {found!r} is not an integer "
                               f"(this pagedbench reads 1 to {SCHEMA_VERSION})")
    if found > SCHEMA_VERSION:
        raise ResultsFileError(file, number, f"schema_version {found} was written by a newer "
                               f"pagedbench; this one reads 1 to {SCHEMA_VERSION}")
    if found < 1:
        raise ResultsFileError(file, number, f"schema_version {found} is not a pagedbench "
                               f"schema (1 to {SCHEMA_VERSION})")
    if found < SCHEMA_VERSION:
        data = _upgrade(data, found)
    try:
        return LINE.validate_json(json.dumps(data))
    except ValidationError as exc:
        raise ResultsFileError(file, number, validation_problem(exc)) from None
    except RecursionError:
        raise ResultsFileError(file, number, TOO_DEEP) from None


def _glued_record(text: str) -> Any:
    """The JSON object that ends ``text`` after a torn prefix, or None."""
    start = text.find('{"', 1)
    while start != -1:
        try:
            value = json.loads(text[start:])
        except json.JSONDecodeError:
            start = text.find('{"', start + 1)
            continue
        return value if isinstance(value, dict) else None
    return None


def _files(paths: Iterable[Path]) -> Iterator[Path]:
    for path in paths:
        path = Path(path)
        if path.is_dir():
            yield from sorted(path.glob("*.jsonl"))
        elif path.exists():
            yield path
        else:
            raise ResultsFileError(path, None, "no such file or folder")


def read_lines(paths: Iterable[Path]) -> Iterator[ResultRecord | RunRecord]:
    """Every line of any number of ``.jsonl`` files or folders of them, in file order,
    validated (:func:`parse_line`). Torn lines are skipped with a warning naming the file.

    Raises
    ------
    ResultsFileError
        Naming the file and line of the first line refused, or a path that does not exist
        or cannot be read.
    """
    return (line for _, _, line in numbered_lines(paths))


def numbered_lines(paths: Iterable[Path]) -> Iterator[tuple[Path, int, ResultRecord | RunRecord]]:
    """:func:`read_lines` with the file and line number (from 1) of each line."""
    for file in _files(paths):
        try:
            chunks = file.read_bytes().split(b"\n")
        except OSError as exc:
            raise ResultsFileError(file, None, f"cannot be read ({exc.strerror})") from None
        last = len(chunks)  # the chunk after the last newline ("" when the file ends in one)
        for number, chunk in enumerate(chunks, 1):
            if not chunk.strip():
                continue
            try:
                data = json.loads(chunk.decode("utf-8"))
            except RecursionError:
                raise ResultsFileError(file, number, TOO_DEEP) from None
            except (UnicodeDecodeError, json.JSONDecodeError) as exc:
                if number == last:
                    warnings.warn(f"{file}:{number}: skipping a torn last line (a run killed "
                                  "mid-write)", stacklevel=2)
                    continue
                data = _glued_record(chunk.decode("utf-8", errors="replace"))
                if data is None:
                    raise ResultsFileError(file, number, f"not a JSON line ({exc})") from None
                warnings.warn(f"{file}:{number}: skipping a torn line glued to the next record "
                              "(files concatenated after a killed run)", stacklevel=2)
            yield file, number, parse_line(data, file, number)


def results_of(lines: Iterable[ResultRecord | RunRecord]) -> list[ResultRecord]:
    """The result records among ``lines``, each as the physical floor judges it
    (:func:`~.floor.judged`: an impossible time is a ``fail``), so that every reader (the
    reports, the site, the gate) refuses what was written before the floor existed."""
    return [floor.judged(line) for line in lines if isinstance(line, ResultRecord)]


@dataclass(frozen=True)
class RunState:
    """What the lines of one run say about it."""

    run_id: str
    started: RunRecord | None
    finished: RunRecord | None
    results: int

    @property
    def planned(self) -> int | None:
        """Results the finished run holds, when its start (and plan) was read: its
        shard's pairs for a run with ``--shard``."""
        if self.started is not None and self.started.shard is not None:
            return self.started.shard.pairs
        return self.started.plan.size if self.started and self.started.plan else None


def run_states(lines: Iterable[ResultRecord | RunRecord]) -> dict[str, RunState]:
    """Per run id: its start, its end (the last ``finished`` after the last start or
    resumption) and how many results were read."""
    started: dict[str, RunRecord] = {}
    finished: dict[str, RunRecord | None] = {}
    results: dict[str, set[tuple[str, str]]] = {}
    for line in lines:
        if isinstance(line, ResultRecord):
            results.setdefault(line.run_id, set()).add((line.impl, line.case_id))
        elif line.event == "started":
            started[line.run_id] = line
            finished[line.run_id] = None
        elif line.event == "finished":
            finished[line.run_id] = line
        else:  # resumed, interrupted: not finished any more
            finished[line.run_id] = None
    ids = list(dict.fromkeys([*started, *results]))
    return {i: RunState(i, started.get(i), finished.get(i), len(results.get(i, ()))) for i in ids}


__all__ = [
    "OutputError",
    "ResultsFile",
    "ResultsFileError",
    "RunState",
    "environment",
    "new_run_id",
    "numbered_lines",
    "parse_line",
    "read_lines",
    "results_of",
    "run_states",
    "write_output",
]
