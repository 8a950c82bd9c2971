"""Test-only adapters for the conformance search's time-filled budget: ``torch-gather``
under names the measured table (``suites/conformance/example_seconds.json``) has never seen,
declaring a narrow space (float32 decode, head_dim 64, block_size 16, no options) so that an
example costs tenths of a second even on a loaded host; once as fast as it and once held
back by a fixed sleep per call, as a fast and a slow out-of-tree kernel are."""

from __future__ import annotations

import time
from dataclasses import replace

from pagedbench.adapters.torch_sdpa import TorchGather


class UnmeasuredFast(TorchGather):
    """``torch-gather`` on a narrow space: correct, and as fast as a CPU op."""

    name = "unmeasured-fast"

    def capabilities(self, device: str):
        return replace(super().capabilities(device), dtypes=frozenset({"float32"}),
                       head_dims=frozenset({64}), block_sizes=frozenset({16}),
                       modes=frozenset({"decode"}), features=frozenset(),
                       layouts=frozenset({"contiguous"}))


class UnmeasuredSlow(UnmeasuredFast):
    """``torch-gather`` after a sleep of :data:`SLEEP_S` seconds per call."""

    name = "unmeasured-slow"
    SLEEP_S = 0.4

    def run(self, prepared):
        time.sleep(self.SLEEP_S)
        return super().run(prepared)
