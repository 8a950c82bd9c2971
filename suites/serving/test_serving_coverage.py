"""What ``make test``'s serving loops exercise, stated and checked: on the fault
catalogue's correct kernel (it declares every event: prefill, several tokens per decode
row, empty rows, shared blocks, fp8, plan reuse, its LSE), the state machine's loops in
the ``ci`` budget reach every event kind and every transition the loop counts
(``harness/verdict/serving.py``'s ``TRANSITIONS``) at least the stated number of times,
as the allocator's state machine states its paths (suites/allocator)."""

from __future__ import annotations

from collections import Counter

from pagedbench.harness.verdict.serving import TRANSITIONS
from pagedbench.suites.faults.kernel import PagedKernel

from .conftest import EXAMPLES, STEPS
from .test_serving_loop import loop_specs, run_loops

#: Least times each event and transition is reached over the control's loops (its
#: float16 loop and its fp8 loop, ``ci`` budget). Measured counts are 2-10 times these.
MINIMA = {"admit": 10, "step": 20, "fork": 2, "finish": 2, "preempt": 2, "readmit": 1,
          "swap-out": 2, "swap-in": 1, "prefix-hit-decode": 2, "copy-on-write": 1,
          "freed-block-reused": 3, "plan-replayed": 5, "mixed-batch": 1, "padded-batch": 2,
          "multi-token-decode": 2, "prefix-evicted": 2}


def test_every_transition_is_reached_in_the_ci_budget(tmp_path) -> None:
    assert set(TRANSITIONS) <= set(MINIMA)
    adapter = PagedKernel()
    reached: Counter = Counter()
    for spec in loop_specs(adapter):
        reached += run_loops(adapter, spec, adapter.name, tmp_path, EXAMPLES["ci"][1],
                             STEPS["ci"][1])
    short = {event: reached[event] for event, least in MINIMA.items() if reached[event] < least}
    assert not short, f"reached fewer times than stated: {short} (all: {dict(reached)})"
