"""The worker protocol: a job runs in a child process and reports over a pipe.

Parent side, :class:`Supervisor`: starts ``python -m pagedbench.harness.worker`` in a new
session (its own process group) with the environment of
:func:`~.environment.worker_environment`, hands it a job (JSON file), and reads one JSON
object per line from a dedicated pipe (the worker's stdout and stderr are forwarded to
the parent's stderr and their tail kept, so a plug-in printing cannot corrupt the
channel). Messages:

- ``{"kind": "step", "item": i or null, "party": "impl" | "harness", "step": name}``: the
  worker enters a step of item ``i`` (``null``: loading, before the first item); each
  party has its own time budget per item, and a step past its party's budget is killed
  and reported as a :class:`Fault`, charged to that party;
- ``{"kind": "output", "item": i, "data": {...}}``, ``{"kind": "loaded", ...}``,
  ``{"kind": "fatal", ...}``: the job's own messages, passed to the caller;
- ``{"kind": "done"}``: the job finished.

A worker that dies (signal, exit, closed pipe) is a :class:`Fault` of kind ``crash``
blamed on the step in flight. Workers die with their parent: ``PR_SET_PDEATHSIG``
(SIGKILL) on Linux, a check that the parent is still the one that started it, and a thread
that kills the worker's process group when the parent is gone; the parent kills the
worker's process group whenever it stops reading (an exception, SIGTERM, SIGINT).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: Seconds a worker gets to start (the interpreter, torch) before its first message.
STARTUP_TIMEOUT_S = 300.0
#: Seconds a worker gets to exit after ``done`` before it is killed.
EXIT_GRACE_S = 10.0
#: Characters of the worker's output kept for crash reasons.
OUTPUT_TAIL_CHARS = 4000
#: How often the worker checks that its parent is alive (s).
PARENT_POLL_S = 0.5
PARTIES = ("impl", "harness")
#: Keeps the current folder off the worker's module path (``-m`` puts it first, so a
#: ``selectors.py`` there would run in the worker); ``-P`` is Python 3.11's.
SAFE_PATH = ("-P",) if sys.version_info >= (3, 11) else ()


@dataclass(frozen=True)
class Fault:
    """Why a worker stopped before ``done``.

    Attributes
    ----------
    kind : str
        ``"timeout"`` (a step outlived its party's budget: killed), ``"crash"`` (the
        worker died) or ``"invalid"`` (it sent something that is not a message).
    item : int or None
        The item in flight; ``None`` while loading, before the first item.
    party, step : str
        Who the step in flight is charged to, and its name.
    detail : str
        What happened, e.g. ``"took longer than 5 s"``, ``"died of SIGSEGV"``.
    """

    kind: str
    item: int | None
    party: str
    step: str
    detail: str


class Channel:
    """The worker's end of the message pipe (file descriptor ``fd``)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def send(self, message: dict[str, Any]) -> None:
        """Write one message as one line; exit at once when the parent is gone."""
        data = (json.dumps(message, allow_nan=False) + "\n").encode()
        try:
            while data:
                data = data[os.write(self.fd, data):]
        except OSError:
            os._exit(1)

    def step(self, item: int | None, party: str, step: str) -> None:
        self.send({"kind": "step", "item": item, "party": party, "step": step})


def die_with_parent(parent_pid: int) -> None:
    """Make this process die when ``parent_pid`` does: ``PR_SET_PDEATHSIG`` to SIGKILL on
    Linux (``prctl(2)``), an exit if the parent is already gone, and a daemon thread that
    kills this process group once the parent changes (where ``prctl`` is missing)."""
    if sys.platform.startswith("linux"):
        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(signal.SIGKILL), 0, 0, 0)
    if os.getppid() != parent_pid:
        os._exit(1)

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(PARENT_POLL_S)
        os.killpg(os.getpgrp(), signal.SIGKILL)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _signal_name(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"died of {signal.Signals(-returncode).name}"
        except ValueError:
            return f"died of signal {-returncode}"
    return f"exited with code {returncode}"


class Supervisor:
    """Run one job in a worker and read its messages (see the module docstring).

    Parameters
    ----------
    job : dict
        JSON-ready; handed to the worker's :func:`~.runner.work`.
    env : dict
        The worker's whole environment.
    budgets : dict
        Seconds per item for each party (``"impl"``, ``"harness"``); loading (item
        ``None``) gets the same budgets afresh.
    tmp_dir : Path
        Where the job file is written (deleted when the worker is done).

    The worker is started from the calling thread, and ``PR_SET_PDEATHSIG`` fires when
    that thread ends: call :meth:`run` from a thread that outlives it (the main one).
    """

    def __init__(self, job: dict[str, Any], env: dict[str, str], budgets: dict[str, float],
                 tmp_dir: Path) -> None:
        self.job, self.env, self.budgets, self.tmp_dir = job, env, budgets, Path(tmp_dir)
        self.output_tail = ""
        self._process: subprocess.Popen | None = None

    def run(self, on_message: Callable[[dict[str, Any]], None]) -> Fault | None:
        """Start the worker and pass every job message to ``on_message``; return ``None``
        after ``done``, or the :class:`Fault` that ended it. The worker is killed (with
        its process group) before this returns or raises."""
        self.tmp_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", suffix=".json", prefix="job-", dir=self.tmp_dir,
                                         delete=False) as f:
            json.dump(self.job, f)
        job_path = Path(f.name)
        read_fd, write_fd = os.pipe()
        try:
            self._process = subprocess.Popen(
                [sys.executable, *SAFE_PATH, "-m", "pagedbench.harness.worker",
                 "--job", str(job_path), "--fd", str(write_fd), "--parent", str(os.getpid())],
                env=self.env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT, pass_fds=(write_fd,), start_new_session=True)
            os.close(write_fd)
            write_fd = -1
            return self._read(read_fd, on_message)
        finally:
            if write_fd >= 0:
                os.close(write_fd)
            os.close(read_fd)
            self.kill()
            job_path.unlink(missing_ok=True)

    def kill(self) -> None:
        """Kill the worker's process group (idempotent) and reap the worker."""
        process = self._process
        if process is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        if process.stdout is not None:
            process.stdout.close()

    def _forward(self, data: bytes) -> None:
        text = data.decode("utf-8", errors="replace")
        self.output_tail = (self.output_tail + text)[-OUTPUT_TAIL_CHARS:]
        with contextlib.suppress(OSError, ValueError):
            sys.stderr.write(text)
            sys.stderr.flush()

    def _last_output_line(self) -> str:
        lines = [line.strip() for line in self.output_tail.splitlines() if line.strip()]
        return f"; last output: {lines[-1][:300]}" if lines else ""

    def _read(self, read_fd: int, on_message: Callable[[dict[str, Any]], None]) -> Fault | None:
        process = self._process
        assert process is not None and process.stdout is not None
        selector = selectors.DefaultSelector()
        selector.register(read_fd, selectors.EVENT_READ, "messages")
        selector.register(process.stdout, selectors.EVENT_READ, "output")
        item: int | None = None
        party, step = "harness", "startup"
        used = dict.fromkeys(PARTIES, 0.0)
        started = time.monotonic()
        buffer = b""
        messages_open = True
        done = False

        def enter(new_item: int | None, new_party: str, new_step: str) -> None:
            nonlocal item, party, step, started, used
            now = time.monotonic()
            used[party] += now - started
            if new_item != item:
                used = dict.fromkeys(PARTIES, 0.0)
            item, party, step, started = new_item, new_party, new_step, now

        while True:
            if done:
                try:
                    process.wait(timeout=EXIT_GRACE_S)
                except subprocess.TimeoutExpired:
                    pass  # killed by run()'s finally
                return None
            budget = STARTUP_TIMEOUT_S if step == "startup" else self.budgets[party]
            remaining = started + budget - used[party] - time.monotonic()
            if remaining <= 0:
                return Fault("timeout", item, party, step, f"took longer than {budget:g} s")
            events = selector.select(timeout=min(remaining, 1.0))
            for key, _ in events:
                if key.data == "output":
                    chunk = os.read(key.fd, 65536)
                    if chunk:
                        self._forward(chunk)
                    else:
                        selector.unregister(key.fd)
                    continue
                chunk = os.read(read_fd, 65536)
                if not chunk:
                    selector.unregister(read_fd)
                    messages_open = False
                    continue
                buffer += chunk
                *lines, buffer = buffer.split(b"\n")
                for line in lines:
                    message = _message(line)
                    if message is None:
                        return Fault("invalid", item, party, step,
                                     f"sent a line that is not a message: {line[:200]!r}")
                    kind = message["kind"]
                    if kind == "step":
                        enter(message["item"], message["party"], message["step"])
                    elif kind == "done":
                        done = True
                    else:
                        if kind == "output":
                            # The next item is in flight until its first step arrives.
                            enter(message["item"] + 1, "harness", "next item")
                        on_message(message)
            if not messages_open and not done:
                try:
                    returncode = process.wait(timeout=EXIT_GRACE_S)
                except subprocess.TimeoutExpired:
                    return Fault("crash", item, party, step,
                                 "closed its message pipe but did not exit")
                self._drain(selector)
                return Fault("crash", item, party, step,
                             _signal_name(returncode) + self._last_output_line())
            if process.poll() is not None and not done and not events:
                self._drain(selector)
                return Fault("crash", item, party, step,
                             _signal_name(process.returncode) + self._last_output_line())

    def _drain(self, selector: selectors.BaseSelector) -> None:
        """Forward what the dead worker's output pipe still holds."""
        for key, _ in selector.select(timeout=0):
            if key.data == "output":
                with contextlib.suppress(OSError):
                    chunk = os.read(key.fd, 65536)
                    if chunk:
                        self._forward(chunk)


def _message(line: bytes) -> dict[str, Any] | None:
    """``line`` decoded as a message of this protocol, or None: an object with a str
    ``kind``; a ``step`` names its party and step and an int or null item, an ``output``
    an int item."""
    try:
        message = json.loads(line)
    except ValueError:
        return None
    if not isinstance(message, dict) or not isinstance(message.get("kind"), str):
        return None
    item = message.get("item")
    if message["kind"] == "step":
        valid = (message.get("party") in PARTIES and isinstance(message.get("step"), str)
                 and (item is None or type(item) is int))
    else:
        valid = message["kind"] != "output" or type(item) is int
    return message if valid else None


def main(argv: list[str] | None = None) -> None:
    """The worker process: ``python -m pagedbench.harness.worker --job FILE --fd N
    --parent PID``. Runs the job (:func:`~.runner.work`) and exits without running
    interpreter shutdown (a plug-in's threads or ``atexit`` hooks cannot hang it)."""
    parser = argparse.ArgumentParser(prog="python -m pagedbench.harness.worker")
    parser.add_argument("--job", type=Path, required=True)
    parser.add_argument("--fd", type=int, required=True)
    parser.add_argument("--parent", type=int, required=True)
    args = parser.parse_args(argv)
    die_with_parent(args.parent)
    os.set_inheritable(args.fd, False)  # a subprocess a plug-in starts cannot write to it
    channel = Channel(args.fd)
    job = json.loads(args.job.read_text())

    from .runner import work  # the job bodies; imported after the watch is set up

    work(job, channel)
    channel.send({"kind": "done"})
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
