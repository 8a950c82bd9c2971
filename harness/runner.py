"""The runner: every implementation on every case, each implementation in its own process.

For each adapter the runner starts a worker process (``spawn``) that loads the adapter by
its ``"module:Class"`` target and walks the cases: ``available`` -> ``why_unsupported`` ->
``materialize`` -> ``prepare`` (untimed) -> ``run`` -> compare with the float64 truth ->
time (only when the output passed). Each result comes back to the parent as a JSON-ready
record and is appended to the results file at once. If the worker dies (segfault, abort,
CUDA illegal address) the case it was on is recorded as ``crash``; if a case outlives
``case_timeout_s`` the worker is killed and the case is ``timeout``; in both cases a fresh
worker continues with the remaining cases. One implementation's failure never loses
another's results (DESIGN.md, "Statuses").
"""

from __future__ import annotations

import dataclasses
import hashlib
import multiprocessing as mp
import os
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from pagedbench.adapters import Adapter, Availability, load
from pagedbench.reference import PagedCase, materialize

from . import tolerance
from .store import SCHEMA_VERSION, ResultsFile, Status, environment
from .timing import Timing, bytes_moved, flops, time_cpu, time_cuda

_REFERENCE_DIR = Path(__file__).resolve().parent.parent / "reference"


@dataclass(frozen=True)
class RunConfig:
    """How to run and time.

    Attributes
    ----------
    device : str
        ``"cpu"`` or ``"cuda"`` (``"cuda:N"`` allowed).
    timing : bool
        Time implementations whose output passed.
    warmup, repetitions : int
        CPU timing: untimed calls, then at most this many timed calls.
    time_budget_s : float
        CPU timing: stop repeating after this many seconds of timed calls (s).
    threads : int
        ``torch.set_num_threads`` in every worker (fixed, recorded in ``env.threads``).
    case_timeout_s : float
        A case (prepare + run + compare + timing) taking longer is ``timeout`` (s).
    cache_dir : Path
        Where float64 truths are cached between workers, and compiler caches live.
    suite : str
        Recorded in each result (``"default"``, ``"gpu-lane"``, ...).
    """

    device: str = "cpu"
    timing: bool = True
    warmup: int = 1
    repetitions: int = 30
    time_budget_s: float = 1.0
    threads: int = os.cpu_count() or 1
    case_timeout_s: float = 300.0
    cache_dir: Path = Path("build")
    suite: str = "default"

    def __post_init__(self) -> None:
        device_type = torch.device(self.device).type
        if device_type not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {self.device!r}")
        if self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")


def truth_for(case: PagedCase, cache_dir: Path) -> tolerance.Expected:
    """The float64 truth and the naive yardstick of ``case``, on the CPU.

    Computed once per case and kept in ``cache_dir/truth`` under a key that covers the
    case and the source of ``reference/`` (a change to the reference invalidates it).
    """
    digest = hashlib.sha256(repr(sorted(case.to_dict().items())).encode())
    for source in sorted(_REFERENCE_DIR.glob("*.py")):
        digest.update(source.read_bytes())
    path = Path(cache_dir) / "truth" / f"{digest.hexdigest()[:24]}.pt"
    if path.exists():
        saved = torch.load(path)
        return tolerance.Expected(saved["truth"], saved["naive"])
    expected = tolerance.Expected.of(materialize(case, "cpu"))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    torch.save({"truth": expected.truth, "naive": expected.naive}, tmp)
    os.replace(tmp, path)
    return expected


def _synchronize(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def _time(adapter: Adapter, prepared: Any, config: RunConfig) -> Timing:
    call = lambda: adapter.run(prepared)  # noqa: E731
    if adapter.is_interpreted(config.device):
        return time_cpu(call, warmup=0, repetitions=1, method="interpreted")
    if torch.device(config.device).type == "cuda":
        return time_cuda(call)
    return time_cpu(call, warmup=config.warmup, repetitions=config.repetitions,
                    budget_s=config.time_budget_s)


def base_record(target: str, name: str, case: PagedCase, config: RunConfig,
                availability: Availability | None) -> dict[str, Any]:
    """The fields every result line has, before the outcome is known."""
    return {
        "schema_version": SCHEMA_VERSION,
        "suite": config.suite,
        "impl": name,
        "impl_target": target,
        "impl_version": availability.version if availability else "",
        "impl_details": dict(availability.details) if availability else {},
        "case_id": case.case_id,
        "case": case.to_dict(),
        "device": config.device,
        "status": None,
        "reason": "",
        "max_abs_err": None,
        "max_rel_err": None,
        "max_err_ulps": None,
        "mean_err_ulps": None,
        "naive_abs_err": None,
        "allowed_abs_err": None,
        "err_over_allowance": None,
        "err_ratio_vs_naive": None,
        "worst_index": None,
        "time_ms": None,
        "time_ms_median": None,
        "timing_method": None,
        "interpreted": None,
        "tail_poison": None,
        "nan_tail_output_finite": None,
        "bytes_moved": bytes_moved(case),
        "flops": flops(case),
        "bandwidth_gbps": None,
        "tflops": None,
        "timestamp": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


def evaluate(adapter: Adapter, target: str, availability: Availability, case: PagedCase,
             config: RunConfig) -> dict[str, Any]:
    """Run one case through one adapter and return its result record. The
    implementation's faults become ``error``/``fail`` records; an exception from here is
    the harness's own (the worker records it as a harness error)."""
    record = base_record(target, adapter.name, case, config, availability)
    record["interpreted"] = adapter.is_interpreted(config.device)
    if not availability.ok:
        return record | {"status": str(Status.UNAVAILABLE), "reason": availability.reason}
    try:
        reasons = adapter.why_unsupported(case, config.device)
    except Exception as exc:
        return record | {"status": str(Status.ERROR),
                         "reason": f"why_unsupported raised: {_describe_exception(exc)}"}
    if reasons:
        return record | {"status": str(Status.UNSUPPORTED), "reason": "; ".join(reasons)}
    expected = truth_for(case, config.cache_dir)
    tail_poison = adapter.capabilities(config.device).tail_poison
    record["tail_poison"] = tail_poison
    inputs = materialize(case, config.device, tail_poison=tail_poison)
    try:
        prepared = adapter.prepare(inputs)
        out = adapter.run(prepared)
        _synchronize(config.device)
    except Exception as exc:  # the implementation's fault, recorded, never fatal
        return record | {"status": str(Status.ERROR), "reason": _describe_exception(exc)}
    try:
        record["impl_details"] = record["impl_details"] | adapter.describe(prepared)
    except Exception as exc:
        return record | {"status": str(Status.ERROR),
                         "reason": f"describe raised: {_describe_exception(exc)}"}
    result = tolerance.compare(out, expected, case.dtype, inputs.cu_seqlens_q.cpu())
    figures = dataclasses.asdict(result)
    record |= {key: figures[key] for key in record.keys() & figures.keys()} | {
        "status": str(Status.PASS if result.passed else Status.FAIL),
        "worst_index": None if result.worst_index is None else list(result.worst_index),
    }
    if result.passed and config.timing:
        try:
            timing = _time(adapter, prepared, config)
        except Exception as exc:
            return record | {"status": str(Status.ERROR),
                             "reason": f"while timing: {_describe_exception(exc)}"}
        seconds = timing.median_ms / 1e3
        record |= {
            "time_ms": timing.to_dict(),
            "time_ms_median": timing.median_ms,
            "timing_method": timing.method,
            "bandwidth_gbps": record["bytes_moved"] / seconds / 1e9 if seconds > 0 else None,
            "tflops": record["flops"] / seconds / 1e12 if seconds > 0 else None,
        }
    if result.passed and tail_poison == "stale":
        record["nan_tail_output_finite"] = _nan_tail_output_finite(adapter, case, config)
    return record


def _describe_exception(exc: BaseException) -> str:
    last = traceback.extract_tb(exc.__traceback__)[-1]
    return f"{type(exc).__name__}: {exc} ({Path(last.filename).name}:{last.lineno})"


def _nan_tail_output_finite(adapter: Adapter, case: PagedCase, config: RunConfig) -> bool | None:
    """For an adapter that declares ``nan_safe_tail=False``: does its output stay finite
    with NaN in the last blocks' tails after all? ``None`` when it raised. Recorded so a
    fix upstream shows (the declaration can then be dropped)."""
    try:
        out = adapter.run(adapter.prepare(materialize(case, config.device)))
        _synchronize(config.device)
    except Exception:
        return None
    return bool(torch.isfinite(out).all())


def _worker(target: str, cases: list[dict[str, Any]], config: RunConfig, channel: Any) -> None:
    """Worker process body: load the adapter, evaluate each case, report over ``channel``
    (the sending end of a pipe: each ``send`` is written before it returns, so a result
    sent just before a crash still reaches the parent).

    The environment is set before the adapter's module is imported, since Triton reads
    ``TRITON_INTERPRET`` when a kernel is decorated."""
    apply_environment(worker_environment(config.device, config.cache_dir))
    torch.set_num_threads(config.threads)
    try:
        adapter = load(target)
        availability = adapter.available(config.device)
    except Exception as exc:
        channel.send(("load_error", _describe_exception(exc)))
        return
    for index, case_dict in enumerate(cases):
        channel.send(("start", index))
        case = PagedCase.from_dict(case_dict)
        try:
            record = evaluate(adapter, target, availability, case, config)
        except Exception as exc:  # a fault of the harness itself, never the adapter's
            record = base_record(target, adapter.name, case, config, availability) | {
                "status": str(Status.ERROR),
                "reason": f"harness error, not the implementation's: {_describe_exception(exc)}",
            }
        channel.send(("result", index, record))
    channel.send(("done",))


def cache_environment(cache_dir: Path) -> dict[str, str]:
    """Environment variables that keep every cache and scratch folder inside
    ``cache_dir``, never the home folder or the system temp folder (TorchInductor's
    precompiled headers follow ``TMPDIR``, matplotlib's font cache ``MPLCONFIGDIR``).
    The folders are created."""
    cache_dir = Path(cache_dir).resolve()
    env = {
        "TRITON_CACHE_DIR": str(cache_dir / "triton-cache"),
        "TORCHINDUCTOR_CACHE_DIR": str(cache_dir / "inductor-cache"),
        "XDG_CACHE_HOME": str(cache_dir / "xdg-cache"),
        "MPLCONFIGDIR": str(cache_dir / "matplotlib"),
        "TMPDIR": str(cache_dir / "tmp"),
    }
    for folder in env.values():
        Path(folder).mkdir(parents=True, exist_ok=True)
    return env


def apply_environment(env: dict[str, str]) -> None:
    """Set ``env`` in this process, and make :mod:`tempfile` read ``TMPDIR`` again (it
    caches the temp folder at first use; TorchInductor derives its precompiled-header
    folder from it when ``torch._inductor.codecache`` is first imported)."""
    os.environ.update(env)
    tempfile.tempdir = None


def worker_environment(device: str, cache_dir: Path) -> dict[str, str]:
    """:func:`cache_environment`, plus the Triton interpreter when ``device`` is the CPU."""
    env = cache_environment(cache_dir)
    if torch.device(device).type == "cpu":
        env["TRITON_INTERPRET"] = "1"
    return env


def run_target(
    target: str,
    name: str,
    cases: list[PagedCase],
    config: RunConfig,
    emit: Callable[[dict[str, Any]], None],
) -> None:
    """Evaluate ``cases`` with the adapter ``target`` in worker processes, calling ``emit``
    with each record as it arrives; crashes and timeouts become records too."""
    context = mp.get_context("spawn")
    pending = list(range(len(cases)))
    while pending:
        receiver, sender = context.Pipe(duplex=False)
        batch = [cases[i] for i in pending]
        process = context.Process(
            target=_worker, args=(target, [c.to_dict() for c in batch], config, sender),
            daemon=True,
        )
        process.start()
        sender.close()  # the worker holds the only sending end: its death reads as EOF
        received = 0  # results in; the first case without one is the one in progress
        deadline = time.monotonic() + config.case_timeout_s + 120  # + process start-up
        finished = False
        while not finished:
            message = None
            if receiver.poll(1.0):
                try:
                    message = receiver.recv()
                except EOFError:  # the worker is gone and everything it sent is read
                    process.join(timeout=10)
            if message is None:
                if process.is_alive() and time.monotonic() <= deadline:
                    continue
                if process.is_alive():
                    process.kill()
                    status, reason = Status.TIMEOUT, f"no result within {config.case_timeout_s:g} s"
                else:
                    status, reason = Status.CRASH, f"worker died (exit code {process.exitcode})"
                if received < len(batch):
                    record = base_record(target, name, batch[received], config, None)
                    emit(record | {"status": str(status), "reason": reason})
                pending = pending[received + 1 :]
                break
            kind = message[0]
            if kind == "start":
                deadline = time.monotonic() + config.case_timeout_s
            elif kind == "result":
                emit(message[2])
                received += 1
            elif kind == "load_error":
                for case in batch:
                    record = base_record(target, name, case, config, None)
                    emit(record | {"status": str(Status.ERROR),
                                   "reason": f"adapter failed to load: {message[1]}"})
                pending = []
                finished = True
            else:  # done
                pending = []
                finished = True
        receiver.close()
        process.join(timeout=10)
        if process.is_alive():
            process.kill()


def run(
    adapters: dict[str, str],
    cases: list[PagedCase],
    config: RunConfig,
    results: ResultsFile,
    run_id: str,
    on_record: Callable[[dict[str, Any]], None] | None = None,
) -> list[dict[str, Any]]:
    """Evaluate every adapter (``{name: target}``, in order) on every case.

    Each record gets ``run_id`` and the environment, is appended to ``results`` as it
    arrives, and is passed to ``on_record`` (for progress display). Returns all records.
    """
    env = environment(config.device) | {"threads": config.threads}
    records: list[dict[str, Any]] = []

    def emit(record: dict[str, Any]) -> None:
        record = {"run_id": run_id, **record, "env": env}
        results.append(record)
        records.append(record)
        if on_record is not None:
            on_record(record)

    for name, target in adapters.items():
        run_target(target, name, cases, config, emit)
    return records


__all__ = ["RunConfig", "evaluate", "run", "run_target", "truth_for"]
