"""The capacity simulator on tiny traces whose every step is worked out by hand here.

Each test writes out, step by step, what each request holds and what each policy
reserves; the sums below are those tables added up, never numbers read from the code.
"""

from __future__ import annotations

import pytest

from pagedbench.reference.kv_policies import CapacityError, LiveRequest, Policy, make_memory
from pagedbench.reference.simulator import _decode_step, compare_policies, simulate
from pagedbench.reference.workload import Request

# Two requests queued at step 0, max_context 32.
#   A: prompt 5, output 4 -> holds 5, 6, 7, 8, 9 tokens at steps 0..4, freed before step 5.
#   B: prompt 10, output 6 -> holds 10 .. 16 tokens at steps 0..6, freed before step 7.
# Tokens held per step: 15, 17, 19, 21, 23, 15, 16 -> 126 over 7 steps.
TWO = [Request(prompt_len=5, output_len=4), Request(prompt_len=10, output_len=6)]
TWO_TOKENS = 126
TWO_STEPS = 7


def _pct(part: float, whole: float) -> float:
    return pytest.approx(100.0 * part / whole)


@pytest.mark.parametrize(
    ("policy", "reserved", "fragmentation"),
    [
        # Max reserves 32 per request: 64 at steps 0..4, 32 at steps 5..6 -> 384.
        # Never-used slots: A 32-9=23 for 5 steps, B 32-16=16 for 7 steps -> 115+112 = 227.
        pytest.param(Policy("Max"), 384, 227, id="max"),
        # Pow2 reserves 16 for A (9 -> 16) and 16 for B: 32 x 5 + 16 x 2 = 192;
        # A's 7 spare slots for 5 steps = 35.
        pytest.param(Policy("Pow2"), 192, 35, id="pow2"),
        # Oracle reserves 9 + 16 = 25 for 5 steps, then 16 for 2 -> 157, none spare.
        pytest.param(Policy("Oracle"), 157, 0, id="oracle"),
        # Paged, 4-token blocks: A's 5..9 tokens take 2,2,2,2,3 blocks; B's 10..16 take
        # 3,3,3,4,4,4,4. Slots per step: 20,20,20,24,28,16,16 -> 144; 144-126 = 18 empty.
        pytest.param(Policy("Paged", 4), 144, 18, id="paged-bs4"),
        # One-token blocks: every allocated slot holds a token.
        pytest.param(Policy("Paged", 1), 126, 0, id="paged-bs1"),
    ],
)
def test_two_requests_waste_split(policy: Policy, reserved: int, fragmentation: int) -> None:
    result = simulate(TWO, policy, kv_budget_tokens=64, max_context=32)
    empty = reserved - TWO_TOKENS
    assert result.steps == TWO_STEPS
    assert result.utilization_pct == _pct(TWO_TOKENS, reserved)
    assert result.waste_pct == _pct(empty, reserved)
    assert result.fragmentation_pct == _pct(fragmentation, reserved)
    assert result.reservation_waste_pct == _pct(empty - fragmentation, reserved)
    assert result.mean_reserved_tokens == pytest.approx(reserved / TWO_STEPS)
    assert result.mean_stored_tokens == pytest.approx(TWO_TOKENS / TWO_STEPS)
    assert result.peak_concurrency == 2
    assert result.mean_concurrency == pytest.approx((2 * 5 + 1 * 2) / TWO_STEPS)
    assert (result.waited, result.preempted, result.recomputed_tokens) == (0, 0, 0)


def test_contiguous_reservation_waste_is_the_future_tokens() -> None:
    # Slots Max reserves for tokens still to come: A 4,3,2,1,0 and B 6,5,4,3,2,1,0 -> 31.
    result = simulate(TWO, Policy("Max"), kv_budget_tokens=64, max_context=32)
    assert result.reservation_waste_pct == _pct(31, 384)


def test_budget_of_one_max_request_serialises_max_but_not_oracle() -> None:
    # 32 slots: Max fits one 32-slot reservation, so B waits until A is freed after
    # step 4 and runs at steps 5..11: 12 steps, one running at each.
    # Oracle needs 9 + 16 = 25 <= 32: both run at once, 7 steps as above.
    # Paged bs4 has 8 blocks; the most both hold at once is 3 + 4 = 7 (step 4).
    results = compare_policies(
        TWO, [Policy("Max"), Policy("Oracle"), Policy("Paged", 4)], kv_budget_tokens=32,
        max_context=32,
    )
    by_name = {r.policy: r for r in results}
    assert by_name["Max"].steps == 12
    assert by_name["Max"].waited == 1
    assert by_name["Max"].peak_concurrency == 1
    assert by_name["Max"].mean_concurrency == pytest.approx(1.0)
    for name in ("Oracle", "Paged"):
        r = by_name[name]
        assert (r.steps, r.waited, r.peak_concurrency, r.preemptions) == (7, 0, 2, 0)
        assert r.concurrency_ratio == pytest.approx((12 / 7) / 1.0)
        assert r.throughput_ratio == pytest.approx(12 / 7)
    assert by_name["Max"].concurrency_ratio == pytest.approx(1.0)


def test_paged_preempts_newest_by_recomputation() -> None:
    # 3 blocks of 4 tokens, max_context 16. A: prompt 4, output 4. B: prompt 4, output 8.
    # s0: A 4 (1 block), B 4 (1 block).
    # s1: A -> 5 takes the last block; B -> 5 finds none: B, the newest, preempts itself
    #     (4 tokens to recompute) and goes back to the front of the queue; no admission
    #     in a step that preempted.
    # s2: A 6; B readmitted with 4 tokens (1 block).
    # s3: A 7; B -> 5 finds no block: preempted again (4 more tokens to recompute).
    # s4: A 8, then A is done; B readmitted with 4 tokens (the 3rd block).
    # s5..s12: B 5..12 alone; done after s12 -> 13 steps.
    # Running per step: 2,1,2,1,2 then 1 x 8 -> 16.
    # Slots per step: 8,8,12,8,12, 8,8,8,8, 12,12,12,12 -> 128.
    # Tokens per step: 8,5,10,7,12, 5,6,7,8, 9,10,11,12 -> 110.
    trace = [Request(prompt_len=4, output_len=4), Request(prompt_len=4, output_len=8)]
    result = simulate(trace, Policy("Paged", 4), kv_budget_tokens=12, max_context=16)
    assert result.steps == 13
    assert (result.preempted, result.preemptions, result.recomputed_tokens) == (1, 2, 8)
    assert result.waited == 0
    assert result.peak_concurrency == 2
    assert result.mean_concurrency == pytest.approx(16 / 13)
    assert result.waste_pct == _pct(128 - 110, 128)
    assert result.fragmentation_pct == _pct(128 - 110, 128)
    assert result.reservation_waste_pct == 0


def test_fork_shares_the_prompt_and_copies_on_write() -> None:
    # One request, prompt 5, output 2, n = 2 samples, 4-token blocks, ample memory.
    # Paged+share: s0 the prompt takes [4][1] and the fork shares both: 8 slots, 5 tokens.
    #   s1 sample 0 writes into the shared partial block -> copied (1 CoW copy) then
    #   written: [4][2]; sample 1 now owns the old block alone and writes in place: [4][2].
    #   3 blocks: 12 slots, 4+2+2 = 8 tokens. s2: 12 slots, 4+3+3 = 10 tokens.
    #   Sums: 32 slots, 23 tokens.
    # Paged (no sharing): two copies of 5,6,7 tokens in 2 blocks each: 48 slots, 36 tokens.
    trace = [Request(prompt_len=5, output_len=2, n=2)]
    shared = simulate(trace, Policy("Paged+share", 4), kv_budget_tokens=64, max_context=8)
    alone = simulate(trace, Policy("Paged", 4), kv_budget_tokens=64, max_context=8)
    assert shared.cow_copies == 1
    assert shared.mean_reserved_tokens == pytest.approx(32 / 3)
    assert shared.mean_stored_tokens == pytest.approx(23 / 3)
    assert shared.fragmentation_pct == _pct(32 - 23, 32)
    assert alone.cow_copies == 0
    assert alone.mean_reserved_tokens == pytest.approx(48 / 3)
    assert alone.mean_stored_tokens == pytest.approx(36 / 3)


def test_prefix_sharing_reuses_full_prefix_blocks() -> None:
    # Two requests with the same 8-token prefix, prompts of 10 tokens, output 1, blocks
    # of 4. Paged+share: A takes 3 blocks (4, 4, 2 tokens); B hits A's 2 full prefix blocks
    # and takes 1 block for its own 2 tokens. s0: 4 blocks = 16 slots, 12 tokens; s1: each
    # adds a token to its last block: 16 slots, 14 tokens. Sums: 32 slots, 26 tokens.
    # Paged: 3 blocks each, 2 x (10, 11) tokens: 48 slots, 42 tokens.
    trace = [
        Request(prompt_len=10, output_len=1, prefix_id="sys", prefix_len=8),
        Request(prompt_len=10, output_len=1, prefix_id="sys", prefix_len=8),
    ]
    shared = simulate(trace, Policy("Paged+share", 4), kv_budget_tokens=64, max_context=16)
    alone = simulate(trace, Policy("Paged", 4), kv_budget_tokens=64, max_context=16)
    assert shared.mean_reserved_tokens == pytest.approx(32 / 2)
    assert shared.mean_stored_tokens == pytest.approx(26 / 2)
    assert alone.mean_reserved_tokens == pytest.approx(48 / 2)
    assert alone.mean_stored_tokens == pytest.approx(42 / 2)


def test_late_arrival_counts_idle_steps_and_waiting() -> None:
    # A (prompt 2, output 1) arrives at step 0 and runs steps 0..1; steps 2..4 are idle.
    # B and C (the same, arrival 5): a 4-slot budget with max_context 4 fits one Max
    # reservation, so B runs 5..6 and C waits, then runs 7..8. 9 steps, 6 running
    # request-steps.
    trace = [
        Request(prompt_len=2, output_len=1),
        Request(prompt_len=2, output_len=1, arrival=5),
        Request(prompt_len=2, output_len=1, arrival=5),
    ]
    result = simulate(trace, Policy("Max"), kv_budget_tokens=4, max_context=4)
    assert result.steps == 9
    assert result.waited == 1
    assert result.mean_concurrency == pytest.approx(6 / 9)


def test_budget_too_small_for_one_request_is_a_capacity_error() -> None:
    with pytest.raises(CapacityError, match=r"request 1 .*policy Max"):
        simulate(
            [Request(prompt_len=2, output_len=2, n=1), Request(prompt_len=2, output_len=2, n=3)],
            Policy("Max"), kv_budget_tokens=10, max_context=4,
        )
    # Paged: the request fits at admission (1 block) but needs 3 blocks of 2 alone.
    with pytest.raises(CapacityError, match=r"request 0 .*Paged bs2"):
        simulate([Request(prompt_len=1, output_len=5)], Policy("Paged", 2),
                 kv_budget_tokens=4, max_context=6)
    with pytest.raises(CapacityError, match="block_size=8"):
        simulate([Request(prompt_len=1, output_len=1)], Policy("Paged", 8),
                 kv_budget_tokens=4, max_context=6)


def test_decode_step_preempts_newest_first_and_returns_the_preemptions() -> None:
    # 3 blocks of 4 tokens; A, B, C each hold a 4-token prompt in one block, all blocks used.
    # A's 5th token needs a block: C (newest) is preempted, its block goes to A. B's 5th
    # token needs a block: B is now the newest and preempts itself. A alone grew.
    trace = [Request(prompt_len=4, output_len=4)] * 3
    memory = make_memory(Policy("Paged", 4), 12, trace, max_context=16, seed=0)
    running = [LiveRequest(i, request) for i, request in enumerate(trace)]
    assert all(memory.admit(live) for live in running)
    a, b, c = running
    assert _decode_step(running, memory) == [(c, 4), (b, 4)]
    assert running == [a]
    assert (a.generated, b.generated, c.generated) == (1, 0, 0)
    assert memory.sample() == (8, 5, 3)  # A's two blocks: 8 slots, 5 tokens
