"""How a run runs and times (:class:`RunConfig`): recorded in its ``started`` line, handed
to every worker, restored by ``run --resume``; and the defaults the commands' options
show (threads, results folder, ``list``'s wait, the checkout's fault catalogue and
regression cases). It imports nothing heavy: a command's ``--help`` reads them without
torch."""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from pagedbench.reference import PagedValueError

#: Torch threads of a CPU timing unless chosen: with more, a call waits at every parallel
#: region for a thread the scheduler preempted, so on a shared host medians snap to
#: multiples of its 4 ms slice (``python -m pagedbench.harness.calibration.gate
#: --threads-study``; docs/gate.md has the figures).
CPU_THREADS = 1
#: Where ``pagedbench run`` and ``bench`` write their results unless ``--results-dir``.
DEFAULT_RESULTS_DIR = Path("results/runs")
#: Seconds ``pagedbench list`` gives each implementation to import and answer.
LIST_TIMEOUT_S = 120.0
#: The checkout this module belongs to (``pagedbench selftest`` runs its suites there).
CHECKOUT = Path(__file__).resolve().parents[2]
#: The fault catalogue's distribution metadata (``pagedbench selftest --catalogue``).
DEFAULT_CATALOGUE = CHECKOUT / "suites" / "faults" / "site"
#: Where failing cases found once are kept, and replayed by suites/regressions.
REGRESSION_CASES = CHECKOUT / "suites" / "regressions" / "cases"
#: Most CPU workers ``cpu:N`` may start.
MAX_CPU_WORKERS = 256
_CPU_SPEC = re.compile(r"cpu:([1-9][0-9]*)")
_GPU_ENTRY = re.compile(r"[0-9]+|GPU-[0-9A-Za-z-]+|MIG-[0-9A-Za-z/-]+")
_ALLOWED = ("'cpu:N' (N CPU workers) with --device cpu; 'all' or a comma-separated list of "
            "GPU indices or UUIDs ('0,1') with --device cuda")

def check_devices(devices: str, device: str) -> None:
    """Check ``--devices`` against ``--device`` without asking the machine.

    Raises
    ------
    PagedValueError
        Naming ``--devices``: not a str, ``cpu:N`` with N out of 1..:data:`MAX_CPU_WORKERS`
        or beside a CUDA device, GPU entries beside ``cpu`` or ``cuda:N`` (``--devices``
        chooses the GPUs), malformed or repeated entries.
    """
    if not isinstance(devices, str):
        raise PagedValueError("--devices", devices, _ALLOWED)
    if not devices:
        return
    cpu = _CPU_SPEC.fullmatch(devices)
    if device == "cpu":
        if cpu is None or int(cpu.group(1)) > MAX_CPU_WORKERS:
            raise PagedValueError("--devices", devices, _ALLOWED,
                                  f"--devices {devices!r} with --device cpu: must be cpu:N, "
                                  f"N from 1 to {MAX_CPU_WORKERS}")
        return
    if device != "cuda":
        raise PagedValueError("--devices", devices, _ALLOWED,
                              f"--devices {devices!r} with --device {device}: --devices "
                              "chooses the GPUs, so use --device cuda")
    entries = devices.split(",")
    if devices != "all" and (cpu is not None or not all(_GPU_ENTRY.fullmatch(e) for e in entries)
                             or len(set(entries)) != len(entries)):
        raise PagedValueError("--devices", devices, _ALLOWED,
                              f"--devices {devices!r} with --device cuda: must be 'all' or "
                              "distinct GPU indices or UUIDs, comma-separated ('0,1')")



@dataclass(frozen=True)
class RunConfig:
    """How to run and time.

    Attributes
    ----------
    device : str
        ``"cpu"``, ``"cuda"`` or ``"cuda:N"``.
    timing : bool
        Time implementations whose output passed.
    warmup, repetitions : int
        CPU timing: untimed calls, then at least this many samples (time permitting).
    time_budget_s, time_limit_s : float
        CPU timing: measure for at least ``time_budget_s``, longer when ``repetitions``
        samples of a slow call need it, never longer than ``time_limit_s`` (s).
    threads : int
        ``torch.set_num_threads`` in every worker (fixed, recorded in ``env.threads``;
        default :data:`CPU_THREADS`).
    case_timeout_s : float
        The implementation's budget per case, everything its worker does: its import and
        ``available`` (once), then ``why_unsupported``, inputs, ``prepare``, ``run``,
        ``describe`` and the timing (s). Past it: ``timeout``.
    harness_timeout_s : float
        pagedbench's budget per case for the judge's work in the parent: truths and
        comparisons (s). Past it: ``harness-error``. (A worker's start-up has
        ``protocol.STARTUP_TIMEOUT_S``.)
    cache_dir : Path
        Where float64 truths are cached between workers and runs.
    host_truth_bytes : int or None
        Largest :func:`~pagedbench.harness.verdict.truth.truth_bytes` of a case whose truth is
        computed on the host; larger ones get a device truth
        (:func:`~pagedbench.harness.verdict.truth.truth_site`). ``None``:
        :func:`~pagedbench.harness.verdict.truth.host_budget_bytes` of the machine the worker runs
        on.
    devices : str
        ``--devices``: ``""`` (one worker at a time), ``"cpu:N"`` (N CPU workers at once)
        or, with device ``"cuda"``, ``"all"`` or GPUs ``"0,1"`` (one worker per GPU):
        :func:`~.spread.device_slots`.
    suite : str
        Recorded in each result (``"default"``, ``"gpu-lane"``, ``"bench"``, ...); in a
        ``"bench"`` run each result also names its workload
        (:func:`~pagedbench.harness.cases.workloads.workload_fields`).

    Raises
    ------
    PagedValueError
        On a device other than cpu/cuda/cuda:N, a count or budget out of range, or
        ``devices`` that do not fit the device (:func:`check_devices`).
    """

    device: str = "cpu"
    timing: bool = True
    warmup: int = 1
    repetitions: int = 10
    time_budget_s: float = 0.5
    time_limit_s: float = 5.0
    threads: int = CPU_THREADS
    case_timeout_s: float = 300.0
    harness_timeout_s: float = 600.0
    cache_dir: Path = Path("build")
    suite: str = "default"
    host_truth_bytes: int | None = None
    devices: str = ""

    def __post_init__(self) -> None:
        text = self.device if isinstance(self.device, str) else ""
        kind, colon, index = text.partition(":")
        if kind not in ("cpu", "cuda") or (colon and not (kind == "cuda" and index.isdigit())):
            raise PagedValueError("device", self.device, "'cpu', 'cuda' or 'cuda:N'")
        for name, low in (("warmup", 0), ("repetitions", 1), ("threads", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise PagedValueError(name, value, f"an int >= {low}")
        for name in ("time_budget_s", "time_limit_s", "case_timeout_s", "harness_timeout_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise PagedValueError(name, value, "a finite number of seconds > 0")
        budget = self.host_truth_bytes
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int)
                                   or budget < 0):
            raise PagedValueError("host_truth_bytes", budget, "None or an int >= 0 (bytes)")
        if self.time_limit_s < self.time_budget_s:
            raise PagedValueError("time_limit_s", self.time_limit_s,
                                  f">= time_budget_s ({self.time_budget_s})")
        check_devices(self.devices, self.device)
        object.__setattr__(self, "cache_dir", Path(self.cache_dir))

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready; the cache folder is left out (it belongs to the machine)."""
        out = asdict(self)
        del out["cache_dir"]
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any], cache_dir: Path) -> RunConfig:
        """Inverse of :meth:`to_dict`, with ``cache_dir``; unknown keys are ignored."""
        known = {f.name for f in fields(cls)} - {"cache_dir"}
        return cls(**{k: v for k, v in data.items() if k in known}, cache_dir=cache_dir)


__all__ = ["CHECKOUT", "CPU_THREADS", "DEFAULT_CATALOGUE", "DEFAULT_RESULTS_DIR", "LIST_TIMEOUT_S",
           "REGRESSION_CASES", "RunConfig"]
