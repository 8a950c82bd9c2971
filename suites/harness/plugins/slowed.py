"""Test-only adapters that measure the regression gate (``harness/calibration/gate.py``):
``sdpa-contiguous`` unchanged under another name, and slowed by a fixed fraction.

A slowed adapter runs ``sdpa-contiguous`` and then busy-waits (a loop on
``time.perf_counter``, so the core stays as busy as under real work) for ``SLOWDOWN``
times as long as that call took: every call takes ``1 + SLOWDOWN`` times as long, noise
included. Its output is ``sdpa-contiguous``'s, so it passes.
"""

from __future__ import annotations

import time

from pagedbench.adapters.torch_sdpa import SdpaContiguous


class Rerun(SdpaContiguous):
    """``sdpa-contiguous`` itself, under its own name (an unchanged rerun in the same run)."""

    name = "sdpa-rerun"


class Slowed(SdpaContiguous):
    """``sdpa-contiguous`` followed by a busy wait of ``SLOWDOWN`` x its own duration."""

    name = "sdpa-slowed-25pct"
    SLOWDOWN = 0.25

    def run(self, prepared):
        start = time.perf_counter()
        out = super().run(prepared)
        took = time.perf_counter() - start
        until = start + (1 + self.SLOWDOWN) * took
        while time.perf_counter() < until:
            pass
        return out


class SlowedHalf(Slowed):
    """Half as slow again (1.5x): the slowdown the gate must catch with its defaults
    (``gate/test_compare_bench_defaults.py``)."""

    name = "sdpa-slowed-50pct"
    SLOWDOWN = 0.5


class SlowedThreeTimes(Slowed):
    """Three times as slow: a slowdown no noise hides (the end-to-end test's)."""

    name = "sdpa-slowed-3x"
    SLOWDOWN = 2.0
