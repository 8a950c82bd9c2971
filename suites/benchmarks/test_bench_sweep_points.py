"""The points of ``pagedbench bench`` as pytest-benchmark items, one group per workload.

``pytest suites/benchmarks --benchmark-json=FILE`` (or ``--benchmark-autosave`` and
``--benchmark-compare``) stores them in pytest-benchmark's format. Which sweep:
``PAGEDBENCH_BENCH_SWEEP`` = ``quick`` (default, seconds: what ``make test`` runs) or
``default`` (the device's sweep of ``pagedbench bench``); the device is
``PAGEDBENCH_BENCH_DEVICE`` (``cpu`` by default); the implementations are
``harness.run.bench.CPU_IMPLS`` on the CPU, every built-in elsewhere.

Each item first checks the point for conformance (``harness.verdict.conformance.check``, as the
bench command does): a point that does not pass fails the item and is never timed;
unsupported or unavailable points are skipped with the reason. The harness timer
(``harness.measure.timing``: ``torch.utils.benchmark`` on the CPU, ``do_bench``/CUDA graphs on a
GPU) times ``run()``, and its samples are pytest-benchmark's rounds (one timing per
point: ``stats`` and ``--benchmark-compare-fail`` see what the board shows;
:func:`~pagedbench.suites.benchmarks.recording.record_timing`). ``extra_info`` carries the
same statistics and raw samples, bytes moved, FLOPs, GB/s, and, once the same session
has timed them, the paging overhead against the same implementation's contiguous point
(timed first in each workload) and the speedup over ``sdpa-contiguous`` on the same
point (timed first at each point); with pytest-xdist those two may be absent.
"""

from __future__ import annotations

import os

import pytest
import torch

from pagedbench.adapters import BUILTIN, load
from pagedbench.harness.cases.workloads import CONTIGUOUS_TAG, DEFAULT_BASELINE
from pagedbench.harness.measure.timing import time_cpu, time_cuda
from pagedbench.harness.measure.roofline import bytes_moved, flops
from pagedbench.harness.run.bench import CPU_IMPLS, default_sweep
from pagedbench.harness.verdict import conformance
from pagedbench.harness.verdict.status import Status
from pagedbench.reference import PagedValueError
from pagedbench.suites.benchmarks.recording import record_timing

pytestmark = pytest.mark.bench

SWEEPS = ("quick", "default")
SWEEP = os.environ.get("PAGEDBENCH_BENCH_SWEEP", "quick")
DEVICE = os.environ.get("PAGEDBENCH_BENCH_DEVICE", "cpu")
if SWEEP not in SWEEPS:
    raise PagedValueError("PAGEDBENCH_BENCH_SWEEP", SWEEP, f"one of {list(SWEEPS)}")
IMPLS = [DEFAULT_BASELINE, *(n for n in (CPU_IMPLS if DEVICE == "cpu" else BUILTIN)
                             if n != DEFAULT_BASELINE)]
# Contiguous points first in each workload, so that the paged ones find their reference.
CASES = sorted(default_sweep(DEVICE, quick=SWEEP == "quick").cases(),
               key=lambda c: (c.name, c.tag != CONTIGUOUS_TAG))
_medians: dict[tuple[str, str], float] = {}


@pytest.fixture(scope="module")
def adapters():
    return {}


def _time(adapter, prepared):
    call = lambda: adapter.run(prepared)  # noqa: E731
    if torch.device(DEVICE).type == "cuda":
        return time_cuda(call)
    quick = SWEEP == "quick"
    return time_cpu(call, threads=torch.get_num_threads(), min_samples=5 if quick else 10,
                    min_run_time_s=0.02 if quick else 0.5, max_run_time_s=0.2 if quick else 5)


@pytest.mark.parametrize("case", CASES, ids=[c.case_id for c in CASES])
@pytest.mark.parametrize("impl", IMPLS)
def test_sweep_point(benchmark, adapters, impl, case) -> None:
    if impl not in adapters:
        adapters[impl] = load(BUILTIN[impl])
    adapter = adapters[impl]
    verdict = conformance.check(adapter, case, DEVICE)
    if verdict.status in (Status.UNSUPPORTED, Status.UNAVAILABLE):
        pytest.skip(f"{impl}: {verdict.status}: {verdict.reason}")
    assert verdict.status is Status.PASS, f"{impl} on {case.case_id}: {verdict.status}: " \
        f"{verdict.reason} (a point that does not pass is never timed)"
    timing = _time(adapter, adapter.prepare(conformance.inputs_for(adapter, case, DEVICE)))
    _medians[impl, case.case_id] = timing.median_ms
    contiguous = next((c for c in CASES if c.name == case.name and c.dtype == case.dtype
                       and c.tag == CONTIGUOUS_TAG), None)
    ref = _medians.get((impl, contiguous.case_id)) if contiguous else None
    base = _medians.get((DEFAULT_BASELINE, case.case_id))
    benchmark.group = case.name
    moved = bytes_moved(case)
    benchmark.extra_info.update(
        impl=impl, case_id=case.case_id, workload=case.name, block_size=case.block_size,
        dtype=case.dtype, device=DEVICE, timing=timing.to_dict(), bytes_moved=moved,
        flops=flops(case), bandwidth_gbps=moved / timing.median_ms / 1e6,
        paging_overhead=timing.median_ms / ref - 1 if ref else None,
        speedup_vs=DEFAULT_BASELINE, speedup=base / timing.median_ms if base else None)
    record_timing(benchmark, timing)
