"""The benchmark sweep of ``pagedbench bench``: which workloads, paged how, on which points.

A :class:`Sweep` names the axes: mode x GQA layout x batch size x context length (the
grid), vLLM batch-spec strings and model presets (more workloads), and block size x dtype
(how each workload is paged). ``grid="full"`` takes the cartesian product of the grid
axes; ``grid="axes"`` varies one axis at a time around the centre (the first value of
each axis), the CPU default, so that a CPU sweep stays within minutes. Every workload is
also paged at its contiguous block size (one block per sequence, :meth:`~.workloads.
Workload.contiguous_block_size`), the reference of each implementation's paging overhead.

Points above ``max_flops`` are left out (every timed point is checked for conformance
first, against a float64 truth: the CPU sweeps' cap on its cost), as are grid
combinations a mode cannot take (``mixed`` needs two sequences, a chunk needs a context
of 8); :meth:`Sweep.left_out` counts them. ``pagedbench bench`` also leaves out points
whose truth fits neither the host budget nor the device (``harness/verdict/truth.py``).

Defaults (:func:`default_sweep`): on the CPU a one-axis-at-a-time sweep sized for about
5 minutes on 2 quiet cores (:data:`CPU_SWEEP`); on a GPU the full grid.

:func:`run_point_major` runs a plan one point at a time (``pagedbench bench
--point-major``, the GPU lane's sweep): every implementation at a point before the next
point, so that a run stopped early leaves whole points, and one point's device memory is
freed before the next. The sweep imports no torch (``pagedbench bench --help`` shows its
defaults); :func:`run_point_major` imports the runner when it is called.
"""

from __future__ import annotations

import fnmatch
import itertools
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from pagedbench.reference import DTYPES, PagedCase, PagedValueError

from pagedbench.harness.cases.presets import MODEL_PRESETS
from pagedbench.harness.cases.workloads import (BATCH_BOUNDS, CONTIGUOUS_TAG, LAYOUT_RATIOS,
                                                MAX_BATCH_SEQUENCES, MAX_SEQ_LEN, MODES, Workload,
                                                grid_workload, preset_workload, spec_workload)
from pagedbench.harness.measure.speed import Thresholds
from pagedbench.harness.measure.roofline import flops

if TYPE_CHECKING:
    from pagedbench.harness.results.record import DevicePeaks, Plan, ResultRecord, Shard
    from pagedbench.harness.results.store import ResultsFile
    from pagedbench.harness.run.config import RunConfig

GRIDS = ("full", "axes", "none")
#: Multiple the contiguous block size is rounded up to (flash-attn's paged KV needs 256).
CONTIGUOUS_MULTIPLE = 256


@dataclass(frozen=True)
class Sweep:
    """The points of a benchmark sweep.

    Attributes
    ----------
    modes, layouts : tuple[str, ...]
        Of :data:`~pagedbench.harness.cases.workloads.MODES`; layouts of
        :data:`~pagedbench.harness.cases.workloads.LAYOUT_RATIOS` or preset names (their heads and
        head_dim).
    batch_sizes, contexts : tuple[int, ...]
        Sequences per batch; the KV length of every sequence (tokens).
    block_sizes, dtypes : tuple
        How each workload is paged.
    grid : str
        ``"full"`` (cartesian product), ``"axes"`` (one axis at a time around the first
        values) or ``"none"`` (no grid workloads: only batch specs and presets).
    batch_specs : tuple[str, ...]
        vLLM batch-spec strings, each with every layout.
    presets : tuple[str, ...]
        Ragged decode batches of ``preset_batch_size`` up to ``preset_max_kv_len``.
    contiguous : bool
        Also page every workload at its contiguous block size.
    trace : tuple[Workload, ...]
        The steps of a batch trace (:mod:`~pagedbench.harness.cases.batch_trace`), in
        order; ``trace_file`` names the file they came from (``--trace``).
    workload_patterns : tuple[str, ...]
        Keep only workloads whose name matches one of these shell patterns (``fnmatch``);
        all when empty.
    max_flops : int or None
        Leave out points above this many FLOPs (their truth is too costly).

    Raises
    ------
    PagedValueError
        Naming the axis of an unknown mode, layout, dtype, preset or grid, an empty axis,
        or a size below 1.
    """

    modes: tuple[str, ...]
    layouts: tuple[str, ...]
    batch_sizes: tuple[int, ...]
    contexts: tuple[int, ...]
    block_sizes: tuple[int, ...]
    dtypes: tuple[str, ...]
    grid: str = "full"
    batch_specs: tuple[str, ...] = ()
    presets: tuple[str, ...] = ()
    preset_batch_size: int = 8
    preset_max_kv_len: int = 2048
    contiguous: bool = True
    trace: tuple[Workload, ...] = ()
    trace_file: str | None = None
    workload_patterns: tuple[str, ...] = ()
    max_flops: int | None = None
    _left_out: list[str] = field(default_factory=list, compare=False, repr=False)

    def __post_init__(self) -> None:
        choices = {"modes": MODES, "layouts": (*LAYOUT_RATIOS, *MODEL_PRESETS),
                   "dtypes": tuple(DTYPES), "presets": tuple(MODEL_PRESETS)}
        for axis, allowed in choices.items():
            bad = [v for v in getattr(self, axis) if v not in allowed]
            if bad:
                raise PagedValueError(axis, bad, f"among {list(allowed)}")
        for axis in ("modes", "layouts", "batch_sizes", "contexts", "block_sizes", "dtypes"):
            if not getattr(self, axis):
                raise PagedValueError(axis, [], "at least one value")
        for axis in ("batch_sizes", "contexts", "block_sizes"):
            bad = [v for v in getattr(self, axis)
                   if isinstance(v, bool) or not isinstance(v, int) or v < 1]
            if bad:
                raise PagedValueError(axis, bad, "ints >= 1")
        for axis, high in (("batch_sizes", MAX_BATCH_SEQUENCES), ("contexts", MAX_SEQ_LEN)):
            bad = [v for v in getattr(self, axis) if v > high]
            if bad:
                raise PagedValueError(axis, bad, f"ints <= {high} ({BATCH_BOUNDS})")
        if self.grid not in GRIDS:
            raise PagedValueError("grid", self.grid, f"one of {list(GRIDS)}")

    def _grid_points(self) -> list[tuple[str, str, int, int]]:
        axes = (self.modes, self.layouts, self.batch_sizes, self.contexts)
        if self.grid == "none":
            return []
        if self.grid == "full":
            return list(itertools.product(*axes))
        centre = tuple(axis[0] for axis in axes)
        points = [centre]
        for i, axis in enumerate(axes):
            points += [centre[:i] + (value,) + centre[i + 1:] for value in axis[1:]]
        return list(dict.fromkeys(points))

    def workloads(self) -> list[Workload]:
        """Grid workloads, then batch specs x layouts, then presets, then the trace's
        steps; filtered by :attr:`workload_patterns` and then in the order of the first
        pattern each matches (so ``--workload A --workload B`` runs A's points first),
        duplicates (by name) dropped."""
        found: list[Workload] = []
        for mode, layout, batch, context in self._grid_points():
            try:
                found.append(grid_workload(mode, layout, batch, context))
            except PagedValueError as exc:  # a mode this grid point cannot take
                self._left_out.append(f"{mode}-{layout}-b{batch}-kv{context}: {exc}")
        found += [spec_workload(spec, layout) for spec in self.batch_specs
                  for layout in self.layouts]
        found += [preset_workload(p, self.preset_batch_size, self.preset_max_kv_len)
                  for p in self.presets]
        found += self.trace
        if self.workload_patterns:
            rank = {w.name: next((i for i, p in enumerate(self.workload_patterns)
                                  if fnmatch.fnmatchcase(w.name, p)), None) for w in found}
            found = sorted((w for w in found if rank[w.name] is not None),
                           key=lambda w: rank[w.name])
        return list({w.name: w for w in found}.values())

    def cases(self) -> list[PagedCase]:
        """Every point: each workload at each dtype and block size, then at its contiguous
        block size (tagged :data:`~pagedbench.harness.cases.workloads.CONTIGUOUS_TAG`) unless a
        block size of the sweep already holds its longest sequence; points above :attr:`max_flops`
        left out."""
        self._left_out.clear()
        cases: list[PagedCase] = []
        for workload in self.workloads():
            contiguous = workload.contiguous_block_size(CONTIGUOUS_MULTIPLE)
            for dtype in self.dtypes:
                points = [workload.case(bs, dtype) for bs in self.block_sizes]
                if self.contiguous and max(self.block_sizes) < workload.context:
                    points.append(workload.case(contiguous, dtype, CONTIGUOUS_TAG))
                for case in points:
                    if self.max_flops is not None and flops(case) > self.max_flops:
                        self._left_out.append(f"{case.case_id}: {flops(case):.3g} FLOPs, "
                                              f"above max_flops {self.max_flops:.3g}")
                    else:
                        cases.append(case)
        return list({c.case_id: c for c in cases}.values())

    def left_out(self) -> list[str]:
        """Why each point of the axes was left out (after :meth:`cases`)."""
        return list(self._left_out)

    def arguments(self) -> list[str]:
        """The options of ``pagedbench bench`` that give this sweep's points back (the
        inverse of :func:`pagedbench.harness.cli.bench.bench_sweep`; the GPU lane's sweep
        step): every axis, the grid, the batch specs, presets and trace, ``--no-contiguous``
        without contiguous points, and the workloads by name (``--workload``), so that
        bench adds none of its defaults. What no option sets (:attr:`max_flops`, the
        presets' batch) is the bench device's default sweep's: this one must share it."""
        def each(flag: str, values: Iterable[object]) -> list[str]:
            return [arg for value in values for arg in (flag, str(value))]

        return [*each("--mode", self.modes), *each("--layout", self.layouts),
                *each("--batch-size", self.batch_sizes), *each("--context", self.contexts),
                *each("--block-size", self.block_sizes), *each("--dtype", self.dtypes),
                "--grid", self.grid, *each("--batch-spec", self.batch_specs),
                *each("--preset", self.presets),
                *(["--trace", self.trace_file] if self.trace_file else []),
                *each("--workload", [w.name for w in self.workloads()]),
                *([] if self.contiguous else ["--no-contiguous"])]

    def with_(self, **changes: object) -> Sweep:
        """A copy with some axes changed (validated again)."""
        return replace(self, **changes, _left_out=[])


#: The CPU default, sized for about 5 minutes on 2 quiet cores with :data:`CPU_IMPLS`
#: (the run lines of results/leaderboard-cpu/ say how long it took): every mode and layout around a
#: 4 x 256-token bf16 decode, and one preset's heads.
CPU_SWEEP = Sweep(
    modes=("decode", "prefill", "chunked", "mixed"),
    layouts=("gqa4", "mha", "gqa8", "mqa"),
    batch_sizes=(4, 1, 16),
    contexts=(256, 1024),
    block_sizes=(16, 32, 64),
    dtypes=("bfloat16",),
    grid="axes",
    presets=("llama3.1-70b-tp8",),
    preset_batch_size=8,
    preset_max_kv_len=512,
    max_flops=2**34,
)
#: The GPU default: the full grid, every preset.
GPU_SWEEP = Sweep(
    modes=MODES,
    layouts=("mha", "gqa4", "gqa8", "mqa"),
    batch_sizes=(1, 8, 32, 128),
    contexts=(1024, 4096, 16384),
    block_sizes=(16, 32, 64, 128),
    dtypes=("bfloat16", "float16"),
    grid="full",
    presets=tuple(MODEL_PRESETS),
    max_flops=2**38,
)
#: ``pagedbench bench --quick``: seconds per implementation (tests, smoke checks).
QUICK_SWEEP = Sweep(
    modes=("decode", "mixed"),
    layouts=("gqa4",),
    batch_sizes=(2,),
    contexts=(64,),
    block_sizes=(16, 32),
    dtypes=("float32",),
    grid="axes",
)
#: CPU timing of a sweep (``RunConfig`` fields): ``quick`` and the default sweep's. Both
#: take at least the samples ``pagedbench gate`` needs to judge a point
#: (``Thresholds.min_samples``; the default's for calls up to 0.55 s, 5 s / 9); a point
#: with fewer is "not judged" (exit 7), never passed. The default takes 20 over at least
#: 0.5 s: on a loaded 2-core host 9 samples left most unchanged points too noisy to
#: judge (docs/gate.md).
CPU_TIMING = {
    "quick": {"repetitions": Thresholds.min_samples, "time_budget_s": 0.05,
              "time_limit_s": 0.5},
    "default": {"repetitions": 20, "time_budget_s": 0.5, "time_limit_s": 5.0},
}
#: Implementations a CPU sweep runs by default: those that run natively on the CPU and
#: compile nothing per shape (flex-paged compiles each shape family for 5-30 s on the CPU,
#: adapters/flex_paged.py; Triton kernels run interpreted there and are never ranked).
CPU_IMPLS = ("sdpa-contiguous", "torch-gather", "vllm-cpu")


def point_order(plan: Plan,
                pairs: Collection[tuple[str, str]] | None = None) -> list[list[tuple[str, str]]]:
    """The (implementation, case id) pairs of ``plan`` (of ``pairs`` only, when given),
    one list per case in the plan's order, each in the plan's implementation order."""
    return [[(impl.name, case.case_id) for impl in plan.impls
             if pairs is None or (impl.name, case.case_id) in pairs]
            for case in plan.paged_cases()]


def run_point_major(plan: Plan, config: RunConfig, results: ResultsFile, run_id: str,
                    on_record: Callable[[ResultRecord], None] | None = None, *,
                    peaks: DevicePeaks | None = None, left_out: list[str] | None = None,
                    shard: Shard | None = None,
                    pairs: Collection[tuple[str, str]] | None = None) -> list[ResultRecord]:
    """:func:`~.runner.run` one point at a time: every implementation of ``plan`` on the
    first case, then on the next, ... (:func:`point_order`; with ``pairs``, only those).
    The first point's call records ``started`` (with ``left_out`` and ``shard``), each
    later one ``resumed`` (the run's results so far counted in its ``finished``), and
    :func:`~pagedbench.harness.measure.cuda_timers.release_device_memory` runs between
    points (the judge's device truths live in this process). Returns every result of the
    run.

    Raises
    ------
    runner.Interrupted
        On SIGTERM, SIGINT or SIGHUP: the points done are on disk, ``resume`` finishes.
    """
    from pagedbench.harness.measure.cuda_timers import release_device_memory
    from pagedbench.harness.run import runner

    records: list[ResultRecord] = []
    for index, point in enumerate(point_order(plan, pairs)):
        records = runner.run(plan, config, results, run_id, on_record, resume=index > 0,
                             peaks=peaks, left_out=left_out, shard=shard, pairs=point)
        release_device_memory()
    return records


def default_sweep(device: str, quick: bool = False) -> Sweep:
    """:data:`QUICK_SWEEP` when ``quick``, else :data:`CPU_SWEEP` for ``"cpu"`` and
    :data:`GPU_SWEEP` for ``"cuda"``/``"cuda:N"``."""
    if quick:
        return QUICK_SWEEP
    return CPU_SWEEP if device == "cpu" else GPU_SWEEP


__all__ = ["CPU_IMPLS", "CPU_TIMING", "CPU_SWEEP", "GPU_SWEEP", "GRIDS", "QUICK_SWEEP", "Sweep",
           "default_sweep", "point_order", "run_point_major"]
