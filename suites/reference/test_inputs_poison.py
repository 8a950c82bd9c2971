"""materialize(): live tokens where the slot mapping says, NaN everywhere else, tables
scattered over the pool, deterministic by seed."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from pagedbench.harness.cases.strategies import paged_cases
from pagedbench.reference import PagedCase, gather_kv, materialize, new_output
from pagedbench.reference.axes import LAYOUTS, POISONS
from pagedbench.reference.inputs import _move, poison_value


def _is_poison(x: torch.Tensor, poison: str, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Elementwise: ``x`` holds the value ``poison`` stands for in ``dtype`` (``x``'s own
    unless given)."""
    value = poison_value(poison, x.dtype if dtype is None else dtype)
    x = x.float()
    return x.isnan() if poison == "nan" else x == value


@given(paged_cases(max_batch=4, max_kv_len=100, edges=True, logit_range=True))
def test_materialize_poisons_every_slot_without_a_live_token(case: PagedCase) -> None:
    poison = case.poison
    inputs = materialize(case)
    bs, d, dv = case.block_size, case.head_dim, case.v_head_dim
    assert inputs.block_tables.shape == (case.batch_size, case.max_blocks_per_seq)
    live = torch.zeros(inputs.kv_cache.shape[0] * bs, dtype=torch.bool)
    live[inputs.slot_mapping] = True
    # Recompute each token's slot from the block table alone.
    expected_slots = [
        int(inputs.block_tables[i, t // bs]) * bs + t % bs
        for i, n in enumerate(case.kv_lens) for t in range(n)
    ]
    assert inputs.slot_mapping.tolist() == expected_slots
    shared_slots = case.num_shared_blocks * bs  # a shared block's slots, once per sharer
    assert len(set(expected_slots)) == sum(case.kv_lens) - shared_slots, "two tokens share a slot"
    assert min(expected_slots + [case.min_block_id * bs]) >= case.min_block_id * bs
    # [num_blocks * block_size, hkv, cache_head_dim] for K and V
    k = inputs.kv_cache[:, 0].reshape(-1, case.num_kv_heads, case.cache_head_dim)
    v = inputs.kv_cache[:, 1].reshape(-1, case.num_kv_heads, case.cache_head_dim)
    assert bool(k[live][..., :d].float().isfinite().all()), "a live K holds a non-finite value"
    assert bool(v[live][..., :dv].float().isfinite().all()), "a live V holds a non-finite value"
    assert bool(_is_poison(k[~live], poison).all()), "a K slot without a live token"
    assert bool(_is_poison(v[~live], poison).all()), "a V slot without a live token"
    assert bool(_is_poison(k[live][..., d:], poison).all()), "K channels past head_dim"
    assert bool(_is_poison(v[live][..., dv:], poison).all()), "V channels past head_dim_v"
    padding = inputs.block_tables[
        torch.arange(case.max_blocks_per_seq)[None, :] >= torch.tensor(case.blocks_per_seq)[:, None]
    ]
    assert bool((padding == inputs.padding_block).all())
    assert inputs.padding_block >= case.min_block_id
    assert bool(_is_poison(inputs.kv_cache[inputs.padding_block], poison).all())
    assert bool(inputs.q.float().isfinite().all())


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("poison", POISONS)
def test_layouts_hold_the_same_values_in_poisoned_larger_allocations(layout, poison) -> None:
    """Every layout stores the values of the contiguous one (same draws, same tables);
    what it allocates around them (other layers, interleaved blocks, K/V columns of the
    QKV projection, the output's other half) holds the poison, and q, the cache and the
    output are views of the shapes, strides and offsets the layout names."""
    case = PagedCase(kv_lens=(9, 0, 21), q_lens=(3, 0, 2), num_q_heads=6, num_kv_heads=2,
                     head_dim=8, block_size=4, dtype="float16", seed=2, layout=layout,
                     poison=poison)
    plain = materialize(case.with_(layout="contiguous"))
    inputs = materialize(case)
    assert torch.equal(inputs.q, plain.q)
    assert torch.equal(inputs.block_tables, plain.block_tables)
    same = (inputs.kv_cache.float() == plain.kv_cache.float()) | (
        inputs.kv_cache.float().isnan() & plain.kv_cache.float().isnan())
    assert bool(same.all())
    views = {"fused_qkv": inputs.q, "strided_out": new_output(inputs)}
    views.update(dict.fromkeys(("layer_pool", "every_other_block", "layer_in_block"),
                               inputs.kv_cache))
    if layout == "contiguous":
        assert inputs.q.is_contiguous() and inputs.kv_cache.is_contiguous()
        assert new_output(inputs).is_contiguous()
        return
    view = views[layout]
    base = view._base
    assert base is not None and base.numel() > view.numel()
    outside = torch.ones(base.numel(), dtype=torch.bool)
    index = torch.arange(base.numel()).as_strided(view.shape, view.stride(),
                                                  view.storage_offset())
    outside[index.flatten()] = False
    if layout == "strided_out":
        assert bool(base.flatten()[outside].isnan().all())
        assert view.stride() == (2 * 6 * 8, 2 * 8, 1) and view.storage_offset() == 8
    else:
        assert bool(_is_poison(base.flatten()[outside], poison).all())
    if layout == "layer_in_block":  # [nb, 2, layers, hkv, bs, d], HND inside the block
        assert view.stride()[2:] == (8, 4 * 8, 1)
    if layout == "every_other_block":
        assert view.stride()[0] == 2 * plain.kv_cache.stride()[0]


def test_fp8_e4m3_poison_is_its_largest_magnitude_for_infinities() -> None:
    """E4M3 "fn" has no infinity: +-Inf poison stores +-448 there, NaN stays NaN."""
    case = PagedCase(kv_lens=(3,), num_q_heads=1, num_kv_heads=1, head_dim=16, block_size=4,
                     kv_cache_dtype="fp8_e4m3")
    for poison, expected in (("inf", 448.0), ("-inf", -448.0), ("huge", 448.0)):
        tail = materialize(case.with_(poison=poison)).kv_cache[:, :, 3].float()  # slot 3 unused
        assert bool((tail[materialize(case).block_tables[0, 0]] == expected).all()), poison


def test_inputs_keep_their_layout_when_moved() -> None:
    """``PagedInputs.to`` keeps a strided view strided (``Tensor.to`` alone compacts a
    view that is not dense); moving to the same device returns the same tensors."""
    case = PagedCase(kv_lens=(5, 12), num_q_heads=4, num_kv_heads=2, head_dim=8,
                     block_size=4, layout="every_other_block")
    inputs = materialize(case)
    moved = inputs.to("cpu")
    assert moved.kv_cache.stride() == inputs.kv_cache.stride()
    copied = _move(inputs.kv_cache, "meta")
    assert copied.stride() == inputs.kv_cache.stride()
    assert copied.storage_offset() == inputs.kv_cache.storage_offset()


@given(paged_cases(max_batch=3, max_kv_len=70, edges=True, logit_range=True))
def test_stale_tail_poison_fills_only_the_v_tails_of_last_blocks(case: PagedCase) -> None:
    strict, stale = materialize(case), materialize(case, tail_poison="stale")
    bs = case.block_size
    tail = torch.zeros(stale.kv_cache.shape[0], bs, dtype=torch.bool)  # [num_blocks, bs]
    for i, n in enumerate(case.kv_lens):
        if n == 0:  # no block, so no tail
            continue
        last = int(strict.block_tables[i, (n - 1) // bs])
        tail[last, n - (n - 1) // bs * bs :] = True
    a, b = strict.kv_cache.float(), stale.kv_cache.float()  # [blocks, 2, bs, hkv, d]
    assert bool(b[:, 1][tail][..., : case.v_head_dim].isfinite().all()), "a V tail is not finite"
    kv_dtype = case.kv_torch_dtype
    assert bool(_is_poison(b[:, 0][tail], case.poison, kv_dtype).all()), "a K tail slot"
    assert bool(_is_poison(a.permute(0, 2, 1, 3, 4)[tail], case.poison, kv_dtype).all())
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
        ("kv_lens", (-1, 3), ">= 0"),
        ("q_lens", (-1,), "q_lens"),
        ("head_dim_v", 0, "head_dim_v"),
        ("min_block_id", -3, "min_block_id"),
        ("num_blocks", 40, "above min_block_id 100"),
        ("qk_magnitude", 0.0, "qk_magnitude"),
        ("v_magnitude", float("inf"), "v_magnitude"),
        ("logit_offset", 2e5, "logit_offset"),
        ("logit_offset", "1", "logit_offset must be a finite float"),
        ("layout", "hnd", "layout must be one of"),
        ("poison", "zero", "poison must be one of"),
        ("num_kv_heads", 3, "multiple"),
        ("dtype", "float8", "dtype must be one of"),
        ("q_lens", (1, 2), "q_lens has 2 entries"),
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
        ("shared_blocks", (1,), "shared_blocks\\[0\\] must be 0"),
        ("shared_blocks", (0, 0), "shared_blocks has 2 entries"),
        ("shared_blocks", 2, "shared_blocks must be a list or tuple"),
    ],
)
def test_paged_case_rejects_bad_input_naming_the_parameter(field, value, message) -> None:
    base = dict(kv_lens=(3,), num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=4)
    if field == "num_blocks" and value == 40:
        base["min_block_id"] = 100
    with pytest.raises(ValueError, match=message):
        PagedCase(**(base | {field: value}))


@given(st.integers(1, 50), st.integers(1, 8))
def test_case_roundtrips_through_dict(n, block_size) -> None:
    case = PagedCase(kv_lens=(n, n + 1), q_lens=(1, 2), num_q_heads=4, num_kv_heads=2,
                     head_dim=64, block_size=block_size, sliding_window=5, name="rt")
    assert PagedCase.from_dict(case.to_dict()) == case
    assert case.case_id == PagedCase.from_dict(case.to_dict()).case_id
