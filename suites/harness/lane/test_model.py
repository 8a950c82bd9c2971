"""The GPU lane's time model: the H200 plan fits 540 s, a plan over it is refused, the
sums are the costs times the counts, and fewer implementations fit more points."""

from __future__ import annotations

import math

import pytest

from pagedbench.harness.lane import model, steps, sweep
from pagedbench.harness.lane.model import (COSTS, H200_L2_BYTES, LanePlan, lane_model,
                                           model_table, points_that_fit)
from pagedbench.harness.measure.timing import point_plan
from pagedbench.harness.measure.roofline import bytes_moved


def h200(selection: sweep.Selection):
    return steps.fit_points(selection, "cuda", steps.lane_impls(selection), H200_L2_BYTES)


def test_the_h200_plan_fits_nine_minutes_and_leads_with_whole_points() -> None:
    """Every implementation the carry brings, the baseline first: as many points as fit,
    at most 540 s modelled, the lane's first workload among them."""
    selection, found = h200(sweep.CUDA_SELECTION)
    assert steps.lane_impls(selection)[0] == "sdpa-contiguous"
    assert len(steps.lane_impls(selection)) == len(sweep.CUDA_IMPLS) == 16
    assert selection.points >= 2
    assert found["total"] <= found["limit"] == 540
    assert found["counts"]["worker_starts"] == 16 * (1 + selection.points)
    assert "-32q1s4k-" in selection.sweep_cases()[0].case_id
    one_more = lane_model(steps.plan_of(selection.with_(points=selection.points + 1), "cuda",
                                        steps.lane_impls(selection), H200_L2_BYTES))
    assert one_more["total"] > 540
    table = model_table(found)
    assert table.splitlines()[0].startswith("gpu-lane time model: 16 implementations, 4 "
                                            "conformance cases, ")
    assert table.splitlines()[-1].split()[-2:] == ["540", "s"]


def test_a_plan_over_the_limit_is_refused_naming_its_model() -> None:
    with pytest.raises(ValueError, match=r"time model is \d+ s, over the lane's 540 s"):
        h200(sweep.CUDA_SELECTION.with_(points=60))
    # Fewer implementations (a FlashInfer lane) fit more points.
    flashinfer = sweep.CUDA_SELECTION.with_(impls=("flashinfer-nhd", "flashinfer-hnd"))
    assert h200(flashinfer)[0].points > h200(sweep.CUDA_SELECTION)[0].points


def test_the_model_is_the_costs_times_the_counts() -> None:
    """Computed here from the costs: two implementations, four conformance cases, two
    points (one graph-replayed over its copies, one cold)."""
    costs = COSTS["cuda"]
    small, large = sweep.CUDA_SELECTION.sweep.cases()[3], sweep.CUDA_SELECTION.sweep.cases()[0]
    plan = LanePlan("cuda", ("a", "b"), 4, (small, large), H200_L2_BYTES)
    found = lane_model(plan)
    copies = point_plan(small, H200_L2_BYTES).copies
    assert copies > 1 and point_plan(large, H200_L2_BYTES).copies == 1

    def point(case, copies: int) -> float:
        gib = bytes_moved(case) / 2**30
        return (2 * (costs.worker_s + costs.case_s + costs.timing_s + gib * costs.gib_s
                     + copies * costs.copy_s) + gib * costs.truth_gib_s)

    sweep_s = costs.run_start_s + point(small, copies) + point(large, 1)
    conformance_s = costs.run_start_s + 2 * (costs.worker_s + 4 * costs.case_s)
    assert found["steps"]["sweep"] == pytest.approx(sweep_s, abs=0.06)
    assert found["steps"]["conformance"] == pytest.approx(conformance_s, abs=0.06)
    fixed = costs.setup_s + costs.env_s + costs.list_s + costs.warmup_s + costs.pack_s
    assert found["total"] == pytest.approx(fixed + sweep_s + conformance_s, abs=0.2)
    assert found["counts"]["copies"] == [copies, 1]
    assert found["counts"]["sweep_pairs"] == 4 and found["counts"]["worker_starts"] == 6


def test_points_that_fit_is_the_longest_prefix_within_the_limit() -> None:
    cases = tuple(sweep.CUDA_SELECTION.sweep.cases())
    impls = steps.lane_impls(sweep.CUDA_SELECTION)
    fit = points_that_fit(LanePlan("cuda", impls, 4, cases, H200_L2_BYTES))
    limit = model.MODEL_LIMIT_S["cuda"]
    assert lane_model(LanePlan("cuda", impls, 4, cases[:fit], H200_L2_BYTES))["total"] <= limit
    assert lane_model(LanePlan("cuda", impls, 4, cases[:fit + 1], H200_L2_BYTES))["total"] > limit
    many = tuple(f"impl{i}" for i in range(200))
    assert points_that_fit(LanePlan("cuda", many, 4, cases, H200_L2_BYTES)) == 0
    assert math.isfinite(lane_model(LanePlan("cpu", ("a",), 2, cases[:1]))["total"])
