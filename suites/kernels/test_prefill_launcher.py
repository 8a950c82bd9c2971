"""The prefill launcher: the work list and rows per program, the step count, input
validation, and one launch serving a mixed batch exactly as separate launches do."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from pagedbench.reference import PagedCase, materialize

pytest.importorskip("triton")
from pagedbench.kernels import paged_prefill as pp  # noqa: E402
from pagedbench.suites.kernels.kernel_runs import run_prefill  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@st.composite
def lengths(draw):
    kv_lens = draw(st.lists(st.integers(1, 300), min_size=1, max_size=5))
    q_lens = [draw(st.integers(0, kv)) for kv in kv_lens]
    return q_lens, kv_lens


@given(lens=lengths(), group=st.sampled_from((1, 3, 4, 7, 8, 32)),
       window=st.one_of(st.none(), st.integers(1, 300)))
def test_work_list_covers_every_token_once_longest_first(lens, group, window):
    q_lens, kv_lens = lens
    plan = pp.plan_prefill(q_lens, kv_lens, group, 128, 2, window)
    assert plan.block_m >= 16 and plan.block_m & (plan.block_m - 1) == 0
    assert plan.block_m >= group and plan.tokens_per_program == plan.block_m // group
    covered = [(seq, first + j) for seq, first in plan.work
               for j in range(plan.tokens_per_program) if first + j < q_lens[seq]]
    assert sorted(covered) == [(s, t) for s, n in enumerate(q_lens) for t in range(n)]
    assert list(plan.key_tiles) == sorted(plan.key_tiles, reverse=True)
    tile = plan.config.kv_tile
    for (seq, first), tiles in zip(plan.work, plan.key_tiles):
        start = kv_lens[seq] - q_lens[seq] + first  # the first token's position
        last = kv_lens[seq] - q_lens[seq] + min(first + plan.tokens_per_program,
                                                q_lens[seq]) - 1
        lo = 0 if window is None else max(0, start - window + 1)
        assert tiles == len({p // tile for p in range(lo, last + 1)})


def test_rows_per_program_shrink_for_decode_and_cover_wide_groups():
    assert pp.plan_prefill([1, 1], [50, 9], 4, 128, 2).block_m == 16
    assert pp.plan_prefill([1, 30], [50, 30], 4, 128, 2).block_m == 64
    wide = pp.plan_prefill([1], [50], 32, 128, 2)
    assert (wide.block_m, wide.tokens_per_program) == (32, 1)


def test_steps_weigh_each_iteration_by_rows():
    plan = pp.plan_prefill([40, 1], [100, 64], 4, 64, 2)  # block_m 64: 16 tokens each
    assert plan.block_m == 64 and len(plan.work) == 4
    assert plan.steps(num_kv_heads=2) == (sum(plan.key_tiles) * 4 + 4) * 2


def test_a_mixed_batch_equals_its_sequences_launched_alone():
    """Decode, chunk and whole prompt in one launch give bitwise the rows each gets in a
    launch of its own (same block_m: the longest q_len fixes it in both)."""
    case = PagedCase(kv_lens=(30, 50, 16), q_lens=(1, 16, 16), num_q_heads=4,
                     num_kv_heads=1, head_dim=64, block_size=16, dtype="float16",
                     name="mixed")
    inputs = materialize(case, DEVICE)
    together = run_prefill(inputs)
    cu = inputs.cu_seqlens_q.tolist()
    for i in range(case.batch_size):
        one = torch.tensor([0, cu[i + 1] - cu[i]], dtype=torch.int32, device=DEVICE)
        alone = pp.paged_prefill(inputs.q[cu[i]:cu[i + 1]], inputs.kv_cache,
                                 inputs.block_tables[i:i + 1], inputs.kv_lens[i:i + 1], one,
                                 inputs.scale)
        if i:  # the decode alone gets 16 rows, not 64: compare with the tolerance
            assert torch.equal(alone, together[cu[i]:cu[i + 1]]), f"sequence {i}"
        else:
            torch.testing.assert_close(alone, together[:1], rtol=1e-3, atol=1e-3)


@pytest.fixture(scope="module")
def inputs():
    case = PagedCase(kv_lens=(5, 17), q_lens=(2, 3), num_q_heads=4, num_kv_heads=2,
                     head_dim=64, block_size=16, dtype="float16", name="launcher")
    return materialize(case, DEVICE)


def _args(inputs):
    return dict(q=inputs.q, kv_cache=inputs.kv_cache, block_tables=inputs.block_tables,
                kv_lens=inputs.kv_lens, cu_seqlens_q=inputs.cu_seqlens_q,
                sm_scale=inputs.scale)


def _cu(values):
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


@pytest.mark.parametrize(("mutate", "message"), [
    (lambda a: a.update(cu_seqlens_q=_cu([0, 2])),
     "cu_seqlens_q must be an int32 Tensor[batch + 1 = 3]"),
    (lambda a: a.update(cu_seqlens_q=a["cu_seqlens_q"].long()), "cu_seqlens_q must be an int32"),
    (lambda a: a.update(cu_seqlens_q=_cu([0, 3, 2])), "must rise from 0 to total_q = 5"),
    (lambda a: a.update(cu_seqlens_q=_cu([0, 2, 4])), "must rise from 0 to total_q = 5"),
    (lambda a: a.update(kv_lens=_cu([1, 17])), "sequence 0: q_len 2 must be in [0, kv_len = 1]"),
    (lambda a: a.update(sm_scale=-1.0), "sm_scale must be finite and > 0"),
], ids=["cu-shape", "cu-int64", "cu-falls", "cu-short", "q-longer-than-kv", "scale"])
def test_launcher_rejects_bad_inputs_naming_them(inputs, mutate, message):
    args = _args(inputs)
    mutate(args)
    with pytest.raises(ValueError) as info:
        pp.paged_prefill(**args)
    assert message in str(info.value)


def test_launcher_rejects_a_non_tensor_cu_seqlens_q(inputs):
    with pytest.raises(TypeError, match="cu_seqlens_q must be a torch.Tensor, got list"):
        pp.paged_prefill(**{**_args(inputs), "cu_seqlens_q": [0, 2, 5]})
