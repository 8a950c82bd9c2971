"""The worker protocol: a job runs in a child process (:mod:`.worker`) and reports over a
pipe; :class:`Supervisor` is the parent's side, :class:`Channel` the worker's end.

:class:`Supervisor` starts ``python -m pagedbench.harness.run.worker`` in a new
session (its own process group) with the environment of
:func:`~.environment.worker_environment`, writes it the job (one JSON line on its
standard input, which the worker moves off fd 0 at once: no job file), and reads one JSON
object per line from a dedicated pipe (the worker's stdout and stderr are forwarded to
the parent's stderr and their tail kept, so a plug-in printing cannot corrupt the
channel). Messages:

- ``{"kind": "step", "item": i or null, "party": ..., "step": name}``: the worker enters
  a step of item ``i`` (``null``: loading, before the first item). Accepted only for the
  item in flight (the job's first item, then the next one each time the caller says an
  item is done), a party the job allows and a step after the item's previous one in the
  job's order: a worker cannot go back, repeat a step, move to another item or reset a
  budget; anything else is a :class:`Fault` of kind ``invalid``. Each party has its own
  time budget per item; a step past it is killed and reported as a ``timeout`` fault,
  charged to that party;
- any other kind (``output``, ``loaded``, ...): the job's own messages, passed to the
  caller, whose :class:`Answer` may carry a reply (one JSON line back on the worker's
  standard input) and end the item; a message with ``"nbytes": n`` is followed by ``n``
  raw bytes, passed as ``message["payload"]`` (at most ``max_payload_bytes``). The
  caller's own time is not charged to the worker;
- ``{"kind": "done"}``: the job finished.

A worker that dies (signal, exit, closed pipe) is a :class:`Fault` of kind ``crash``
blamed on the step in flight. Workers die with their parent: ``PR_SET_PDEATHSIG``
(SIGKILL) on Linux, a check that the parent is still the one that started it, and a thread
that kills the worker's process group when the parent is gone; the parent kills the
worker's process group whenever it stops reading (an exception, SIGTERM, SIGINT). The
worker is a child subreaper (``PR_SET_CHILD_SUBREAPER``): processes an implementation
starts stay its descendants even in a new session or after their parent exits, and the
parent kills every descendant of a live worker before the worker itself.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

#: Seconds a worker gets to start (the interpreter, torch) before its first message.
STARTUP_TIMEOUT_S = 300.0
#: Seconds a worker gets to exit after ``done`` before it is killed.
EXIT_GRACE_S = 10.0
#: Characters of the worker's output kept for crash reasons.
OUTPUT_TAIL_CHARS = 4000
PARTIES = ("impl", "harness")
#: Rounds of killing a worker's descendants (each round kills those found; a process
#: that forks while it is killed leaves a child for the next round).
KILL_ROUNDS = 20
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


class Cancelled(Exception):
    """The run stopped (:meth:`Supervisor.cancel`): what a cancelled worker would still
    report is not recorded."""


class Answer(NamedTuple):
    """The caller's answer to a job message: ``reply`` (sent back to the worker) and
    whether the item in flight is done (the next one begins, with fresh budgets)."""

    reply: dict[str, Any] | None = None
    item_done: bool = False

class Channel:
    """The worker's ends of the pipes: messages out on ``fd``, replies in on ``replies``
    (a binary file)."""

    def __init__(self, fd: int, replies: Any) -> None:
        self.fd, self.replies = fd, replies

    def send(self, message: dict[str, Any], payload: bytes = b"") -> None:
        """Write one message as one line, then ``payload`` (its size in ``nbytes``, when
        there is one); exit at once when the parent is gone."""
        if payload:
            message = message | {"nbytes": len(payload)}
        data = (json.dumps(message, allow_nan=False) + "\n").encode() + payload
        view = memoryview(data)
        try:
            while view:
                view = view[os.write(self.fd, view):]
        except OSError:
            os._exit(1)

    def receive(self) -> dict[str, Any]:
        """The parent's next reply; exit at once when the parent is gone."""
        line = self.replies.readline()
        if not line:
            os._exit(1)
        return json.loads(line)

    def step(self, item: int | None, party: str, step: str) -> None:
        self.send({"kind": "step", "item": item, "party": party, "step": step})


def descendants(pid: int) -> list[int]:
    """Live (not zombie) descendants of ``pid``, from ``/proc`` (Linux; empty elsewhere)."""
    children: dict[int, list[int]] = {}
    for proc in Path("/proc").iterdir() if Path("/proc").is_dir() else ():
        if not proc.name.isdigit():
            continue
        try:
            state, ppid = (proc / "stat").read_text().rsplit(")", 1)[1].split()[:2]
        except (OSError, ValueError):
            continue
        if state != "Z":
            children.setdefault(int(ppid), []).append(int(proc.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), ()):
            found.append(child)
            todo.append(child)
    return found


def _kill_all(pids: Iterable[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


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
        JSON-ready; handed to the worker's :func:`~.jobs.work`. Its ``"start"`` (default
        0) is the first item.
    env : dict
        The worker's whole environment.
    budgets : dict
        Seconds per item for each party (``"impl"``, ``"harness"``); loading (item
        ``None``) gets the same budgets afresh.
    steps : tuple of str
        The job's steps in the order a worker may enter them within one item (loading
        included); a party not in ``budgets`` is refused.
    max_payload_bytes : int
        Largest payload a message may carry (bytes).

    The worker is started from the calling thread, and ``PR_SET_PDEATHSIG`` fires when
    that thread ends: call :meth:`run` from a thread that outlives it (the main one).
    """

    def __init__(self, job: dict[str, Any], env: dict[str, str], budgets: dict[str, float],
                 steps: tuple[str, ...], max_payload_bytes: int = 0) -> None:
        self.job, self.env, self.budgets, self.steps = job, env, budgets, steps
        self.max_payload_bytes = max_payload_bytes
        self.output_tail = ""
        self._process: subprocess.Popen | None = None
        self._lock = threading.Lock()
        self._cancelled = False

    def run(self, on_message: Callable[[dict[str, Any]], Answer | None]) -> Fault | None:
        """Start the worker and pass every job message to ``on_message``; return ``None``
        after ``done``, or the :class:`Fault` that ended it. The worker is killed (with
        its descendants and process group) before this returns or raises.

        Raises
        ------
        Cancelled
            If :meth:`cancel` came first: no worker is started.
        """
        read_fd, write_fd = os.pipe()
        try:
            with self._lock:
                if self._cancelled:
                    raise Cancelled("cancelled before its worker started")
                self._process = subprocess.Popen(
                    [sys.executable, *SAFE_PATH, "-m", "pagedbench.harness.run.worker",
                     "--fd", str(write_fd), "--parent", str(os.getpid())],
                    env=self.env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT, pass_fds=(write_fd,), start_new_session=True)
            os.close(write_fd)
            write_fd = -1
            job = (json.dumps(self.job) + "\n").encode()
            writer = threading.Thread(target=self._reply, args=(job,), daemon=True,
                                      name="job-writer")
            writer.start()  # the job may exceed the pipe's buffer: not from this thread
            return self._read(read_fd, on_message, writer)
        finally:
            if write_fd >= 0:
                os.close(write_fd)
            os.close(read_fd)
            self.kill()

    def _reply(self, data: bytes) -> None:
        """Write ``data`` to the worker's standard input (nothing when it is gone)."""
        process = self._process
        assert process is not None and process.stdin is not None
        with contextlib.suppress(OSError, ValueError):
            process.stdin.write(data)
            process.stdin.flush()

    def cancel(self) -> None:
        """Kill the worker now, from any thread (:meth:`run` then returns its ``crash``
        fault), or keep :meth:`run` from starting one: a run that stops."""
        with self._lock:
            self._cancelled = True
        self.kill()

    def kill(self) -> None:
        """Kill the worker's descendants (it is their subreaper, so they are all still
        below it while it lives), its process group, and the worker; reap it (idempotent)."""
        process = self._process
        if process is None:
            return
        for _ in range(KILL_ROUNDS):
            found = descendants(process.pid) if process.poll() is None else []
            if not found:
                break
            _kill_all(found)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        for pipe in (process.stdin, process.stdout):
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()

    def _forward(self, data: bytes) -> None:
        text = data.decode("utf-8", errors="replace")
        self.output_tail = (self.output_tail + text)[-OUTPUT_TAIL_CHARS:]
        with contextlib.suppress(OSError, ValueError):
            sys.stderr.write(text)
            sys.stderr.flush()

    def _last_output_line(self) -> str:
        lines = [line.strip() for line in self.output_tail.splitlines() if line.strip()]
        return f"; last output: {lines[-1][:300]}" if lines else ""

    def _read(self, read_fd: int, on_message: Callable[[dict[str, Any]], Answer | None],
              writer: threading.Thread) -> Fault | None:
        process = self._process
        assert process is not None and process.stdout is not None
        selector = selectors.DefaultSelector()
        selector.register(read_fd, selectors.EVENT_READ, "messages")
        selector.register(process.stdout, selectors.EVENT_READ, "output")
        first = self.job.get("start", 0)
        item: int | None = None  # the item in flight
        begun = False  # whether an item has begun (loading is over)
        party, step, position = "harness", "startup", -1
        used = dict.fromkeys(PARTIES, 0.0)
        started = time.monotonic()
        buffer = bytearray()
        pending: dict[str, Any] | None = None  # a message waiting for its payload
        messages_open = True

        def enter(new_party: str, new_step: str, new_position: int) -> None:
            nonlocal party, step, position, started
            now = time.monotonic()
            used[party] += now - started
            party, step, position, started = new_party, new_step, new_position, now

        def next_item() -> None:
            nonlocal item, used, begun
            enter("impl" if "impl" in self.budgets else party, "next item", -1)
            item, begun = (first if item is None else item + 1), True
            used = dict.fromkeys(PARTIES, 0.0)

        def refuse(why: str) -> Fault:
            return Fault("invalid", item, party, step, why)

        def accept_step(message: dict[str, Any]) -> Fault | None:
            new_item, new_party, new_step = message["item"], message["party"], message["step"]
            if new_party not in self.budgets or new_step not in self.steps:
                return refuse(f"sent a step the job has not ({new_party}: {new_step!r:.60})")
            if new_item is not None and not begun and new_item == first:
                next_item()
            elif new_item != item or (new_item is None and begun):
                return refuse(f"sent a step of item {new_item} while item {item} is in flight")
            new_position = self.steps.index(new_step)
            if new_position <= position:
                return refuse(f"entered {new_step!r} after {step!r}")
            enter(new_party, new_step, new_position)
            return None

        def handle(message: dict[str, Any]) -> Fault | None | bool:
            """A fault, True after ``done``, None otherwise."""
            nonlocal started
            if message["kind"] == "step":
                return accept_step(message)
            if message["kind"] == "done":
                return True
            if "item" in message and (not begun or message["item"] != item):
                return refuse(f"sent a {message['kind']!r:.40} of item {message['item']} while "
                              f"item {item} is in flight")
            paused = time.monotonic()
            answer = on_message(message)
            started += time.monotonic() - paused  # the caller's time is not the worker's
            if answer is not None and answer.reply is not None:
                writer.join()
                self._reply((json.dumps(answer.reply) + "\n").encode())
            if answer is not None and answer.item_done:
                next_item()
            return None

        while True:
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
                chunk = os.read(read_fd, 1 << 20)
                if not chunk:
                    selector.unregister(read_fd)
                    messages_open = False
                    continue
                buffer += chunk
                while True:
                    if pending is not None:
                        if len(buffer) < pending["nbytes"]:
                            break
                        pending["payload"] = bytes(buffer[:pending["nbytes"]])
                        del buffer[:pending["nbytes"]]
                        message, pending = pending, None
                    else:
                        end = buffer.find(b"\n")
                        if end < 0:
                            break
                        line = bytes(buffer[:end])
                        del buffer[:end + 1]
                        message = _message(line)
                        if message is None:
                            return refuse(f"sent a line that is not a message: {line[:200]!r}")
                        nbytes = message.get("nbytes", 0)
                        if nbytes:
                            if nbytes > self.max_payload_bytes:
                                return refuse(f"announced {nbytes} bytes of payload (at most "
                                              f"{self.max_payload_bytes})")
                            pending = message
                            continue
                    outcome = handle(message)
                    if outcome is True:
                        return None
                    if outcome is not None:
                        return outcome
            if not messages_open:
                try:
                    returncode = process.wait(timeout=EXIT_GRACE_S)
                except subprocess.TimeoutExpired:
                    return Fault("crash", item, party, step,
                                 "closed its message pipe but did not exit")
                self._drain(selector)
                return Fault("crash", item, party, step,
                             _signal_name(returncode) + self._last_output_line())
            if process.poll() is not None and not events:
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
    an int item; ``nbytes``, when there, is an int >= 0."""
    try:
        message = json.loads(line)
    except ValueError:
        return None
    if not isinstance(message, dict) or not isinstance(message.get("kind"), str):
        return None
    item = message.get("item")
    if message["kind"] == "step":
        valid = (isinstance(message.get("party"), str) and isinstance(message.get("step"), str)
                 and (item is None or type(item) is int))
    else:
        valid = message["kind"] != "output" or type(item) is int
    nbytes = message.get("nbytes", 0)
    return message if valid and type(nbytes) is int and nbytes >= 0 else None
