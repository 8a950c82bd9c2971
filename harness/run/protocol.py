"""The process layer of a check: a job runs in a worker process (:func:`worker_main`) and
reports over a pipe; :class:`Supervisor` is the parent's side, :class:`Channel` the
worker's end. It keeps processes, framing and budgets; what the messages mean is
``harness/verdict/messages.py``'s and the check's (``harness/verdict/conformance.py``).

:class:`Supervisor` starts ``python -m pagedbench.harness.run.protocol`` (:func:`worker_main`) in a new session
(its own process group) with the environment of :func:`~.environment.worker_environment`,
writes it the job (one JSON line on its standard input, moved off fd 0 at once), and reads
messages from a dedicated pipe, one JSON line each and the payload it announces (at most
``max_payload_bytes``); the worker's stdout and stderr are forwarded to the parent's stderr
and their tail kept, so a plug-in printing cannot corrupt the channel.

- :class:`~pagedbench.harness.verdict.messages.Entered`: the worker enters a step, accepted
  only for the item in flight, in the job's order (never back, twice, or for another
  item); each party (the step's, from ``party_of``) has its own budget per item, and a step
  past it is killed as a ``timeout`` :class:`Fault` charged to that party;
- :class:`~pagedbench.harness.verdict.messages.Done`: the job finished;
- any other message goes to the caller, whose :class:`Answer` may carry a reply (one JSON
  line on the worker's standard input) and end the item; the caller's time is not the
  worker's. A line that is not a message is an ``invalid`` fault.

A worker that dies is a ``crash`` fault of the step in flight. Workers die with their
parent (``PR_SET_PDEATHSIG``, a check of the parent's pid, a watching thread); the
parent kills the worker's process group whenever it stops reading. The worker is a child
subreaper, so every process an implementation starts stays its descendant, and the parent
kills them all before the worker itself.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import selectors
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

from pydantic import BaseModel

from pagedbench.harness.run.confine import PR_SET_PDEATHSIG, close_memory, confine, prctl
from pagedbench.harness.run.environment import heavy_imports
from pagedbench.harness.run.processes import kill_descendants
from pagedbench.harness.verdict.messages import (HARNESS, IMPL, Done, Entered, Message,
                                                 parse_message, party_of)

#: Seconds a worker gets to start (the interpreter, torch) before its first message.
STARTUP_TIMEOUT_S = 300.0
#: Seconds a worker gets to exit after ``done`` before it is killed.
EXIT_GRACE_S = 10.0
#: Characters of the worker's output kept for crash reasons.
OUTPUT_TAIL_CHARS = 4000
PARTIES = (IMPL, HARNESS)
#: Keeps the current folder off the worker's module path (``-m`` puts it first, so a
#: ``selectors.py`` there would run in the worker).
SAFE_PATH = ("-P",)


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

    def send(self, message: Message) -> None:
        """Write one message as one line, then its payload; exit at once when the parent
        is gone."""
        view = memoryview(message.to_line() + message.payload)
        try:
            while view:
                view = view[os.write(self.fd, view):]
        except OSError:
            os._exit(1)

    def receive(self, reply: type[BaseModel]) -> BaseModel:
        """The parent's next reply, as ``reply``; exit at once when the parent is gone."""
        line = self.replies.readline()
        if not line:
            os._exit(1)
        return reply.model_validate_json(line)

    def step(self, item: int | None, step: str) -> None:
        """Announce ``step`` of ``item`` (None: loading)."""
        self.send(Entered(item=item, step=step))


def _signal_name(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"died of {signal.Signals(-returncode).name}"
        except ValueError:
            return f"died of signal {-returncode}"
    return f"exited with code {returncode}"


#: How often the worker checks that its parent is alive (s).
PARENT_POLL_S = 0.5


def die_with_parent(parent_pid: int) -> None:
    """Make this process die when ``parent_pid`` does: ``PR_SET_PDEATHSIG`` to SIGKILL on
    Linux (``prctl(2)``), an exit if the parent is already gone, and a daemon thread that
    kills this process group once the parent changes (where ``prctl`` is missing)."""
    if sys.platform.startswith("linux"):
        prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL))
    if os.getppid() != parent_pid:
        os._exit(1)

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(PARENT_POLL_S)
        os.killpg(os.getpgrp(), signal.SIGKILL)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def worker_main(argv: list[str] | None = None) -> None:
    """The worker process: ``python -m pagedbench.harness.run.protocol --fd N --parent
    PID --work MODULE:FUNCTION``, the job on standard input. Becomes a child subreaper,
    closes its memory and confines itself (:mod:`.confine`: no process of its tree may
    leave it), then dies with its parent, before it imports anything heavy; then imports
    and runs
    ``FUNCTION(job, channel)``, says ``done`` and waits to be killed (so that the parent
    finds every process it left), without running interpreter shutdown (a plug-in's
    threads or ``atexit`` hooks cannot hang it)."""
    parser = argparse.ArgumentParser(prog="python -m pagedbench.harness.run.protocol")
    parser.add_argument("--fd", type=int, required=True)
    parser.add_argument("--parent", type=int, required=True)
    parser.add_argument("--work", required=True, metavar="MODULE:FUNCTION")
    args = parser.parse_args(argv)
    confine()  # the subreaper flag, a closed memory, the filter: before any thread starts
    die_with_parent(args.parent)
    os.set_inheritable(args.fd, False)  # a subprocess a plug-in starts cannot write to it
    replies = os.fdopen(os.dup(0), "rb")  # not inheritable; fd 0 becomes /dev/null
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    channel = Channel(args.fd, replies)
    job = json.loads(replies.readline())
    module, _, function = args.work.partition(":")
    with heavy_imports():  # once watched
        work = getattr(importlib.import_module(module), function)
    work(job, channel)
    channel.send(Done())
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()
    replies.read()  # until the parent kills this process (or closes the pipe)
    os._exit(0)


class Supervisor:
    """Run one job in a worker and read its messages (see the module docstring).

    Parameters
    ----------
    job : dict
        JSON-ready; handed to ``work``. Its ``"start"`` (default 0) is the first item.
    work : str
        ``"module:function"`` the worker runs the job with (``function(job, channel)``).
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
    on_start : callable, optional
        Called with the worker's pid once it is started.

    The worker is started from the calling thread, and ``PR_SET_PDEATHSIG`` fires when
    that thread ends: call :meth:`run` from a thread that outlives it (the main one).
    """

    def __init__(self, job: dict[str, Any], env: dict[str, str], budgets: dict[str, float],
                 steps: tuple[str, ...], max_payload_bytes: int = 0,
                 on_start: Callable[[int], None] | None = None, *,
                 work: str = "pagedbench.harness.run.jobs:work") -> None:
        self.job, self.env, self.budgets, self.steps = job, env, budgets, steps
        self.work = work
        self.max_payload_bytes = max_payload_bytes
        self.on_start = on_start
        self.output_tail = ""
        self._process: subprocess.Popen | None = None
        self._lock = threading.Lock()
        self._cancelled = False

    def run(self, on_message: Callable[[Message], Answer | None]) -> Fault | None:
        """Start the worker (this process made not dumpable first: :func:`.close_memory`)
        and pass every job message to ``on_message``; return ``None`` after ``done``, or
        the :class:`Fault` that ended it. The worker is killed (with its descendants and
        process group) before this returns or raises.

        Raises
        ------
        Cancelled
            If :meth:`cancel` came first: no worker is started.
        """
        close_memory()
        read_fd, write_fd = os.pipe()
        try:
            with self._lock:
                if self._cancelled:
                    raise Cancelled("cancelled before its worker started")
                self._process = subprocess.Popen(
                    [sys.executable, *SAFE_PATH, "-m", "pagedbench.harness.run.protocol",
                     "--fd", str(write_fd), "--parent", str(os.getpid()), "--work", self.work],
                    env=self.env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT, pass_fds=(write_fd,), start_new_session=True)
            if self.on_start is not None:
                self.on_start(self._process.pid)
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
        if process.poll() is None:  # not reaped: its number is still its own
            kill_descendants(process.pid)
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

    def _read(self, read_fd: int, on_message: Callable[[Message], Answer | None],
              writer: threading.Thread) -> Fault | None:
        process = self._process
        assert process is not None and process.stdout is not None
        selector = selectors.DefaultSelector()
        selector.register(read_fd, selectors.EVENT_READ, "messages")
        selector.register(process.stdout, selectors.EVENT_READ, "output")
        clock = _StepClock(self.budgets, self.steps, self.job.get("start", 0))
        frames = _Frames(self.max_payload_bytes)
        messages_open = True
        while True:
            remaining, budget = clock.remaining()
            if remaining <= 0:
                return clock.fault("timeout", f"took longer than {budget:g} s")
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
                for message in frames.feed(chunk):
                    if isinstance(message, str):
                        return clock.fault("invalid", message)
                    outcome = self._handle(message, clock, on_message, writer)
                    if outcome is True:
                        return None
                    if outcome is not None:
                        return outcome
            if not messages_open:
                try:
                    returncode = process.wait(timeout=EXIT_GRACE_S)
                except subprocess.TimeoutExpired:
                    return clock.fault("crash", "closed its message pipe but did not exit")
                self._drain(selector)
                return clock.fault("crash", _signal_name(returncode) + self._last_output_line())
            if process.poll() is not None and not events:
                self._drain(selector)
                return clock.fault("crash", _signal_name(process.returncode)
                                   + self._last_output_line())

    def _handle(self, message: Message, clock: _StepClock,
                on_message: Callable[[Message], Answer | None],
                writer: threading.Thread) -> Fault | bool | None:
        """One message: a step entered, the end of the job, or the job's own message passed
        to ``on_message`` (whose time is not the worker's); a fault, True after
        :class:`~pagedbench.harness.verdict.messages.Done`, None otherwise."""
        if isinstance(message, Entered):
            why = clock.enter(message.item, message.step)
            return None if why is None else clock.fault("invalid", why)
        if isinstance(message, Done):
            return True
        item = getattr(message, "item", None)
        if item is not None and (not clock.begun or item != clock.item):
            return clock.fault("invalid", f"sent a {message.kind!r} of item {item} while item "
                                          f"{clock.item} is in flight")
        with clock.paused():
            answer = on_message(message)
        if answer is not None and answer.reply is not None:
            writer.join()
            self._reply((json.dumps(answer.reply) + "\n").encode())
        if answer is not None and answer.item_done:
            clock.next_item()
        return None

    def _drain(self, selector: selectors.BaseSelector) -> None:
        """Forward what the dead worker's output pipe still holds."""
        for key, _ in selector.select(timeout=0):
            if key.data == "output":
                with contextlib.suppress(OSError):
                    chunk = os.read(key.fd, 65536)
                    if chunk:
                        self._forward(chunk)


class _StepClock:
    """Which item and step a worker is in, and each party's time on the item: a step is
    accepted only for the item in flight (the job's first item, then the next one each
    time the caller says an item is done), in the job's order, never back or twice, and
    charged to the party :func:`~pagedbench.harness.verdict.messages.party_of` gives it."""

    def __init__(self, budgets: dict[str, float], steps: tuple[str, ...], first: int) -> None:
        self.budgets, self.steps, self.first = budgets, steps, first
        self.item: int | None = None  # the item in flight
        self.begun = False  # whether an item has begun (loading is over)
        self.party, self.step, self.position = HARNESS, "startup", -1
        self.used = dict.fromkeys(PARTIES, 0.0)
        self.started = time.monotonic()

    def remaining(self) -> tuple[float, float]:
        """Seconds left to the step in flight, and its party's budget."""
        budget = STARTUP_TIMEOUT_S if self.step == "startup" else self.budgets[self.party]
        return self.started + budget - self.used[self.party] - time.monotonic(), budget

    def fault(self, kind: str, detail: str) -> Fault:
        return Fault(kind, self.item, self.party, self.step, detail)

    def _switch(self, party: str, step: str, position: int) -> None:
        now = time.monotonic()
        self.used[self.party] += now - self.started
        self.party, self.step, self.position, self.started = party, step, position, now

    def next_item(self) -> None:
        """The caller ended the item in flight: the next one begins, with fresh budgets."""
        self._switch(IMPL if IMPL in self.budgets else self.party, "next item", -1)
        self.item, self.begun = (self.first if self.item is None else self.item + 1), True
        self.used = dict.fromkeys(PARTIES, 0.0)

    def enter(self, item: int | None, step: str) -> str | None:
        """Enter ``step`` of ``item``; why not, when it is refused."""
        party = party_of(step)
        if step not in self.steps or party not in self.budgets:
            return f"sent a step the job has not ({step!r:.60})"
        if item is not None and not self.begun and item == self.first:
            self.next_item()
        elif item != self.item or (item is None and self.begun):
            return f"sent a step of item {item} while item {self.item} is in flight"
        position = self.steps.index(step)
        if position <= self.position:
            return f"entered {step!r} after {self.step!r}"
        self._switch(party, step, position)
        return None

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """The caller's own time (judging) is not the worker's."""
        paused = time.monotonic()
        try:
            yield
        finally:
            self.started += time.monotonic() - paused


class _Frames:
    """Bytes from the message pipe, cut into messages: one JSON line each, followed by the
    ``nbytes`` of payload it announces (at most ``max_payload_bytes``)."""

    def __init__(self, max_payload_bytes: int) -> None:
        self.max_payload_bytes = max_payload_bytes
        self.buffer = bytearray()
        self.pending: tuple[Message, int] | None = None  # a message waiting for its payload

    def feed(self, chunk: bytes) -> Iterator[Message | str]:
        """The messages ``chunk`` completes, in order; a str says why the stream is not
        one of messages (nothing after it counts)."""
        self.buffer += chunk
        while True:
            if self.pending is not None:
                message, nbytes = self.pending
                if len(self.buffer) < nbytes:
                    return
                payload = bytes(self.buffer[:nbytes])
                del self.buffer[:nbytes]
                self.pending = None
                yield message.model_copy(update={"payload": payload})
                continue
            end = self.buffer.find(b"\n")
            if end < 0:
                return
            line = bytes(self.buffer[:end])
            del self.buffer[:end + 1]
            parsed = parse_message(line)
            if parsed is None:
                yield f"sent a line that is not a message: {line[:200]!r}"
                return
            message, nbytes = parsed
            if nbytes > self.max_payload_bytes:
                yield (f"announced {nbytes} bytes of payload (at most "
                       f"{self.max_payload_bytes})")
                return
            if nbytes:
                self.pending = (message, nbytes)
            else:
                yield message


if __name__ == "__main__":
    worker_main()
