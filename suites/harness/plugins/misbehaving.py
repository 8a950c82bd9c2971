"""Test-only adapters whose metadata, availability or environment misbehave, and a slow
correct one.

Each is correct attention (``torch-gather``'s) unless its docstring says otherwise, so
the status a run gives it is due to its one fault.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import threading
import time

import numpy as np

from pagedbench.adapters.base import Availability
from pagedbench.adapters.torch_sdpa import TorchGather


class NumpyAndSetMetadata(TorchGather):
    """Availability.details and describe() hold numpy scalars, a set and a tuple (once the
    parent's JSON append raised and the run died); converted to JSON, the run passes."""

    name = "numpy-metadata"

    def available(self, device: str = "cpu") -> Availability:
        return Availability(True, version="1.0", details={
            "threads": np.int64(2), "ratio": np.float32(0.5), "fast": np.bool_(True),
            "isas": {"avx2", "avx512"}, "shape": (1, 2)})

    def describe(self, prepared) -> dict:
        return {"splits": np.int32(4), "kernels": frozenset({"b", "a"})}


class UnpicklableDescribe(TorchGather):
    """describe() returns a lock and a function (once a bare "crash, exit code 1"): not
    JSON data, refused as this implementation's ``error``."""

    name = "unpicklable-describe"

    def describe(self, prepared) -> dict:
        return {"lock": threading.Lock(), "callback": lambda: None}


class IntegerVersion(TorchGather):
    """``Availability.version`` is an int (once it broke ``pagedbench list --json`` for
    every implementation): recorded as the string ``"3"``."""

    name = "int-version"

    def available(self, device: str = "cpu") -> Availability:
        return Availability(True, version=3)


class ObjectVersion(TorchGather):
    """``Availability.version`` is an object with no JSON form: refused, ``error``."""

    name = "object-version"

    def available(self, device: str = "cpu") -> Availability:
        return Availability(True, version=object())


class SlowAvailable(TorchGather):
    """available() sleeps 1000 s (once: ``timeout`` after 125 s saying 5 s)."""

    name = "slow-available"

    def available(self, device: str = "cpu") -> Availability:
        time.sleep(1000)
        return super().available(device)


class HangsInRun(TorchGather):
    """run() never returns: its worker is in flight for as long as a test needs."""

    name = "hangs-in-run"

    def run(self, prepared):
        while True:
            time.sleep(1)


class SlowCorrect(TorchGather):
    """Correct, taking :data:`SLOW_S` seconds per run (a window to interrupt a run in)."""

    name = "slow-correct"
    SLOW_S = 1.5

    def run(self, prepared):
        time.sleep(self.SLOW_S)
        return super().run(prepared)


class SlowDeclarations(TorchGather):
    """Correct; ``why_unsupported`` computes for :data:`BUSY_S` seconds of CPU, as a
    declaration that inspects the case at length might. Once that work, done for the next
    case while the judge watched the process after the previous case's timing, failed
    that timing."""

    name = "slow-declarations"
    BUSY_S = 0.3

    def why_unsupported(self, case, device: str) -> list[str]:
        start = time.process_time()
        while time.process_time() - start < self.BUSY_S:
            pass
        return super().why_unsupported(case, device)


class ReportsEnvironment(TorchGather):
    """Correct; describe() records the names of its process's environment variables."""

    name = "reports-environment"

    def describe(self, prepared) -> dict:
        return {"environment": sorted(os.environ)}


class ReportsCollector(TorchGather):
    """Correct; describe() records whether its process collects cyclic garbage and how
    many objects it has frozen out of collection."""

    name = "reports-collector"

    def describe(self, prepared) -> dict:
        return {"gc_enabled": gc.isenabled(), "frozen": gc.get_freeze_count()}


class WritesIntoTheChannel(TorchGather):
    """run() writes a line that is not a message into pagedbench's message pipe (the fd
    its worker was given): the case is this implementation's ``error``, and the next case
    runs in a fresh worker."""

    name = "writes-into-the-channel"

    def run(self, prepared):
        fd = int(sys.argv[sys.argv.index("--fd") + 1])
        os.write(fd, b"not a message\n")
        return super().run(prepared)


class StartsDaemons(TorchGather):
    """Correct; each run() starts ``sleep 600`` in a new session, and another that its
    shell leaves an orphan, and writes their process ids to ``$PAGEDBENCH_TEST_PID_FILE``
    (once: they outlived the run)."""

    name = "starts-daemons"

    def run(self, prepared):
        direct = subprocess.Popen(["sleep", "600"], start_new_session=True)
        shell = subprocess.run(["sh", "-c", "setsid sleep 600 >/dev/null 2>&1 & echo $!"],
                               capture_output=True, text=True, check=True)
        with open(os.environ["PAGEDBENCH_TEST_PID_FILE"], "a") as f:
            f.write(f"{direct.pid}\n{shell.stdout.strip()}\n")
        return super().run(prepared)
