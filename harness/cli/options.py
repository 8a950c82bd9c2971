"""Option types and checks the commands share: devices, seconds, counts, run ids,
fractions, cache and output folders, the implementations chosen. Nothing heavy is imported
here (the parsers of the ``*_options.py`` modules use it); :func:`checked_device` asks the
machine, through torch, once a command runs."""

from __future__ import annotations

import argparse
import math
import os
import re
import tempfile
from pathlib import Path

from pagedbench.adapters import entries
from pagedbench.reference import PagedInputError, PagedValueError

from pagedbench.harness.results.shard_spec import ShardSpec, resolve as resolve_shard
from pagedbench.harness.run.config import DEFAULT_RESULTS_DIR, RunConfig
from pagedbench.harness.run.environment import CACHE_DIR_VARIABLE, default_cache_dir

#: Most torch threads a worker may be given.
MAX_THREADS = 1024
_RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def device_arg(text: str) -> str:
    """``--device``: ``cpu``, ``cuda`` or ``cuda:N`` (argparse type; not checked against
    this machine: :func:`checked_device`)."""
    if text == "cpu" or text == "cuda" or (text.startswith("cuda:") and text[5:].isdigit()):
        return text
    raise argparse.ArgumentTypeError(f"must be cpu, cuda or cuda:N, got {text!r}")


def _number(text: str) -> float:
    """``text`` as a float; NaN when it is not a number (refused by every check)."""
    try:
        return float(text)
    except ValueError:
        return math.nan


def positive_seconds(text: str) -> float:
    """A finite number of seconds > 0 (argparse type)."""
    value = _number(text)
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds > 0, got {text!r}")
    return value


#: The upper bound of an integer option that has none of its own (a count, a size).
UNBOUNDED = 2**62


def int_in(low: int, high: int = UNBOUNDED):
    """An argparse type: an integer in ``[low, high]`` (the message of one too small names
    ``high`` only where it is a bound of its own, not :data:`UNBOUNDED`)."""
    allowed = f">= {low}" + (f" and <= {high}" if high < UNBOUNDED else "")

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"must be an integer {allowed}, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be an integer {allowed}, got {value}")
        if value > high:
            bound = high if high < UNBOUNDED else "2**62"
            raise argparse.ArgumentTypeError(f"must be an integer >= {low} and <= {bound}, "
                                             f"got {value}")
        return value
    return parse


positive_int = int_in(1)


def run_id_arg(text: str) -> str:
    """A run id (``--resume``): letters, digits, ``.``, ``_``, ``-``."""
    if not _RUN_ID.fullmatch(text):
        raise argparse.ArgumentTypeError(f"must be a run id such as 20261130T041502Z-12345 "
                                         f"(letters, digits, '.', '_', '-'), got {text!r}")
    return text


def fraction(low_open: float, high_open: float):
    """An argparse type: a number in the open interval ``(low_open, high_open)``."""
    def parse(text: str) -> float:
        value = _number(text)
        if not (math.isfinite(value) and low_open < value < high_open):
            raise argparse.ArgumentTypeError(f"must be a number > {low_open:g} and < "
                                             f"{high_open:g}, got {text!r}")
        return value
    return parse


def cache_dir_argument(p: argparse.ArgumentParser,
                       what: str = "truth, compiler and scratch caches") -> None:
    """``--cache-dir DIR``, the same on every command that writes caches: ``what`` goes
    there (default: ``$PAGEDBENCH_CACHE_DIR``, else ``build`` of the working directory,
    as the pytest plugin's ``--pagedbench-cache-dir``)."""
    p.add_argument("--cache-dir", type=Path, default=default_cache_dir(),
                   help=f"{what} (default: ${CACHE_DIR_VARIABLE}, else build; now: "
                        f"{default_cache_dir()})")


def run_and_bench_arguments(p: argparse.ArgumentParser, unit: str) -> None:
    """The options ``run`` and ``bench`` share; ``unit`` names what they run (``case`` or
    ``point``)."""
    p.add_argument("--threads", type=int_in(1, MAX_THREADS), default=None,
                   help="torch threads per worker (default: "
                        f"{RunConfig.threads}: more wait for preempted threads on a "
                        "shared host; docs/gate.md)")
    p.add_argument("--case-timeout", type=positive_seconds, default=None, metavar="SECONDS",
                   help=f"the implementation's own time per {unit} (import and available, "
                        "then prepare, run, describe, timing); past it: 'timeout' (default: "
                        f"{RunConfig.case_timeout_s:g})")
    p.add_argument("--results-dir", type=Path, default=DEFAULT_RESULTS_DIR,
                   help=f"folder for <run-id>.jsonl and .md (default: {DEFAULT_RESULTS_DIR})")
    cache_dir_argument(p)
    p.add_argument("--junit-xml", type=Path, metavar="FILE",
                   help="also write the verdicts as JUnit XML, one testcase per "
                        f"(implementation, {unit}), for CI test reports")
    p.add_argument("--devices", default=None, metavar="cpu:N|all|0,1,...",
                   help=f"run on several devices at once, one worker per device, the "
                        f"(implementation, {unit}) pairs handed out as devices free up: "
                        "cpu:N (N CPU workers, whose timings contend) with --device cpu; "
                        "all, or GPU indices or UUIDs, with --device cuda (each worker pinned "
                        "to its GPU); every result names its device (docs/running.md)")
    p.add_argument("--no-peaks", action="store_true",
                   help="do not measure the device's copy bandwidth, in-cache copy and bf16 "
                        "throughput (then no fraction of peak, and no physical floor: "
                        "docs/trust.md)")
    p.add_argument("--peaks", type=Path, default=None, metavar="FILE",
                   help="take the device's peaks from FILE instead of measuring them: a JSON "
                        "object with copy_gbps, bf16_tflops and method (and "
                        "cache_copy_gbps), at its top or under 'peaks' (the GPU lane's "
                        "env.json, measured in the same call)")
    p.add_argument("--shard", type=shard_spec, default=None, metavar="K/N|auto",
                   help=f"run only the K-th of N parts of the (implementation, {unit}) "
                        "pairs, balanced by expected cost and the same on every machine; "
                        "report and gate merge the N results files; auto: K and N from the "
                        "CI (Buildkite parallelism, a Slurm array, a Kubernetes indexed Job "
                        "with auto/N, PAGEDBENCH_SHARD=K/N; docs/ci.md)")
    p.add_argument("--balance-from", type=Path, default=None, metavar="FILE",
                   help="with --shard: balance the parts by the seconds each pair took in "
                        "these results (a file or folder of an earlier run of the plan), "
                        "not by bytes moved; every shard needs the same FILE")


def shard_spec(text: str) -> ShardSpec:
    """``--shard K/N`` or ``auto`` (:func:`~pagedbench.harness.results.shard_spec.resolve`,
    from this process's environment)."""
    try:
        return resolve_shard(text)
    except PagedValueError as exc:  # argparse names the option before the message
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--shard ")) from None


def writable_folder(path: Path, option: str) -> None:
    """Create ``path`` if missing and check that a file can be written in it.

    Raises
    ------
    PagedValueError
        Naming ``option`` and ``path``: it is a file, lies under a file, or cannot be
        written (``/proc``, permissions).
    """
    if path.exists() and not path.is_dir():
        raise PagedValueError(option, str(path), "a folder",
                              f"{option} {path} is a file, not a folder")
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as exc:
        raise PagedValueError(option, str(path), "a folder pagedbench can create and write to",
                              f"{option} {path}: cannot create or write there "
                              f"({exc.strerror or exc})") from None


def existing_file(path: Path | None, option: str, folder_too: bool = False,
                  hint: str = "") -> None:
    """Check that ``path`` (an input file, or with ``folder_too`` a file or a folder of
    them; None: not given) exists, before the command starts (the command line itself
    parses without looking at the disk); ``hint`` ends the message.

    Raises
    ------
    PagedValueError
        Naming ``option`` and ``path``.
    """
    what = "file or folder" if folder_too else "file"
    if path is not None and not (path.exists() if folder_too else path.is_file()):
        raise PagedValueError(option, str(path), f"an existing {what}",
                              f"{option} {path}: no such {what}{hint}")


def writable_file(path: Path, option: str) -> None:
    """Check that ``path`` can be written: not a folder, in an existing writable folder.

    Raises
    ------
    PagedValueError
        Naming ``option`` and ``path``.
    """
    if path.is_dir():
        raise PagedValueError(option, str(path), "a file", f"{option} {path} is a folder")
    if not path.parent.is_dir():
        raise PagedValueError(option, str(path), "a file in an existing folder",
                              f"{option} folder {path.parent} does not exist")
    try:
        with tempfile.TemporaryFile(dir=path.parent):
            pass
    except OSError as exc:
        raise PagedValueError(option, str(path), "a file in a folder pagedbench can write to",
                              f"{option} {path}: cannot write there "
                              f"({exc.strerror or exc})") from None


def checked_device(text: str, devices: str = "") -> str:
    """``text`` once this machine has that device (before any worker starts). With
    ``devices`` (``--devices``) on a CUDA device, this process numbers GPUs as nvidia-smi
    does (``CUDA_DEVICE_ORDER=PCI_BUS_ID`` unless set, before CUDA starts), so an index
    names the same GPU here, in its worker and in the recorded UUID
    (:mod:`~pagedbench.harness.run.spread`)."""
    from pagedbench.reference.inputs import resolve_device  # torch, to ask the machine

    if devices and text.startswith("cuda"):
        os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    try:
        resolve_device(text)
    except PagedInputError as exc:
        raise PagedValueError("--device", text, exc.allowed, f"--device {text}: {exc}") from None
    return text


def select_impls(names: list[str]) -> dict[str, str]:
    """``{name: target}`` of the implementations ``--impl`` names (all when none), in
    order; raises ``PagedValueError`` naming the unknown ones."""
    known = {e.name: e.target for e in entries()}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise PagedValueError("--impl", unknown, f"among {', '.join(known)}",
                              f"--impl {', '.join(unknown)}: unknown; choose from "
                              f"{', '.join(known)}")
    return {n: known[n] for n in dict.fromkeys(names)} if names else known
