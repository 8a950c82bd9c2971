"""A cheat the timings no longer reward: a kernel whose every output is right when it is
read and that skips the work of a call whose inputs look unchanged. New Q is written
before every timed call (``harness/verdict/conformance.py``'s ``timed``), so it does the
work of every call and its time is its work's; ``test_timing_faults.py`` asserts that it
never returned a kept output in a timed run (:meth:`~.kernel.PagedKernel.fired` logs the
first time it does). It is not in the catalogue (``site/``): the
catalogue and ``pagedbench selftest`` count faults that the suites catch.
"""

from __future__ import annotations

import torch

from pagedbench.adapters.base import Prepared
from pagedbench.reference import PagedInputs

from .kernel import PagedKernel

#: Elements of Q, and live K/V slots, that :class:`SentinelMemo` compares between calls.
SENTINEL_Q, SENTINEL_SLOTS = 8, 64


class SentinelMemo(PagedKernel):
    """Keeps the output of its last real call with a copy of a few input values (8 of Q,
    the K/V of 64 live slots through ``slot_mapping``), and returns that output while
    they are unchanged: fast and right wherever new inputs come before a few timed calls
    only."""

    name = "defeated-sentinel-memo"

    def prepare(self, inputs: PagedInputs) -> Prepared:
        inner = super().prepare(inputs)
        q = inputs.q.reshape(-1)
        q_at = torch.linspace(0, q.numel() - 1, SENTINEL_Q).long()
        slots = inputs.slot_mapping[torch.linspace(
            0, inputs.slot_mapping.numel() - 1, SENTINEL_SLOTS).long()]
        block_size = inputs.case.block_size
        kept: list[torch.Tensor] = []

        def sentinels() -> torch.Tensor:
            kv = inputs.kv_cache[slots // block_size, :, slots % block_size]
            return torch.cat([q[q_at].float(), kv.float().reshape(-1)])

        def call() -> torch.Tensor:
            now = sentinels()
            if kept and torch.equal(now, kept[0]):
                self.fired()
                return kept[1]
            kept[:] = [now, inner.call()]
            return kept[1]
        return Prepared(call, lse=inner.lse)
