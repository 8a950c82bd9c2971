"""Every available implementation agrees with float64 dense attention on every case it
claims to support (harness/verdict/tolerance.py's policy), with NaN-poisoned unused slots and
shuffled block tables. Run one implementation: ``pytest suites/conformance --impl NAME``;
a failure ends with the ``pagedbench replay`` command of its case (harness/run/replay.py).

The search fills the profile's seconds on each implementation (``suites/budget.py``):
runs of hypothesis sized by the speed measured on the implementation itself.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from hypothesis import assume, note

from pagedbench.harness.run import replay
from pagedbench.harness.run.config import RunConfig
from pagedbench.harness.run.jobs import timer_for
from pagedbench.harness.verdict.conformance import check, inputs_for, nan_tail_output_finite
from pagedbench.harness.verdict.status import Status

from pagedbench.suites import peer_findings

from .cases import case_strategy, pinned_case
from .conftest import DEVICE


def test_paged_matches_dense(adapter, impl, search_budget, pytestconfig) -> None:
    strategy = case_strategy(adapter)

    def search(data) -> None:
        case = data.draw(strategy)
        reasons = adapter.why_unsupported(case, DEVICE)
        note(f"case {case.case_id}: {case.to_dict()}; unsupported: {reasons}")
        assume(not reasons)
        search_budget.counted()
        peer_findings.check_conformance(adapter, case, DEVICE, impl, "search",
                                        pytestconfig.rootpath)

    search_budget.run(search)


@pytest.mark.parametrize("num_q_heads, num_kv_heads", [(4, 4), (4, 1), (8, 2)],
                         ids=["mha", "mqa", "gqa4"])
def test_boundary_lengths(adapter, impl, num_q_heads, num_kv_heads, pytestconfig) -> None:
    """Pinned: one batch holding kv_len 1, block_size - 1, block_size, block_size + 1 and
    2 * block_size + 3, at the smallest block size and head dim the implementation takes."""
    case = pinned_case(
        adapter, lambda bs: tuple(sorted({1, max(1, bs - 1), bs, bs + 1, 2 * bs + 3})),
        num_q_heads, num_kv_heads, "boundary")
    peer_findings.check_conformance(adapter, case, DEVICE, impl, "boundary-lengths",
                                    pytestconfig.rootpath)


def test_block_placement_does_not_change_output(adapter, impl) -> None:
    """Metamorphic (xformers' block-swap test): the same logical K/V scattered over
    different physical blocks gives the same output, bit for bit."""
    case = pinned_case(adapter, lambda bs: (3 * bs + 5, bs + 1), 4, 2, "placement")
    a = inputs_for(adapter, case, DEVICE)
    moved = _permute_blocks(a)
    assert not torch.equal(a.block_tables, moved.block_tables)
    out_a = adapter.run(adapter.prepare(a))
    out_b = adapter.run(adapter.prepare(moved))
    assert torch.equal(out_a, out_b), (
        f"{adapter.name}: output depends on physical block placement "
        f"(max diff {(out_a.double() - out_b.double()).abs().max():.3g}); "
        f"{replay.hint(case, impl)}"
    )


def _permute_blocks(inputs):
    """The same inputs with the physical blocks reversed and the tables patched."""
    num_blocks = inputs.kv_cache.shape[0]
    new_of_old = torch.arange(num_blocks - 1, -1, -1, device=inputs.kv_cache.device)
    kv_cache = torch.empty_like(inputs.kv_cache)
    kv_cache[new_of_old] = inputs.kv_cache  # block b moves to num_blocks - 1 - b
    block_tables = new_of_old[inputs.block_tables.long()].to(torch.int32)
    slot = inputs.slot_mapping
    bs = inputs.case.block_size
    slot_mapping = new_of_old[slot // bs] * bs + slot % bs
    return replace(inputs, kv_cache=kv_cache, block_tables=block_tables,
                   slot_mapping=slot_mapping,
                   padding_block=int(new_of_old[inputs.padding_block]))


def test_nan_safe_tail_declaration_is_true(adapter, impl) -> None:
    """With NaN in the unused slots of partly filled last blocks, an adapter declaring
    ``nan_safe_tail=True`` stays finite (and correct: see the tests above), and one
    declaring False does produce non-finite output; when a library fixes that, this test
    fails so the declaration (and the † in the leaderboard) can go."""
    caps = adapter.capabilities(DEVICE)
    case = pinned_case(adapter, lambda bs: (bs + 1, 2 * bs - 1), 4, 2, "nan-tail")
    finite = nan_tail_output_finite(adapter, case, DEVICE)
    assert finite is caps.nan_safe_tail, (
        f"{adapter.name} declares nan_safe_tail={caps.nan_safe_tail} but its output with "
        f"NaN in the last blocks' tails is "
        f"{ {True: 'finite', False: 'not finite', None: 'an exception'}[finite] }; "
        f"{replay.hint(case, impl)}"
    )


#: A short timing (the CPU timer's blocks of calls, as ``pagedbench run`` takes them),
#: with the torch threads the implementation was prepared under (a worker sets its
#: threads before ``prepare``; a kernel compiled for a thread count refuses another).
TIMED = RunConfig(timing=True, warmup=1, repetitions=4, time_budget_s=0.02,
                  time_limit_s=2.0, threads=1)


def test_timed_calls_are_the_judged_calls(adapter, impl) -> None:
    """Timed as ``pagedbench run`` times it, with new Q written into the same buffers
    before every call (and new K/V of a cache read in place before calls it cannot
    predict), and the outputs of a uniform sample of the calls judged: an output kept per
    input object or while sampled inputs are unchanged, computed in ``prepare``, left to
    a thread or to a tensor subclass fails step ``timing``, and so does a timing that used
    more cores than its threads."""
    case = pinned_case(adapter, lambda bs: (bs + 3, 2 * bs + 1), 4, 2, "timed")
    config = replace(TIMED, device=DEVICE, threads=torch.get_num_threads())
    verdict = check(adapter, case, DEVICE, samples=config.repetitions,
                    timer=timer_for(config, adapter.is_interpreted(DEVICE)),
                    threads=config.threads)
    assert verdict.status is Status.PASS and verdict.timing is not None, (
        f"{adapter.name}: {verdict.status} in {verdict.step}: {verdict.reason}; "
        f"{replay.hint(case, impl, timed=True)}")

