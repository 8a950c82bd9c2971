"""The split-decode launcher: the split count, the merge of given partials (empty splits
included), the interpreter step count, input validation and the output buffer."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from pagedbench.reference import PagedCase, materialize

pytest.importorskip("triton")
from pagedbench.kernels import paged_split_decode as sd  # noqa: E402
from pagedbench.kernels import paged_split_plan as sp  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


# The split count -------------------------------------------------------------------
def test_split_count_follows_flash_attentions_example():
    """hopper/heuristics.h's own example: batch x heads 48 on 108 SMs takes 2 splits
    (efficiency 0.89) rather than 3 (0.67)."""
    assert sp.split_count_heuristic(48, num_tiles=100, slots=108) == 2


@pytest.mark.parametrize(("programs", "tiles", "slots", "expected"), [
    (8, 64, 264, 29),    # llama3-8b batch 1 at 4k keys on an H200 (2 per SM): 232 of 264
    (256, 64, 264, 1),   # batch 32: 256 programs already fill 80% of the slots
    (8, 3, 264, 3),      # never more splits than tiles
    (8, 1, 264, 1),
    (211, 500, 264, 5),  # 0.8 x 264 = 211.2: one program short of it, 5 splits fill 4 waves
])
def test_split_count_pinned_values(programs, tiles, slots, expected):
    assert sp.split_count_heuristic(programs, tiles, slots) == expected


@given(programs=st.integers(1, 600), tiles=st.integers(1, 600), slots=st.integers(1, 600))
def test_split_count_is_the_smallest_within_85_percent_of_the_best(programs, tiles, slots):
    n = sp.split_count_heuristic(programs, tiles, slots)
    assert 1 <= n <= max(1, min(sp.MAX_SPLITS, tiles, slots))
    if programs >= 0.8 * slots or tiles <= 1:
        assert n == 1
        return
    eff = {k: programs * k / slots / math.ceil(programs * k / slots)
           for k in range(1, min(sp.MAX_SPLITS, tiles, slots) + 1)}
    assert eff[n] >= 0.85 * max(eff.values())
    assert all(eff[k] < 0.85 * max(eff.values()) for k in range(1, n))


def test_plan_uses_the_device_sm_count_and_the_cpu_stand_in():
    lens = [4096]
    assert sp.device_sm_count(torch.device("cpu")) == 132  # an H100 SXM's or H200's SMs
    wide = sp.plan_splits(lens, 8, 128, 2, num_sms=132)
    narrow = sp.plan_splits(lens, 8, 128, 2, num_sms=16)
    assert wide.num_splits == 29 and narrow.num_splits == 4


def test_batch_invariant_plan_counts_splits_of_fixed_size():
    plan = sp.plan_splits([1, 129, 700], 2, 64, 2, batch_invariant=True, split_size=128)
    assert (plan.tiles_per_split, plan.num_splits) == (2, 6)  # 700 keys: 11 tiles
    with pytest.raises(ValueError, match="split_size must be a positive multiple"):
        sp.plan_splits([10], 1, 64, 2, batch_invariant=True, split_size=100)
    with pytest.raises(ValueError, match="num_splits cannot be forced"):
        sp.plan_splits([10], 1, 64, 2, batch_invariant=True, num_splits=2)


# The interpreter step count ----------------------------------------------------------
@given(kv_lens=st.lists(st.integers(0, 400), min_size=1, max_size=4),
       num_kv_heads=st.integers(1, 4), window=st.one_of(st.none(), st.integers(1, 300)),
       invariant=st.booleans(), num_splits=st.one_of(st.none(), st.integers(1, 6)))
def test_steps_count_what_the_kernels_iterate(kv_lens, num_kv_heads, window, invariant,
                                              num_splits):
    """Enumerated here program by program, split by split, from the kernel's rules."""
    if invariant:
        num_splits = None
    plan = sp.plan_splits(kv_lens, num_kv_heads, 64, 2, window, batch_invariant=invariant,
                          split_size=128, num_splits=num_splits)
    tile = plan.config.kv_tile
    expected = 0
    for kv_len in kv_lens:
        first = 0 if window is None else max(0, kv_len - window)
        tiles = len({p // tile for p in range(first, kv_len)})
        reads = -(-tiles // plan.tiles_per_split) if invariant else plan.num_splits
        for split in range(plan.num_splits):  # split-kernel programs and their loops
            if invariant:
                lo = split * plan.tiles_per_split
                hi = min(lo + plan.tiles_per_split, tiles)
            else:
                lo, hi = split * tiles // plan.num_splits, (split + 1) * tiles // plan.num_splits
            expected += 1 + max(0, hi - lo)
        if not plan.direct_output:
            expected += 1 + 2 * reads  # one merge program, two passes over the splits
    assert plan.steps(kv_lens, num_kv_heads, window) == expected * num_kv_heads


# The merge of given partials --------------------------------------------------------
def test_merge_of_given_partials_with_empty_splits():
    """Partials written by hand, two of four splits empty (max -inf, sum 0), and one
    sequence with no key at all: the merge must give sum_s 2^(m_s - m) acc_s over
    sum_s 2^(m_s - m) l_s, computed here in float64, and 0 for the empty sequence; its
    log-sum-exp (natural log) ln 2 (m + log2 sum_s 2^(m_s - m) l_s), and -inf for the empty
    sequence."""
    case = PagedCase(kv_lens=(200, 200), num_q_heads=4, num_kv_heads=1, head_dim=64,
                     block_size=16, dtype="float32", name="merge")
    inputs = materialize(case, DEVICE)
    launch = sd.plan_paged_split_decode(inputs.q, inputs.kv_cache, inputs.block_tables,
                                        inputs.kv_lens, inputs.scale, num_splits=4)
    part_acc, part_m, part_l = launch.merge_args[4:7]
    gen = torch.Generator().manual_seed(0)
    m = torch.randn(part_m.shape, generator=gen, dtype=torch.float64) * 4
    l_ = torch.rand(part_l.shape, generator=gen, dtype=torch.float64) * 10 + 0.5
    acc = torch.randn(part_acc.shape, generator=gen, dtype=torch.float64)
    m[0, :, 1], l_[0, :, 1], acc[0, :, 1] = -math.inf, 0.0, 0.0
    m[0, :, 3], l_[0, :, 3], acc[0, :, 3] = -math.inf, 0.0, 0.0
    m[1], l_[1], acc[1] = -math.inf, 0.0, 0.0  # no split of sequence 1 saw a key
    part_m.copy_(m), part_l.copy_(l_), part_acc.copy_(acc)
    sd._merge_kernel[launch.merge_grid](*launch.merge_args, **launch.merge_constexprs)
    w = torch.exp2(m[0] - m[0].max(dim=1, keepdim=True).values)  # [heads, splits]
    expected = (w[..., None] * acc[0]).sum(1) / (w * l_[0]).sum(1)[:, None]
    torch.testing.assert_close(launch.out[0].double().cpu(), expected, rtol=1e-5, atol=1e-6)
    assert bool((launch.out[1] == 0).all())
    top = m[0].max(dim=1).values
    lse = (top + torch.log2((w * l_[0]).sum(1))) * math.log(2)
    torch.testing.assert_close(launch.lse[0].double().cpu(), lse, rtol=1e-5, atol=1e-5)
    assert bool((launch.lse[1] == -math.inf).all())


# Validation and the output buffer --------------------------------------------------
@pytest.fixture(scope="module")
def inputs():
    case = PagedCase(kv_lens=(5, 17), num_q_heads=4, num_kv_heads=2, head_dim=64,
                     block_size=16, dtype="float16", name="launcher")
    return materialize(case, DEVICE)


def _args(inputs):
    return dict(q=inputs.q, kv_cache=inputs.kv_cache, block_tables=inputs.block_tables,
                kv_lens=inputs.kv_lens, sm_scale=inputs.scale)


@pytest.mark.parametrize(("mutate", "message"), [
    (lambda a: a.update(kv_lens=a["kv_lens"][:1]),
     "kv_lens must be [batch=2] (one query token per sequence"),
    (lambda a: a.update(kv_lens=torch.tensor([5, 999], dtype=torch.int32, device=DEVICE)),
     "kv_lens[1] = 999 is outside [0, 32]"),
    (lambda a: a.update(kv_cache=a["kv_cache"].to(torch.bfloat16)),
     "must equal q.dtype (torch.float16) or be one of"),
    (lambda a: a.update(k_scale=2.0), "k_scale=2.0 needs an fp8 kv_cache"),
    (lambda a: a.update(kv_cache=a["kv_cache"].to(torch.float8_e5m2), v_scale=0.0),
     "v_scale must be a finite float > 0"),
    (lambda a: a.update(alibi_slopes=torch.ones(3, device=DEVICE)),
     "alibi_slopes must be None or a float32 Tensor[num_q_heads=4]"),
    (lambda a: a.update(sinks=torch.ones(4, dtype=torch.float64, device=DEVICE)),
     "sinks must be None or a float32 Tensor[num_q_heads=4]"),
    (lambda a: a.update(sliding_window=True), "sliding_window must be None or an int >= 1"),
    (lambda a: a.update(num_splits=0), "num_splits must be None or an int >= 1"),
    (lambda a: a.update(num_sms=0), "num_sms must be >= 1"),
    (lambda a: a.update(q=a["q"][:, :3]), "num_q_heads (3) must be a multiple"),
], ids=["kv-lens-batch", "kv-len-too-long", "kv-dtype", "scale-without-fp8", "scale-0",
        "alibi-shape", "sinks-dtype", "window-bool", "splits-0", "sms-0", "heads"])
def test_launcher_rejects_bad_inputs_naming_them(inputs, mutate, message):
    args = _args(inputs)
    mutate(args)
    with pytest.raises(ValueError) as info:
        sd.paged_split_decode(**args)
    assert message in str(info.value)


def test_launcher_refuses_a_misspelt_feature(inputs):
    with pytest.raises(TypeError) as info:
        sd.paged_split_decode(**_args(inputs), soft_cap=30.0)
    assert str(info.value) == (
        "paged_split_decode() got unexpected keyword argument(s) ['soft_cap']; its features "
        "are ['alibi_slopes', 'k_scale', 'logits_soft_cap', 'sinks', 'sliding_window', "
        "'v_scale']")


def test_one_balanced_split_writes_the_output_directly(inputs):
    launch = sd.plan_paged_split_decode(**_args(inputs), num_splits=1)
    assert launch.plan.direct_output and launch.constexprs["DIRECT_OUTPUT"]
    split = sd.plan_paged_split_decode(**_args(inputs), num_splits=2)
    assert not split.plan.direct_output
    torch.testing.assert_close(launch(), split(), rtol=2e-3, atol=2e-3)


def test_empty_sequence_gives_zero_rows(inputs):
    kv_lens = torch.tensor([0, 17], dtype=torch.int32, device=DEVICE)
    for num_splits in (1, 3):
        out = sd.paged_split_decode(**{**_args(inputs), "kv_lens": kv_lens},
                                    num_splits=num_splits)
        assert bool((out[0] == 0).all()) and bool(torch.isfinite(out[1]).all())
