"""The worker's filter (``harness/run/confine.py``): its program, run here by a small
classic-BPF interpreter for every machine it is written for, decides each system call as
the module says; installed in a child process of this host, the kernel refuses what it
refuses and lets threads, subprocesses, forks and torch work, and a process that
double-forks out of a new session stays below the confined one, whichever thread it
starts from. A process whose memory is closed is not dumpable, and a child of the same
user cannot write its memory."""

from __future__ import annotations

import errno
import json
import os
import platform
import subprocess
import sys

import pytest

from pagedbench.harness.run.confine import (ARCHES, CLONE_PARENT, PR_SET_CHILD_SUBREAPER,
                                            PR_SET_DUMPABLE, program)

ALLOW, EPERM, ENOSYS = "allow", "EPERM", "ENOSYS"


def _decide(machine: str, nr: int, args: tuple[int, ...] = (), arch: int | None = None) -> str:
    """Run the filter on one ``seccomp_data`` (little-endian, each argument's low word
    first) with an interpreter of the four instructions it uses."""
    data = {0: nr, 4: ARCHES[machine][0] if arch is None else arch}
    for i, value in enumerate(args):
        data[16 + 8 * i], data[20 + 8 * i] = value & 0xFFFFFFFF, value >> 32
    code, pc, acc = program(machine), 0, 0
    while True:
        op, jt, jf, k = code[pc]
        if op == 0x20:
            acc = data.get(k, 0)
        elif op == 0x06:
            action, number = k & 0xFFFF0000, k & 0xFFFF
            return ALLOW if action == 0x7FFF0000 else errno.errorcode[number]
        else:
            taken = {0x15: acc == k, 0x35: acc >= k, 0x45: bool(acc & k)}[op]
            pc += jt if taken else jf
        pc += 1


@pytest.mark.parametrize("machine", sorted(ARCHES))
def test_the_program_decides_each_call_as_documented(machine: str) -> None:
    nr = ARCHES[machine][1]
    assert _decide(machine, nr["prctl"], (PR_SET_CHILD_SUBREAPER, 0)) == EPERM
    assert _decide(machine, nr["prctl"], (PR_SET_CHILD_SUBREAPER, 1)) == ALLOW
    assert _decide(machine, nr["prctl"], (PR_SET_CHILD_SUBREAPER + 1, 0)) == ALLOW
    assert _decide(machine, nr["prctl"], (PR_SET_DUMPABLE, 1)) == EPERM
    assert _decide(machine, nr["prctl"], (PR_SET_DUMPABLE, 0)) == ALLOW
    assert _decide(machine, nr["clone"], (CLONE_PARENT | 17,)) == EPERM
    assert _decide(machine, nr["clone"], (0x3D0F00,)) == ALLOW  # a thread's flags
    assert _decide(machine, nr["clone"], (17,)) == ALLOW  # fork: SIGCHLD alone
    assert _decide(machine, nr["clone3"], (0,)) == ENOSYS
    for name in ("ptrace", "process_vm_readv", "process_vm_writev"):
        assert _decide(machine, nr[name]) == EPERM, name
    assert _decide(machine, 0) == ALLOW and _decide(machine, 1) == ALLOW
    assert _decide(machine, nr["prctl"], (PR_SET_CHILD_SUBREAPER, 0),
                   arch=0x40000003) == EPERM  # another ABI (i386)
    if machine == "x86_64":
        assert _decide(machine, 0x40000000 | nr["clone"], (17,)) == EPERM  # x32


#: Run in a child process: start a thread, confine the process, then try each call (one of
#: them from the thread started before) and report what came back, and each thread's
#: seccomp mode.
PROBE = r"""
import ctypes, errno, json, os, pathlib, subprocess, sys, threading
from pagedbench.harness.run.confine import CLONE_PARENT, PR_SET_CHILD_SUBREAPER, confine
libc = ctypes.CDLL(None, use_errno=True)
libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
go, earlier = threading.Event(), {}
def before():
    go.wait()
    result = libc.prctl(PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)
    earlier["clear"] = errno.errorcode[ctypes.get_errno()] if result == -1 else "ok"
thread = threading.Thread(target=before)
thread.start()
got = {"confine": confine()}
go.set(); thread.join()
got["clear_subreaper_from_an_earlier_thread"] = earlier["clear"]
got["modes"] = sorted({line.split()[1] for task in pathlib.Path("/proc/self/task").iterdir()
                       for line in (task / "status").read_text().splitlines()
                       if line.startswith("Seccomp:")})
def call(name, result):
    got[name] = errno.errorcode[ctypes.get_errno()] if result == -1 else "ok"
call("clear_subreaper", libc.prctl(PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0))
got["dumpable_after"] = libc.prctl(3, 0, 0, 0, 0)  # PR_GET_DUMPABLE: closed by confine
call("dumpable", libc.prctl(4, 1, 0, 0, 0))
call("set_subreaper", libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0))
nr = {"x86_64": (56, 435, 101), "aarch64": (220, 435, 117)}[os.uname().machine]
call("clone_parent", libc.syscall(nr[0], CLONE_PARENT | 17, 0, 0, 0, 0))
call("clone3", libc.syscall(nr[1], 0, 0))
call("ptrace_parent", libc.syscall(nr[2], 16, os.getppid(), 0, 0))
got["subprocess"] = subprocess.run([sys.executable, "-c", "print(7)"], capture_output=True,
                                   text=True).stdout.strip()
seen = []
thread = threading.Thread(target=lambda: seen.append(1))
thread.start(); thread.join()
got["thread"] = seen
r, w = os.pipe()
pid = os.fork()
if pid == 0:
    os.setsid()
    if os.fork():
        os._exit(0)
    os.write(w, str(os.getppid()).encode())
    os._exit(0)
os.waitpid(pid, 0)
got["orphan_parent_is_me"] = int(os.read(r, 32)) == os.getpid()
import torch
torch.set_num_threads(2)
got["torch"] = float(torch.ones(256, 256).matmul(torch.ones(256, 256)).sum())
print(json.dumps(got))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux") or platform.machine() not in ARCHES,
                    reason="the filter exists for Linux on x86-64 and AArch64")
def test_a_confined_process_stays_in_its_tree_and_still_works() -> None:
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[-1]) == {
        "confine": "seccomp", "clear_subreaper_from_an_earlier_thread": "EPERM",
        "modes": ["2"], "clear_subreaper": "EPERM", "dumpable_after": 0, "dumpable": "EPERM",
        "set_subreaper": "ok",
        "clone_parent": "EPERM", "clone3": "ENOSYS", "ptrace_parent": "EPERM",
        "subprocess": "7", "thread": [1], "orphan_parent_is_me": True,
        "torch": 256.0 ** 3,
    }


#: Run in a child process: close its memory, then let a child of its own try to write it
#: through ``/proc/<pid>/mem``; print the dumpable flag before and after, and what the
#: memory holds at the end.
GUARDED = r"""
import ctypes, json, os, subprocess, sys
from pagedbench.harness.run.confine import PR_GET_DUMPABLE, close_memory
libc = ctypes.CDLL(None, use_errno=True)
secret = ctypes.create_string_buffer(b"verdict=fail")
before = libc.prctl(PR_GET_DUMPABLE, 0, 0, 0, 0)
close_memory()
writer = (f"with open('/proc/{os.getpid()}/mem', 'r+b', buffering=0) as f:\n"
          f"    f.seek({ctypes.addressof(secret)}); f.write(b'verdict=pass')")
wrote = subprocess.run([sys.executable, "-c", writer], capture_output=True).returncode == 0
print(json.dumps([before, libc.prctl(PR_GET_DUMPABLE, 0, 0, 0, 0), wrote,
                  secret.value.decode()]))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_DUMPABLE is Linux's")
def test_a_closed_process_is_not_dumpable_and_its_memory_is_its_own() -> None:
    """As root, ``CAP_SYS_PTRACE`` passes the kernel's check whatever the flag: the write
    is then not asserted (the flag still is)."""
    done = subprocess.run([sys.executable, "-c", GUARDED], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    before, after, wrote, value = json.loads(done.stdout.splitlines()[-1])
    assert (before, after) == (1, 0)
    if os.geteuid() != 0:
        assert (wrote, value) == (False, "verdict=fail")
