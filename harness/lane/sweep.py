"""What the GPU lane runs: its :class:`Selection` (the implementations, the bench
:class:`~pagedbench.harness.run.bench.Sweep` itself, the pytest targets), the ``truths``
step that precomputes the sweep's host truths, the ``sweep`` step's ``pagedbench bench``
command (the sweep's own options, :meth:`~pagedbench.harness.run.bench.Sweep.arguments`)
and what its results file says afterwards."""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from pagedbench.harness.lane import BUILD
from pagedbench.harness.run.bench import CPU_SWEEP, GPU_SWEEP, Sweep

#: Per-case limit passed to ``pagedbench bench --case-timeout`` (s), and the rehearsal's
#: timed calls per case (``--repetitions``; on CUDA the runner's own default).
CASE_TIMEOUT_S = {"cuda": 30, "cpu": 30}
REHEARSAL_REPETITIONS = 5
#: The suites that matter on a GPU: our kernels, conformance, the GPU peers' layouts.
#: Harness, allocator, simulator and reference stay in CI.
GPU_TESTS = (
    "suites/kernels",
    "suites/conformance",
    "suites/adapters/test_flash_attn_layout.py",
    "suites/adapters/test_flashinfer_layout.py",
    "suites/adapters/test_lmdeploy_triton.py",
    "suites/adapters/test_mla_cuda_layout.py",
    "suites/adapters/test_vllm_cuda_layout.py",
    "suites/adapters/test_vllm_triton_layout.py",
    "suites/adapters/test_xformers_layout.py",
)


@dataclass(frozen=True)
class Selection:
    """What the lane runs: ``impls`` (empty: those ``list`` finds available), ``sweep``
    (the points of the ``sweep`` step, ``pagedbench bench``'s own :class:`Sweep`) and
    ``tests`` (the pytest targets)."""

    sweep: Sweep
    impls: tuple[str, ...] = ()
    tests: tuple[str, ...] = GPU_TESTS

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready, as env.json records it: the sweep by its fields."""
        return {"impls": list(self.impls), "tests": list(self.tests),
                "sweep": {f.name: getattr(self.sweep, f.name) for f in fields(self.sweep)
                          if f.compare}}


#: The CUDA lane: Llama-3-8B decode shapes (32 q / 8 KV heads, head_dim 128, bf16), the
#: full grid, each point paged at 16 and 64 and contiguously, every available
#: implementation. Contexts of 4k and more first: bench walks the batch sizes, and within
#: each the contexts in this order (docs/KERNELS.md, "The GPU lane's sweep", has the
#: estimate of what fits the sweep's budget).
CUDA_SELECTION = Selection(sweep=GPU_SWEEP.with_(
    modes=("decode",), layouts=("llama3.1-8b",), batch_sizes=(1, 8, 32, 128, 256),
    contexts=(4096, 16384, 32768, 1024), block_sizes=(16, 64), dtypes=("bfloat16",),
    grid="full", presets=(), batch_specs=(), workload_patterns=()))
#: The CPU rehearsal CI runs: the plain-torch baseline on a grid of two workloads (batch
#: 2 x kv 64/256 of one preset's heads; 4 points with the contiguous ones) through the
#: same bench command, one host-truth and one device-truth context; one quick test module.
CPU_SELECTION = Selection(
    sweep=CPU_SWEEP.with_(
        modes=("decode",), layouts=("llama3.1-70b-tp8",), batch_sizes=(2,), contexts=(64, 256),
        block_sizes=(16,), dtypes=("bfloat16",), grid="full", presets=(), batch_specs=(),
        workload_patterns=()),
    impls=("torch-gather",), tests=("suites/adapters/test_vllm_cuda_layout.py",))
#: Largest truth (``truth.truth_bytes``: inputs plus one sequence's float64 work) the
#: lane computes on the host, by device. CUDA: the points the ``truths`` step can finish
#: within its budget on the CPU (8 points: the 1k contexts of batches 1, 8 and 32; the
#: host draws and computes a reference at tens of MB/s), the rest drawn and checked on
#: the GPU.
#: CPU: between the rehearsal's two contexts, so that it takes both paths.
HOST_TRUTH_BYTES = {"cuda": 2**28, "cpu": 2**22}
#: Our kernels, swept first (the runner times one implementation after another).
FIRST_IMPLS = ("pagedbench-triton-split", "pagedbench-triton", "pagedbench-triton-prefill")
#: The sweep's speedups are against this implementation when it runs, else the first.
SWEEP_BASELINE = "sdpa-contiguous"


def write_truths(selection: Selection, device: str) -> int:
    """Compute and cache (under ``build/``, where the sweep's runner reads them) the
    float64 truths of the sweep's points that take the host path
    (:data:`HOST_TRUTH_BYTES`); returns how many."""
    from pagedbench.harness.verdict.truth import fits_host, truth_for

    cases = [c for c in selection.sweep.cases() if fits_host(c, HOST_TRUTH_BYTES[device])]
    for case in cases:
        truth_for(case, BUILD)
    return len(cases)


def ordered_impls(impls: tuple[str, ...]) -> tuple[str, ...]:
    """``impls`` with :data:`FIRST_IMPLS` (ours) first, in that order; the rest as given."""
    return (*[n for n in FIRST_IMPLS if n in impls], *[n for n in impls if n not in FIRST_IMPLS])


def flags(flag: str, values: tuple) -> list[str]:
    """``[flag, value]`` for each of ``values``, as a repeatable option takes them."""
    return [arg for value in values for arg in (flag, str(value))]


def sweep_command(python: str, device: str, impls: tuple[str, ...], selection: Selection,
                  results_dir: Path, peaks: Path | None = None) -> tuple[list[str], list[str]]:
    """The sweep step's command, and notes on how it runs.

    ``pagedbench bench`` (each point checked against its float64 truth, then timed) on
    ``selection.sweep`` (its own options, :meth:`Sweep.arguments`), ``impls`` ordered by
    :func:`ordered_impls`, the host path for truths up to :data:`HOST_TRUTH_BYTES`;
    ``--peaks peaks`` (the env step's env.json) so that every fraction of peak is of what
    ``env`` measured in this call, or bench's own measurement when ``peaks`` is None.
    """
    impls = ordered_impls(impls)
    baseline = impls[0] if impls and SWEEP_BASELINE not in impls else SWEEP_BASELINE
    command = [python, "-m", "pagedbench.harness.cli", "bench", "--device", device,
               "--results-dir", str(results_dir), "--cache-dir", str(BUILD),
               "--case-timeout", str(CASE_TIMEOUT_S[device]),
               *flags("--impl", impls), "--baseline", baseline,
               *selection.sweep.arguments(),
               "--host-truth-bytes", str(HOST_TRUTH_BYTES[device])]
    notes = []
    if peaks is not None:
        command += ["--peaks", str(peaks)]
    else:
        notes.append("env measured no peaks: the sweep measures its own")
    if device == "cpu":
        command += ["--repetitions", str(REHEARSAL_REPETITIONS)]
    return command, notes


def _sweep_lines(jsonl: Path) -> list:
    """The lines of the sweep's results file; empty when it is missing or damaged (the
    step's log says why)."""
    from pagedbench.harness.results.store import ResultsFileError, read_lines

    try:
        return list(read_lines([jsonl]))
    except (ResultsFileError, OSError):
        return []


def write_sweep_markdown(jsonl: Path, md: Path) -> bool:
    """Write the report of the sweep's results to ``md`` when bench did not (it writes its
    own only when it finishes, not when stopped at the step's budget); whether it wrote."""
    from pagedbench.harness.results.report import markdown

    lines = _sweep_lines(jsonl)
    if md.exists() or not lines:
        return False
    md.write_text(markdown(lines, title="pagedbench bench (GPU lane sweep, stopped at its "
                           "budget)", baseline=SWEEP_BASELINE))
    return True


def sweep_coverage(jsonl: Path) -> dict[str, list[str]]:
    """What of its plan the sweep did not do: ``not_run`` (``impl:case_id`` pairs of the
    plan without a result: the step's budget ran out) and ``left_out`` (points bench left
    out, with why), from the results file; both empty when it is unreadable."""
    from pagedbench.harness.results.record import RunRecord
    from pagedbench.harness.results.store import results_of
    from pagedbench.harness.run.runner import missing

    lines = _sweep_lines(jsonl)
    starts = [r for r in lines if isinstance(r, RunRecord) and r.event == "started" and r.plan]
    if not starts:
        return {"not_run": [], "left_out": []}
    return {"not_run": [f"{impl}:{case_id}"
                        for impl, case_id in missing(starts[0].plan, results_of(lines))],
            "left_out": list(starts[0].left_out or [])}


def sweep_counts(jsonl: Path) -> dict[str, int]:
    """Results of the sweep by status (``{"pass": n, ...}``); empty when unreadable."""
    counts: dict[str, int] = {}
    with contextlib.suppress(OSError):
        for line in jsonl.read_text().splitlines():
            with contextlib.suppress(ValueError):
                record = json.loads(line)
                if record.get("kind") == "result":
                    counts[record["status"]] = counts.get(record["status"], 0) + 1
    return counts
