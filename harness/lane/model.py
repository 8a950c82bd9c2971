"""The GPU lane's time model: what a plan costs, step by step, before the lane starts.

A plan is the lane's counts (implementations, conformance cases, the sweep's points with
their bytes and rotated copies) and :class:`LaneCosts`, seconds per unit of work on one
kind of machine (:data:`COSTS`). :func:`lane_model` adds them up per step:

- ``setup`` (``scripts/gpu_lane.sh``: the shim, the carried wheels), ``env``, ``list``,
  ``warmup`` (its own budget: every implementation compiles at once, the slowest sets it;
  the host truths are computed beside it) and ``pack`` (what goes back): fixed;
- ``conformance``: a ``pagedbench run`` start, then per implementation a worker and one
  ``case_s`` per case;
- ``sweep``: a ``pagedbench bench`` start, then per point and implementation a worker
  (point-major: each point starts every implementation's worker again), ``case_s``,
  ``timing_s``, ``gib_s`` per GiB the point moves (drawing its inputs with the host
  allocator) and ``copy_s`` per rotated input copy; per point ``truth_gib_s`` per GiB.

:func:`points_that_fit` is the largest number of the sweep's points whose model stays
within :data:`MODEL_LIMIT_S`; the lane refuses a plan over it (``--points`` too many).
The costs of ``cpu`` were measured by the CPU rehearsal on a 2-core host; those of
``cuda`` are estimates for the H200 machine until a lane has run there: each lane writes
what its steps took (``lane.json``'s ``steps``, ``measured``) beside the model it printed,
so the next plan can take them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagedbench.reference import PagedCase

from pagedbench.harness.measure.timing import point_plan
from pagedbench.harness.measure.roofline import bytes_moved

GIB = 2**30
#: The L2 of the H200 the CUDA lane is planned for (NVIDIA's H200 datasheet: 60 MB; torch
#: reports ``L2_cache_size`` itself on the machine), for the H200 model the CPU rehearsal
#: prints.
H200_L2_BYTES = 60 * 2**20


@dataclass(frozen=True)
class LaneCosts:
    """Seconds each unit of the lane's work takes on one kind of machine (see the module
    docstring for what each covers)."""

    setup_s: float
    env_s: float
    list_s: float
    warmup_s: float
    run_start_s: float
    worker_s: float
    case_s: float
    timing_s: float
    gib_s: float
    copy_s: float
    truth_gib_s: float
    pack_s: float


#: Per machine kind. ``cuda``: the H200 machine (16 cores; estimates: a worker is python,
#: torch, pagedbench, the adapter and a CUDA context; FlashInfer's decode module comes
#: compiled in the carry, so the warm-up's longest is flex-paged's TorchInductor compile
#: and a few Triton kernels per implementation; ``gib_s`` is the host allocator's 15 us a
#: 16-token block, docs/KERNELS.md). ``cpu``: fitted to the CPU rehearsal's steps
#: (``bash scripts/gpu_lane.sh --rehearsal``; its step times: docs/gpu-lane.md, "The time
#: model and its figures").
COSTS = {
    "cuda": LaneCosts(setup_s=30, env_s=25, list_s=35, warmup_s=90, run_start_s=6,
                      worker_s=4.0, case_s=1.0, timing_s=0.5, gib_s=0.25, copy_s=0.02,
                      truth_gib_s=0.1, pack_s=5),
    "cpu": LaneCosts(setup_s=17, env_s=8, list_s=6, warmup_s=10, run_start_s=5.3,
                     worker_s=5.0, case_s=0.5, timing_s=0.5, gib_s=0.25, copy_s=0.0,
                     truth_gib_s=0.5, pack_s=2),
}
#: What the lane's model may add up to (s): 9 of the 15 minutes of device time a session
#: of the project's GPU machine has (its start takes 1-2 minutes; the rest is room to run
#: it again after a failed start).
MODEL_LIMIT_S = {"cuda": 540, "cpu": 240}


@dataclass(frozen=True)
class LanePlan:
    """What the lane will run: ``impls`` (names, the baseline included),
    ``conformance_cases`` (how many), ``points`` (the sweep's, in order), and ``l2_bytes``
    (the device's L2, for the rotated copies of each point; 0 on the CPU)."""

    device: str
    impls: tuple[str, ...]
    conformance_cases: int
    points: tuple[PagedCase, ...]
    l2_bytes: int = 0


def _copies(case: PagedCase, l2_bytes: int) -> int:
    return point_plan(case, l2_bytes).copies if l2_bytes else 1


def point_seconds(case: PagedCase, impls: int, costs: LaneCosts, l2_bytes: int) -> float:
    """Modelled seconds of one sweep point with ``impls`` implementations."""
    gib = bytes_moved(case) / GIB
    per_impl = (costs.worker_s + costs.case_s + costs.timing_s + gib * costs.gib_s
                + _copies(case, l2_bytes) * costs.copy_s)
    return impls * per_impl + gib * costs.truth_gib_s


def lane_model(plan: LanePlan) -> dict[str, Any]:
    """Modelled seconds per step (``steps``, in the lane's order), their ``total``, the
    ``limit`` (:data:`MODEL_LIMIT_S`) and the counts they come from."""
    costs = COSTS[plan.device]
    impls = len(plan.impls)
    steps = {
        "setup": costs.setup_s, "env": costs.env_s, "list": costs.list_s,
        "warmup": costs.warmup_s,
        "conformance": costs.run_start_s + impls * (costs.worker_s
                                                    + plan.conformance_cases * costs.case_s),
        "sweep": costs.run_start_s + sum(point_seconds(c, impls, costs, plan.l2_bytes)
                                         for c in plan.points),
        "pack": costs.pack_s,
    }
    return {"steps": {k: round(v, 1) for k, v in steps.items()},
            "total": round(sum(steps.values()), 1), "limit": MODEL_LIMIT_S[plan.device],
            "counts": {"impls": impls, "conformance_cases": plan.conformance_cases,
                       "points": len(plan.points),
                       "sweep_pairs": impls * len(plan.points),
                       "worker_starts": impls * (1 + len(plan.points)),
                       "point_gib": [round(bytes_moved(c) / GIB, 3) for c in plan.points],
                       "copies": [_copies(c, plan.l2_bytes) for c in plan.points]},
            "costs": costs.__dict__}


def points_that_fit(plan: LanePlan) -> int:
    """The most of ``plan.points`` (a prefix) whose :func:`lane_model` stays within its
    limit; 0 when not even the first fits."""
    fit = 0
    for count in range(1, len(plan.points) + 1):
        trial = LanePlan(plan.device, plan.impls, plan.conformance_cases, plan.points[:count],
                     plan.l2_bytes)
        if lane_model(trial)["total"] > MODEL_LIMIT_S[plan.device]:
            break
        fit = count
    return fit


def model_table(model: dict[str, Any]) -> str:
    """The model as printed before the lane starts: a line per step and the total."""
    counts = model["counts"]

    def many(count: int, word: str) -> str:
        return f"{count} {word}{'' if count == 1 else 's'}"

    lines = [f"gpu-lane time model: {many(counts['impls'], 'implementation')}, "
             f"{many(counts['conformance_cases'], 'conformance case')}, "
             f"{many(counts['points'], 'sweep point')} ({many(counts['sweep_pairs'], 'pair')}, "
             f"{many(counts['worker_starts'], 'worker start')})"]
    lines += [f"  {name:<12} {seconds:7.1f} s" for name, seconds in model["steps"].items()]
    lines.append(f"  {'total':<12} {model['total']:7.1f} s of {model['limit']} s")
    return "\n".join(lines)


__all__ = ["COSTS", "H200_L2_BYTES", "MODEL_LIMIT_S", "LaneCosts", "LanePlan", "lane_model", "model_table",
           "point_seconds", "points_that_fit"]
