"""materialize(): live tokens where the slot mapping says, NaN everywhere else, tables
scattered over the pool, deterministic by seed."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from pagedbench.harness.strategies import paged_cases
from pagedbench.reference import PagedCase, gather_kv, materialize


@given(paged_cases(max_batch=4, max_kv_len=100))
def test_materialize_poisons_every_slot_without_a_live_token(case: PagedCase) -> None:
    inputs = materialize(case)
    bs = case.block_size
    live = torch.zeros(inputs.kv_cache.shape[0] * bs, dtype=torch.bool)
    live[inputs.slot_mapping] = True
    # Recompute each token's slot from the block table alone.
    expected_slots = [
        int(inputs.block_tables[i, t // bs]) * bs + t % bs
        for i, n in enumerate(case.kv_lens) for t in range(n)
    ]
    assert inputs.slot_mapping.tolist() == expected_slots
    assert len(set(expected_slots)) == sum(case.kv_lens), "two tokens share a slot"
    per_slot = inputs.kv_cache.float().permute(0, 2, 1, 3, 4).reshape(
        -1, 2 * case.num_kv_heads * case.head_dim)  # [num_blocks * block_size, 2 * hkv * d]
    nan_rows = per_slot.isnan().all(dim=1)
    finite_rows = per_slot.isfinite().all(dim=1)
    assert bool(finite_rows[live].all()), "a live token holds NaN"
    assert bool(nan_rows[~live].all()), "a slot without a live token is not NaN"
    padding = inputs.block_tables[:, :][
        torch.arange(case.max_blocks_per_seq)[None, :] >= torch.tensor(case.blocks_per_seq)[:, None]
    ]
    assert bool((padding == inputs.padding_block).all())
    assert bool(inputs.kv_cache[inputs.padding_block].isnan().all())


@given(paged_cases(max_batch=3, max_kv_len=70))
def test_stale_tail_poison_fills_only_the_v_tails_of_last_blocks(case: PagedCase) -> None:
    strict, stale = materialize(case), materialize(case, tail_poison="stale")
    bs = case.block_size
    tail = torch.zeros(stale.kv_cache.shape[0], bs, dtype=torch.bool)  # [num_blocks, bs]
    for i, n in enumerate(case.kv_lens):
        last = int(strict.block_tables[i, (n - 1) // bs])
        tail[last, n - (n - 1) // bs * bs :] = True
    a, b = strict.kv_cache.float(), stale.kv_cache.float()  # [blocks, 2, bs, hkv, d]
    assert bool(b[:, 1][tail].isfinite().all()), "a V tail slot is not finite"
    assert bool(b[:, 0][tail].isnan().all()), "a K tail slot is not NaN"
    assert bool(a.permute(0, 2, 1, 3, 4)[tail].isnan().all())
    same = ~(tail[:, None, :, None, None] & (torch.arange(2) == 1)[None, :, None, None, None])
    same = same.expand_as(a)
    assert torch.equal(a[same].nan_to_num(7.0), b[same].nan_to_num(7.0)), (
        "stale poison changed something outside the tails")


def test_tail_poison_rejects_unknown_values() -> None:
    case = PagedCase(kv_lens=(3,), num_q_heads=1, num_kv_heads=1, head_dim=64, block_size=4)
    with pytest.raises(ValueError, match="tail_poison must be one of"):
        materialize(case, tail_poison="zero")


def test_materialize_is_deterministic_and_scattered() -> None:
    case = PagedCase(kv_lens=(40, 70, 1), num_q_heads=4, num_kv_heads=2, head_dim=64,
                     block_size=8, dtype="float32", seed=3)
    a, b = materialize(case), materialize(case)
    assert torch.equal(a.block_tables, b.block_tables)
    assert torch.equal(a.q, b.q)
    assert torch.equal(a.kv_cache.nan_to_num(7.0), b.kv_cache.nan_to_num(7.0))
    first_table = a.block_tables[0, : case.blocks_per_seq[0]].tolist()
    assert first_table != sorted(first_table), "placement is not shuffled"
    other = materialize(case.with_(seed=4))
    assert not torch.equal(a.block_tables, other.block_tables)


def test_gather_kv_returns_the_values_written_at_each_slot() -> None:
    case = PagedCase(kv_lens=(9, 3), num_q_heads=2, num_kv_heads=1, head_dim=64,
                     block_size=4, dtype="float32")
    inputs = materialize(case)
    flat = inputs.kv_cache.permute(1, 0, 2, 3, 4).reshape(2, -1, 1, 64)  # [2, slots, hkv, d]
    offset = 0
    for (k, v), n in zip(gather_kv(inputs), case.kv_lens):
        slots = inputs.slot_mapping[offset : offset + n]
        assert torch.equal(k, flat[0, slots])
        assert torch.equal(v, flat[1, slots])
        offset += n


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("kv_lens", (), "at least one"),
        ("kv_lens", (0, 3), ">= 1"),
        ("num_kv_heads", 3, "multiple"),
        ("dtype", "float8", "dtype must be one of"),
        ("q_lens", (4,), "q_lens"),
        ("block_size", 0, "block_size"),
        ("num_blocks", 1, "num_blocks"),
        ("kv_lens", (5.7,), "kv_lens must be an int"),
        ("kv_lens", "57", "list or tuple"),
        ("head_dim", True, "head_dim must be an int"),
        ("sliding_window", 2.5, "sliding_window must be an int"),
        ("sm_scale", float("nan"), "sm_scale must be None or a finite number > 0"),
        ("sm_scale", -1.0, "sm_scale"),
        ("logits_soft_cap", float("inf"), "logits_soft_cap"),
        ("seed", 2**70, "seed must be in"),
    ],
)
def test_paged_case_rejects_bad_input_naming_the_parameter(field, value, message) -> None:
    base = dict(kv_lens=(3,), num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=4)
    with pytest.raises(ValueError, match=message):
        PagedCase(**(base | {field: value}))


@given(st.integers(1, 50), st.integers(1, 8))
def test_case_roundtrips_through_dict(n, block_size) -> None:
    case = PagedCase(kv_lens=(n, n + 1), q_lens=(1, 2), num_q_heads=4, num_kv_heads=2,
                     head_dim=64, block_size=block_size, sliding_window=5, name="rt")
    assert PagedCase.from_dict(case.to_dict()) == case
    assert case.case_id == PagedCase.from_dict(case.to_dict()).case_id
