"""What a worker's processes may not do: leave the worker's process tree, or reach into
another process. A seccomp filter (``seccomp(2)``, classic BPF) that the worker installs
on all its threads before it imports an implementation (:func:`confine`); every process
it starts inherits it. The judging parent and each worker are not dumpable
(:func:`close_memory`), so no process of the same user reads or writes their memory.

Refused with ``EPERM``:

- ``prctl(PR_SET_CHILD_SUBREAPER, 0)``: the worker is its processes' subreaper, so that
  every process they orphan stays its descendant, counted in the CPU of a timing
  (``processes.tree_cpu_seconds``) and killed with it. Clearing the flag, then a double
  fork, would put a helper outside the tree, its share of each timed call uncounted;
- ``clone`` with ``CLONE_PARENT``: the child would be the worker's parent's, not its own;
- ``prctl(PR_SET_DUMPABLE, n)`` with ``n`` not 0: the worker's memory stays closed;
- ``ptrace``, ``process_vm_readv``, ``process_vm_writev``: another process's memory (the
  judging parent's, where the kernel's ptrace policy lets the same user in).

``clone3`` gets ``ENOSYS``: its flags sit in memory the filter cannot read, and the C
library then falls back to ``clone`` (as container runtimes' default profiles rely on). A
system call of another ABI (32-bit calls on x86-64, x32) is refused too. The filter exists
for Linux on x86-64 and AArch64 (:data:`ARCHES`); elsewhere :func:`confine` installs
nothing and says so.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import platform
import struct
import sys
from collections.abc import Sequence

#: ``prctl(2)`` options, ``seccomp(2)``'s operation and flag, and ``clone(2)``'s flag.
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_GET_DUMPABLE = 1, 4, 3
PR_SET_NO_NEW_PRIVS, PR_SET_CHILD_SUBREAPER = 38, 36
SECCOMP_SET_MODE_FILTER, SECCOMP_FILTER_FLAG_TSYNC = 1, 1
CLONE_PARENT = 0x8000
#: Per machine: the audit architecture, and the numbers of the system calls filtered
#: (``prctl``, ``clone``, ``clone3``, ``ptrace``, ``process_vm_readv``,
#: ``process_vm_writev``) and of ``seccomp``, from the kernel's ``unistd`` tables.
ARCHES = {
    "x86_64": (0xC000003E, {"prctl": 157, "clone": 56, "clone3": 435, "ptrace": 101,
                            "process_vm_readv": 310, "process_vm_writev": 311,
                            "seccomp": 317}),
    "aarch64": (0xC00000B7, {"prctl": 167, "clone": 220, "clone3": 435, "ptrace": 117,
                             "process_vm_readv": 270, "process_vm_writev": 271,
                             "seccomp": 277}),
}
#: x86-64's x32 system calls carry this bit in their number.
X32_SYSCALL_BIT = 0x40000000
_ALLOW, _ERRNO = 0x7FFF0000, 0x00050000
# struct seccomp_data: nr at 0, arch at 4, args[i] at 16 + 8 i (low word first).
_NR, _ARCH, _ARG0, _ARG1 = 0, 4, 16, 24
_LD, _JEQ, _JGE, _JSET, _RET = 0x20, 0x15, 0x35, 0x45, 0x06


def _assemble(program: Sequence[tuple]) -> list[tuple[int, int, int, int]]:
    """Classic BPF from ``("ld", offset)``, ``("jeq" | "jge" | "jset", k, then, else)``,
    ``("ret", value)`` and ``("label", name)``; jump targets are labels, resolved to the
    forward offsets ``sock_filter`` holds."""
    where, count = {}, 0
    for op in program:
        if op[0] == "label":
            where[op[1]] = count
        else:
            count += 1
    out = []
    for op in program:
        kind = op[0]
        if kind == "label":
            continue
        here = len(out)
        if kind == "ld":
            out.append((_LD, 0, 0, op[1]))
        elif kind == "ret":
            out.append((_RET, 0, 0, op[1]))
        else:
            code = {"jeq": _JEQ, "jge": _JGE, "jset": _JSET}[kind]
            out.append((code, where[op[2]] - here - 1, where[op[3]] - here - 1, op[1]))
    return out


def program(machine: str) -> list[tuple[int, int, int, int]]:
    """The filter for ``machine`` (a key of :data:`ARCHES`), as ``(code, jt, jf, k)``.

    Raises
    ------
    KeyError
        If ``machine`` is not in :data:`ARCHES`.
    """
    arch, nr = ARCHES[machine]
    eperm, enosys = _ERRNO | errno.EPERM, _ERRNO | errno.ENOSYS
    return _assemble([
        ("ld", _ARCH), ("jeq", arch, "native", "eperm"),
        ("label", "native"), ("ld", _NR), ("jge", X32_SYSCALL_BIT, "eperm", "prctl?"),
        ("label", "prctl?"), ("jeq", nr["prctl"], "prctl", "clone?"),
        ("label", "clone?"), ("jeq", nr["clone"], "clone", "clone3?"),
        ("label", "clone3?"), ("jeq", nr["clone3"], "enosys", "ptrace?"),
        ("label", "ptrace?"), ("jeq", nr["ptrace"], "eperm", "readv?"),
        ("label", "readv?"), ("jeq", nr["process_vm_readv"], "eperm", "writev?"),
        ("label", "writev?"), ("jeq", nr["process_vm_writev"], "eperm", "allow"),
        ("label", "prctl"), ("ld", _ARG0),
        ("jeq", PR_SET_CHILD_SUBREAPER, "subreaper", "dumpable?"),
        ("label", "dumpable?"), ("jeq", PR_SET_DUMPABLE, "dumpable", "allow"),
        ("label", "subreaper"), ("ld", _ARG1), ("jeq", 0, "eperm", "allow"),
        ("label", "dumpable"), ("ld", _ARG1), ("jeq", 0, "allow", "eperm"),
        ("label", "clone"), ("ld", _ARG0), ("jset", CLONE_PARENT, "eperm", "allow"),
        ("label", "allow"), ("ret", _ALLOW),
        ("label", "eperm"), ("ret", eperm),
        ("label", "enosys"), ("ret", enosys),
    ])


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def prctl(option: int, value: int) -> int:
    """``prctl(option, value, 0, 0, 0)`` (Linux; the unused arguments must be 0); its
    return."""
    zero = ctypes.c_ulong(0)
    return _libc().prctl(option, ctypes.c_ulong(value), zero, zero, zero)


def _refused(name: str) -> OSError:
    number = ctypes.get_errno()
    return OSError(number, f"cannot confine the worker: {name} failed: "
                           f"{errno.errorcode.get(number, number)}")


def confine() -> str:
    """Confine this process, a worker (or a compile warm-up's process) before it imports
    an implementation: make it its descendants' subreaper (``PR_SET_CHILD_SUBREAPER``:
    every process they orphan stays below it), close its memory (:func:`close_memory`),
    then install the filter on every thread (``SECCOMP_FILTER_FLAG_TSYNC``:
    ``prctl(PR_SET_SECCOMP)`` filters the calling thread alone, and a thread started
    before it, reached by a plug-in that patches what the thread calls, would be free),
    and so on every process it starts from now on, with ``PR_SET_NO_NEW_PRIVS`` as an
    unprivileged filter needs. Returns what was done: ``"seccomp"``, or why no filter was
    installed (not Linux, another machine).

    Raises
    ------
    OSError
        If the kernel refuses ``PR_SET_NO_NEW_PRIVS`` or the ``seccomp`` call (the worker
        then ends before it loads an implementation, with this error as its crash's
        reason).
    """
    machine = platform.machine()
    if not sys.platform.startswith("linux"):
        return f"none: {sys.platform} is not Linux"
    prctl(PR_SET_CHILD_SUBREAPER, 1)
    close_memory()
    if machine not in ARCHES or struct.calcsize("P") != 8:
        return (f"none: no filter for {machine} ({struct.calcsize('P') * 8}-bit Python; "
                f"only 64-bit {', '.join(ARCHES)})")
    code = b"".join(struct.pack("=HBBI", *op) for op in program(machine))
    filters = ctypes.create_string_buffer(code)

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    fprog = SockFprog(len(code) // 8, ctypes.addressof(filters))
    if prctl(PR_SET_NO_NEW_PRIVS, 1) != 0:
        raise _refused("prctl(PR_SET_NO_NEW_PRIVS)")
    ulong = ctypes.c_ulong
    if _libc().syscall(
            ctypes.c_long(ARCHES[machine][1]["seccomp"]), ulong(SECCOMP_SET_MODE_FILTER),
            ulong(SECCOMP_FILTER_FLAG_TSYNC), ctypes.byref(fprog)) != 0:
        raise _refused("seccomp(SECCOMP_SET_MODE_FILTER, TSYNC)")  # or a thread that cannot
    return "seccomp"


def close_memory() -> None:
    """Make this process not dumpable (``PR_SET_DUMPABLE`` 0; Linux only): a process of
    the same user without ``CAP_SYS_PTRACE`` can then neither read nor write its memory
    (``/proc/<pid>/mem``, which no filter can refuse) nor take its descriptors
    (``pidfd_getfd``), whatever the kernel's ptrace policy (``ptrace(2)``, "Ptrace access
    mode checking"). The judging parent calls it before it starts a worker, and
    :func:`confine` in each worker (a worker beside it in a spread run is of the same
    user). ``execve`` makes a process dumpable again. The process itself then cannot read
    its own ``/proc/self/{environ,auxv,io,mem}`` either, and a debugger cannot attach."""
    if sys.platform.startswith("linux"):
        prctl(PR_SET_DUMPABLE, 0)


__all__ = ["ARCHES", "CLONE_PARENT", "PR_GET_DUMPABLE", "PR_SET_CHILD_SUBREAPER",
           "PR_SET_DUMPABLE", "PR_SET_PDEATHSIG", "close_memory", "confine", "prctl", "program"]
