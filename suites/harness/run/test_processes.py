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


def _own(pid: int) -> float:
    """Process ``pid``'s own figure (its waited-for children's included)."""
    (seconds,) = [t for (p, _), t in tree_cpu_seconds(pid).items() if p == pid]
    return seconds


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc")
def test_descendants_count_while_they_run_and_once_waited_for() -> None:
    before = _own(os.getpid())
    child = subprocess.Popen([sys.executable, "-c", BURNER], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE)
    child.stdout.readline()  # the grandchild has burned its CPU and is still alive
    tree = tree_cpu_seconds(child.pid)  # the child and the grandchild, in our own tree
    assert len(tree) == 2 and child.pid in {pid for pid, _ in tree}
    assert tree.keys() <= tree_cpu_seconds(os.getpid()).keys()
    running = sum(tree.values())
    child.stdin.close()
    child.wait()
    waited = _own(os.getpid()) - before  # theirs, through the child's wait and ours
    assert running >= BURN_S - 0.02, running  # two clock ticks of reading
    assert waited >= running - 0.02, (running, waited)
    assert tree_cpu_seconds(child.pid) == {}  # gone: nothing to read

