"""``make gpu-compile-check``: what it compiles (every Triton implementation of the GPU lane
on a miniature of every sweep point and on the conformance cases) and the H200 it stands
in for while recording launches. The check itself (minutes of compiling) is CI's own
step (``.ci/run``), not a test."""

from __future__ import annotations

import pytest
import torch

from pagedbench.harness.lane import compile_check, sweep
from pagedbench.harness.lane.warmup import miniature


def test_the_check_covers_every_point_of_the_lane() -> None:
    cases = compile_check.lane_cases()
    expected = [miniature(c).case_id for c in sweep.CUDA_SELECTION.sweep.cases()] + [
        c.case_id for c in sweep.CUDA_SELECTION.conformance_cases()]
    assert [c.case_id for c in cases] == list(dict.fromkeys(expected))
    assert set(compile_check.LANE_TRITON_IMPLS) == {
        n for n in sweep.CUDA_IMPLS if n not in ("sdpa-contiguous", "torch-gather", "flex-paged",
                                                 "flashinfer-nhd", "flashinfer-hnd")}


def test_recording_stands_in_for_an_h200_and_puts_everything_back() -> None:
    pytest.importorskip("triton")
    from triton.runtime.driver import driver
    from triton.runtime.jit import JITFunction

    before = (JITFunction.run, torch.cuda.get_device_capability,
              torch.cuda.get_device_properties, torch.cuda.current_device, driver._active)
    with compile_check.recording() as launches:
        target = driver.active.get_current_target()
        assert (target.backend, target.arch) == ("cuda", 90)
        assert torch.cuda.get_device_capability() == (9, 0)
        assert torch.cuda.get_device_properties(0).multi_processor_count == 132
        JITFunction.run(object(), 1, 2, grid=(1,), warmup=False, BLOCK=16)
        assert launches[0][1:] == ((1, 2), {"BLOCK": 16})
    assert (JITFunction.run, torch.cuda.get_device_capability,
            torch.cuda.get_device_properties, torch.cuda.current_device, driver._active) == before
