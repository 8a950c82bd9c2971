"""A process's CPU time counts its descendants', process by process: a grandchild still
running, and a child once waited for (Linux ``/proc``)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from pagedbench.harness.run.processes import tree_cpu_seconds

#: A child that starts a grandchild burning ``BURN_S`` of CPU, says so once it is done, and
#: waits on its standard input with the grandchild still there.
BURN_S = 0.3
BURNER = f"""
import subprocess, sys
burn = ("import sys, time\\nt = time.process_time()\\n"
        "while time.process_time() - t < {BURN_S}: pass\\nprint(flush=True)\\nsys.stdin.read()")
grandchild = subprocess.Popen([sys.executable, "-c", burn], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE)
grandchild.stdout.readline()
print(flush=True)
sys.stdin.read()
grandchild.stdin.close()
grandchild.wait()
"""


def _total(pid: int) -> float:
    return sum(tree_cpu_seconds(pid).values())


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc")
def test_descendants_count_while_they_run_and_once_waited_for() -> None:
    before = _total(os.getpid())
    child = subprocess.Popen([sys.executable, "-c", BURNER], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE)
    child.stdout.readline()  # the grandchild has burned its CPU and is still alive
    tree = tree_cpu_seconds(os.getpid())
    running = sum(tree.values()) - before
    assert len({pid for pid, _ in tree} & {os.getpid(), child.pid}) == 2 and len(tree) >= 3
    child.stdin.close()
    child.wait()
    waited = _total(os.getpid()) - before
    assert running >= BURN_S - 0.02, running  # two clock ticks of reading
    assert waited >= running - 0.02, (running, waited)
    assert tree_cpu_seconds(child.pid) == {}  # gone: nothing to read
