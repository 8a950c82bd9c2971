"""FlashAttention adapters: the canonical inputs become FlashAttention's paged arguments
exactly (CPU, no FlashAttention needed); on a GPU, FA2 and FA3 match the truth.

The gather below follows FlashAttention's documented semantics
(``flash_attn_with_kvcache`` docstring): ``k_cache`` is ``[num_blocks, page_block_size,
nheads_k, headdim]``, and key ``t < cache_seqlens[i]`` of sequence ``i`` is
``k_cache[block_table[i, t // page_block_size], t % page_block_size]``.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given

from pagedbench.adapters.flash_attn import (
    FA2_CAPABILITIES,
    FA3_CAPABILITIES,
    FlashAttn2,
    FlashAttn3,
    flash_attn_paged,
    window_size,
)
from pagedbench.harness.cases.strategies import paged_cases
from pagedbench.harness.verdict.tolerance import assert_matches_truth
from pagedbench.reference import PagedCase, gather_kv, materialize


@given(case=paged_cases())
def test_gather_through_flash_attn_layout_matches_canonical(case: PagedCase) -> None:
    inputs = materialize(case)
    paged = flash_attn_paged(inputs)
    table, lens = paged.block_table.tolist(), paged.cache_seqlens.tolist()
    for i, (k_ref, v_ref) in enumerate(gather_kv(inputs)):
        blocks = [table[i][t // case.block_size] for t in range(lens[i])]
        offsets = [t % case.block_size for t in range(lens[i])]
        assert torch.equal(paged.k_cache[blocks, offsets], k_ref)
        assert torch.equal(paged.v_cache[blocks, offsets], v_ref)


@given(case=paged_cases())
def test_flash_attn_metadata(case: PagedCase) -> None:
    """int32 index tensors; cu_seqlens_k are prefix sums of kv_lens from 0; contiguous
    K/V of the right shape; the batch maxima."""
    paged = flash_attn_paged(materialize(case))
    for tensor in (paged.block_table, paged.cache_seqlens, paged.cu_seqlens_q,
                   paged.cu_seqlens_k):
        assert tensor.dtype == torch.int32 and tensor.is_contiguous()
    cu_k = paged.cu_seqlens_k.tolist()
    assert cu_k[0] == 0
    assert [b - a for a, b in zip(cu_k, cu_k[1:])] == list(case.kv_lens)
    assert paged.cache_seqlens.tolist() == list(case.kv_lens)
    shape = (case.pool_blocks, case.block_size, case.num_kv_heads, case.head_dim)
    assert paged.k_cache.shape == shape and paged.k_cache.is_contiguous()
    assert paged.v_cache.shape == shape and paged.v_cache.is_contiguous()
    assert paged.max_seqlen_q == max(case.q_lens_or_decode)
    assert paged.max_seqlen_k == max(case.kv_lens)


@pytest.mark.parametrize("q_len, kv_len, window", [(1, 10, 3), (4, 9, 1), (5, 5, 7), (3, 12, 12)])
def test_window_size_selects_the_reference_window(q_len, kv_len, window) -> None:
    """FlashAttention's rule (query i sees keys [i + s_k - s_q - left, i + s_k - s_q +
    right]) with (left, right) = window_size(W) picks the keys the reference's causal
    window picks (position p = kv_len - q_len + i sees p - W + 1 .. p)."""
    left, right = window_size(window)
    for i in range(q_len):
        p = i + kv_len - q_len
        fa = {j for j in range(kv_len) if p - left <= j <= p + right}
        reference = {j for j in range(kv_len) if p - window + 1 <= j <= p}
        assert fa == reference


def test_window_size_off_and_invalid() -> None:
    assert window_size(None) == (-1, -1)
    with pytest.raises(ValueError, match="sliding_window must be None or >= 1"):
        window_size(0)


def test_softcap_off_is_zero() -> None:
    """FlashAttention reads softcap=0.0 as "no cap"; None must not reach it."""
    case = PagedCase(kv_lens=(3,), num_q_heads=2, num_kv_heads=1, head_dim=64, block_size=16)
    assert flash_attn_paged(materialize(case)).softcap == 0.0
    capped = flash_attn_paged(materialize(case.with_(logits_soft_cap=30.0)))
    assert capped.softcap == 30.0


@pytest.mark.parametrize("block_size, fa2_ok", [(16, False), (128, False), (256, True), (512, True)])
def test_fa2_block_size_rule(block_size, fa2_ok) -> None:
    """FA2's paged kernels need block_size % 256 == 0; FA3 takes any."""
    case = PagedCase(kv_lens=(300,), num_q_heads=4, num_kv_heads=4, head_dim=128,
                     block_size=block_size, dtype="float16")
    fa2 = FA2_CAPABILITIES.why_unsupported(case, "cuda")
    assert (fa2 == []) == fa2_ok
    assert all("block_size" in reason for reason in fa2)
    assert FA3_CAPABILITIES.why_unsupported(case, "cuda") == []


@pytest.mark.parametrize("head_dim, ok", [(8, True), (72, True), (256, True), (60, False),
                                          (264, False)])
def test_head_dim_rule(head_dim, ok) -> None:
    """head_dim must be a multiple of 8, at most 256 (flash_api.cpp)."""
    case = PagedCase(kv_lens=(3,), num_q_heads=2, num_kv_heads=2, head_dim=head_dim,
                     block_size=256, dtype="bfloat16")
    assert (FA2_CAPABILITIES.why_unsupported(case, "cuda") == []) == ok


@pytest.mark.gpu
@pytest.mark.parametrize("adapter_cls, block_size", [(FlashAttn2, 256), (FlashAttn3, 16)],
                         ids=["fa2-bs256", "fa3-bs16"])
@pytest.mark.parametrize("q_lens", [None, (1, 7, 3)], ids=["decode", "mixed-prefill"])
def test_flash_attn_matches_truth(adapter_cls, block_size, q_lens) -> None:
    """Lengths 1, block_size and block_size + 1, GQA 4, a window and a soft cap."""
    adapter = adapter_cls()
    availability = adapter.available("cuda")
    if not availability.ok:
        pytest.skip(availability.reason)
    case = PagedCase(kv_lens=(1, block_size, block_size + 1), q_lens=q_lens, num_q_heads=8,
                     num_kv_heads=2, head_dim=128, block_size=block_size, dtype="bfloat16",
                     sliding_window=40, logits_soft_cap=30.0, name="fa-pinned")
    assert adapter.why_unsupported(case, "cuda") == []
    out = adapter.run(adapter.prepare(materialize(case, "cuda")))
    cpu = materialize(case)
    assert_matches_truth(out, cpu, case.case_id)
