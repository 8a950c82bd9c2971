"""The worker process: ``python -m pagedbench.harness.run.worker --fd N --parent PID``.

Started by :class:`~.protocol.Supervisor` (which documents the protocol), it makes itself
die with its parent (:func:`die_with_parent`) and a child subreaper (every process an
implementation starts stays its descendant) before it imports anything heavy, then reads
its job from standard input and runs it (:func:`~.jobs.work`: the job bodies, the only
code that imports an adapter), reporting over the pipe ``N``
(:class:`~.protocol.Channel`).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import signal
import sys
import threading
import time

from pagedbench.harness.run.protocol import Channel

#: How often the worker checks that its parent is alive (s).
PARENT_POLL_S = 0.5
#: ``prctl(2)`` options.
PR_SET_PDEATHSIG, PR_SET_CHILD_SUBREAPER = 1, 36


def die_with_parent(parent_pid: int) -> None:
    """Make this process die when ``parent_pid`` does: ``PR_SET_PDEATHSIG`` to SIGKILL on
    Linux (``prctl(2)``), an exit if the parent is already gone, and a daemon thread that
    kills this process group once the parent changes (where ``prctl`` is missing)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    if os.getppid() != parent_pid:
        os._exit(1)

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(PARENT_POLL_S)
        os.killpg(os.getpgrp(), signal.SIGKILL)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def main(argv: list[str] | None = None) -> None:
    """The worker process: ``python -m pagedbench.harness.run.worker --fd N --parent PID``,
    the job on standard input. Becomes a child subreaper, runs the job
    (:func:`~.jobs.work`), says ``done`` and waits to be killed (so that the parent
    finds every process it left), without running interpreter shutdown (a plug-in's
    threads or ``atexit`` hooks cannot hang it)."""
    parser = argparse.ArgumentParser(prog="python -m pagedbench.harness.run.worker")
    parser.add_argument("--fd", type=int, required=True)
    parser.add_argument("--parent", type=int, required=True)
    args = parser.parse_args(argv)
    die_with_parent(args.parent)
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    os.set_inheritable(args.fd, False)  # a subprocess a plug-in starts cannot write to it
    replies = os.fdopen(os.dup(0), "rb")  # not inheritable; fd 0 becomes /dev/null
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    channel = Channel(args.fd, replies)
    job = json.loads(replies.readline())

    from pagedbench.harness.run.jobs import work  # heavy: only once the watch is set up

    work(job, channel)
    channel.send({"kind": "done"})
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()
    replies.read()  # until the parent kills this process (or closes the pipe)
    os._exit(0)


if __name__ == "__main__":
    main()
