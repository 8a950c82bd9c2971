"""What the GPU lane runs: its :class:`Selection` (the implementations, the bench
:class:`~pagedbench.harness.run.bench.Sweep` itself and how many of its points, the
conformance pass's preset), the ``truths`` step that precomputes host truths, the
``conformance`` step's ``pagedbench run`` and the ``sweep`` step's ``pagedbench bench
--point-major`` commands (the sweep's own options,
:meth:`~pagedbench.harness.run.bench.Sweep.arguments`), and what their results files say
afterwards."""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from pagedbench.reference import PagedCase

from pagedbench.harness.cases.presets import MODEL_PRESETS, preset_cases
from pagedbench.harness.lane import BUILD
from pagedbench.harness.measure.speed import Thresholds
from pagedbench.harness.run.bench import CPU_SWEEP, GPU_SWEEP, Sweep

#: Per-case limit of the conformance and sweep steps' workers (s): the warm-up compiled
#: before them. The rehearsal's timing samples per point (``--repetitions``, the gate's
#: minimum; on CUDA the timers take it themselves).
CASE_TIMEOUT_S = {"cuda": 30, "cpu": 30}
REHEARSAL_REPETITIONS = Thresholds.min_samples
#: The sweep's speedups are against this implementation, which it always runs.
SWEEP_BASELINE = "sdpa-contiguous"
#: What the GPU lane runs by default on CUDA: the baseline, ours, and the peers its carry
#: brings (vLLM's and SGLang's Triton files, FlashInfer, xformers). Others, installed on
#: a machine of one's own, are named with ``--impl``.
CUDA_IMPLS = (SWEEP_BASELINE, "torch-gather", "pagedbench-triton-split", "pagedbench-triton",
              "pagedbench-triton-prefill", "flex-paged", "vllm-unified", "vllm-decode",
              "vllm-chunked-prefill", "sglang-decode", "sglang-extend", "lmdeploy-decode",
              "lmdeploy-prefill", "flashinfer-nhd", "flashinfer-hnd", "xformers")


@dataclass(frozen=True)
class Selection:
    """What the lane runs: ``impls`` (those of them ``list`` finds available; the sweep
    adds :data:`SWEEP_BASELINE`), ``sweep`` (``pagedbench bench``'s own :class:`Sweep`,
    its points in the lane's order), ``points`` (the first N of them; None: as many as
    the time model fits) and the conformance pass's cases (``conformance_preset`` at
    ``conformance_block_sizes``, bf16: :meth:`conformance_cases`)."""

    sweep: Sweep
    impls: tuple[str, ...]
    points: int | None = None
    conformance_preset: str = "llama3.1-8b"
    conformance_block_sizes: tuple[int, ...] = (16, 64)

    def sweep_cases(self) -> list[PagedCase]:
        """The sweep's points, the first :attr:`points` of them when set."""
        cases = self.sweep.cases()
        return cases if self.points is None else cases[:self.points]

    def conformance_cases(self) -> list[PagedCase]:
        """``pagedbench run``'s cases of the conformance step: the preset's full and
        reduced decode batches (ragged, with the boundary lengths 1, block_size,
        block_size + 1) at each block size, bf16."""
        preset = MODEL_PRESETS[self.conformance_preset]
        sizes = self.conformance_block_sizes
        return (preset_cases(preset, sizes, ("bfloat16",))
                + preset_cases(preset, sizes, ("bfloat16",), reduced=True))

    def with_(self, **changes: Any) -> Selection:
        return replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready, as env.json records it: the sweep by its fields."""
        return {"impls": list(self.impls), "points": self.points,
                "conformance": {"preset": self.conformance_preset,
                                "block_sizes": list(self.conformance_block_sizes)},
                "sweep": {f.name: getattr(self.sweep, f.name) for f in fields(self.sweep)
                          if f.compare}}


#: The sweep's workloads on CUDA, in the order the lane runs them (each at block sizes 16
#: and 64, then contiguously): a serving batch first, then the launch-bound small batch,
#: one long sequence (split-KV), larger batches and contexts; the largest K/V last (the
#: host allocator draws a batch of 256 x 32k in seconds per implementation).
CUDA_WORKLOADS = ("32q1s4k", "8q1s1k", "q1s32k", "128q1s4k", "8q1s16k", "256q1s1k",
                  "q1s4k", "32q1s16k", "128q1s16k", "256q1s4k", "32q1s32k", "8q1s32k",
                  "q1s1k", "q1s16k", "32q1s1k", "8q1s4k", "128q1s1k", "128q1s32k",
                  "256q1s16k", "256q1s32k")
#: The CUDA lane: Llama-3-8B decode shapes (32 q / 8 KV heads, head_dim 128, bf16), the
#: grid batch 1/8/32/128/256 x context 1k/4k/16k/32k in the order of CUDA_WORKLOADS.
CUDA_SELECTION = Selection(sweep=GPU_SWEEP.with_(
    modes=("decode",), layouts=("llama3.1-8b",), batch_sizes=(1, 8, 32, 128, 256),
    contexts=(1024, 4096, 16384, 32768), block_sizes=(16, 64), dtypes=("bfloat16",),
    grid="full", presets=(), batch_specs=(),
    workload_patterns=tuple(f"decode-llama3.1-8b-{w}" for w in CUDA_WORKLOADS)),
    impls=CUDA_IMPLS)
#: The CPU rehearsal CI runs: the plain-torch baseline on two points (batch 2 x kv 64 and
#: 256 of one preset's heads at block size 16: one host truth, one device truth) through
#: the same steps; the conformance pass on that preset's cases at block size 16.
CPU_SELECTION = Selection(
    sweep=CPU_SWEEP.with_(
        modes=("decode",), layouts=("llama3.1-70b-tp8",), batch_sizes=(2,), contexts=(64, 256),
        block_sizes=(16,), dtypes=("bfloat16",), grid="full", presets=(), batch_specs=(),
        workload_patterns=(), contiguous=False),
    impls=("torch-gather",), conformance_preset="llama3.1-70b-tp8",
    conformance_block_sizes=(16,))
#: Largest truth (``truth.truth_bytes``: inputs plus one sequence's float64 work) the
#: lane computes on the host, by device. CUDA: what the ``truths`` step finishes on the
#: CPU beside the warm-up (the host draws and computes a reference at tens of MB/s), the
#: rest drawn and checked on the GPU. CPU: between the rehearsal's two contexts, so that
#: it takes both paths.
HOST_TRUTH_BYTES = {"cuda": 2**28, "cpu": 2**22}
#: Our kernels, right after the baseline at each point.
FIRST_IMPLS = ("pagedbench-triton-split", "pagedbench-triton", "pagedbench-triton-prefill")


def write_truths(cases: list[PagedCase], device: str) -> int:
    """Compute and cache (under ``build/``, where the runners read them) the float64
    truths of those of ``cases`` that take the host path (:data:`HOST_TRUTH_BYTES`);
    returns how many."""
    from pagedbench.harness.verdict.truth import fits_host, truth_for

    cases = [c for c in cases if fits_host(c, HOST_TRUTH_BYTES[device])]
    for case in cases:
        truth_for(case, BUILD)
    return len(cases)


def ordered_impls(impls: tuple[str, ...]) -> tuple[str, ...]:
    """``impls`` with :data:`FIRST_IMPLS` (ours) first, in that order; the rest as given."""
    return (*[n for n in FIRST_IMPLS if n in impls], *[n for n in impls if n not in FIRST_IMPLS])


def flags(flag: str, values: tuple) -> list[str]:
    """``[flag, value]`` for each of ``values``, as a repeatable option takes them."""
    return [arg for value in values for arg in (flag, str(value))]


def conformance_command(python: str, device: str, impls: tuple[str, ...],
                        selection: Selection, results_dir: Path, junit: Path) -> list[str]:
    """The conformance step: ``pagedbench run --no-timing`` of ``impls`` on
    :meth:`Selection.conformance_cases`, its verdicts also as JUnit XML in ``junit``."""
    return [python, "-m", "pagedbench.harness.cli", "run", "--device", device, "--no-timing",
            "--results-dir", str(results_dir), "--cache-dir", str(BUILD),
            "--case-timeout", str(CASE_TIMEOUT_S[device]), "--junit-xml", str(junit),
            *flags("--impl", ordered_impls(impls)),
            "--preset", selection.conformance_preset,
            *flags("--block-size", selection.conformance_block_sizes), "--dtype", "bfloat16"]


def sweep_command(python: str, device: str, impls: tuple[str, ...], selection: Selection,
                  results_dir: Path, peaks: Path | None = None) -> tuple[list[str], list[str]]:
    """The sweep step's command, and notes on how it runs.

    ``pagedbench bench --point-major`` (each point checked against its float64 truth, then
    timed; every implementation at a point before the next) on ``selection.sweep`` (its
    own options, :meth:`Sweep.arguments`) cut to ``--points selection.points``, ``impls``
    ordered by :func:`ordered_impls` after :data:`SWEEP_BASELINE`, the host path for
    truths up to :data:`HOST_TRUTH_BYTES`; ``--peaks peaks`` (the env step's env.json) so
    that every fraction of peak is of what ``env`` measured in this call, or bench's own
    measurement when ``peaks`` is None.
    """
    command = [python, "-m", "pagedbench.harness.cli", "bench", "--device", device,
               "--point-major", "--results-dir", str(results_dir), "--cache-dir", str(BUILD),
               "--case-timeout", str(CASE_TIMEOUT_S[device]),
               *flags("--impl", ordered_impls(impls)), "--baseline", SWEEP_BASELINE,
               *selection.sweep.arguments(),
               "--host-truth-bytes", str(HOST_TRUTH_BYTES[device])]
    if selection.points is not None:
        command += ["--points", str(selection.points)]
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
