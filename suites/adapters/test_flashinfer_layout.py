"""FlashInfer adapter: the canonical inputs become FlashInfer's CSR page table and NHD/HND
cache exactly (CPU, no FlashInfer needed); on a GPU, both layouts match the truth.

The gathers below follow FlashInfer's documented semantics (docs/tutorials/kv_layout.rst):
sequence ``i`` owns pages ``indices[indptr[i]:indptr[i + 1]]`` and holds
``page_size * (num_pages - 1) + last_page_len`` tokens; token ``t`` lives in page
``t // page_size`` at offset ``t % page_size``, found at ``cache[page, 0|1, offset]``
(NHD) or ``cache[page, 0|1, :, offset]`` (HND).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given

from pagedbench.adapters.flashinfer import (
    FlashInferHND,
    FlashInferNHD,
    csr_page_table,
    to_flashinfer_cache,
    window_left,
)
from pagedbench.harness.cases.strategies import paged_cases
from pagedbench.harness.verdict.tolerance import assert_matches_truth
from pagedbench.reference import PagedCase, gather_kv, materialize

LAYOUTS = ("NHD", "HND")


def _gather_flashinfer(cache: torch.Tensor, indptr: list[int], indices: list[int],
                       last_page_len: list[int], page_size: int, layout: str):
    """Per sequence (k, v) ``[kv_len, num_kv_heads, head_dim]``, read FlashInfer's way."""
    out = []
    for i in range(len(last_page_len)):
        pages = indices[indptr[i]:indptr[i + 1]]
        kv_len = page_size * (len(pages) - 1) + last_page_len[i]
        rows = []
        for t in range(kv_len):
            page, offset = pages[t // page_size], t % page_size
            if layout == "NHD":
                rows.append(cache[page, :, offset])  # [2, hkv, d]
            else:
                rows.append(cache[page, :, :, offset])  # [2, hkv, d]
        kv = torch.stack(rows)  # [kv_len, 2, hkv, d]
        out.append((kv[:, 0], kv[:, 1]))
    return out


def test_csr_page_table_hand_computed() -> None:
    """Two sequences of 33 and 16 tokens in blocks of 16: 3 pages (last holds 1) and
    1 page (full); table padding (the trailing 0s) is dropped."""
    table = csr_page_table(torch.tensor([[5, 2, 9], [7, 0, 0]], dtype=torch.int32),
                           torch.tensor([33, 16], dtype=torch.int32), 16)
    assert table.indptr.tolist() == [0, 3, 4]
    assert table.indices.tolist() == [5, 2, 9, 7]
    assert table.last_page_len.tolist() == [1, 16]


def test_csr_page_table_block_size_one() -> None:
    """Page size 1 (one of FlashInfer's tested sizes): one page per token, all full."""
    table = csr_page_table(torch.tensor([[4, 1, 3], [2, 0, 0]], dtype=torch.int32),
                           torch.tensor([3, 1], dtype=torch.int32), 1)
    assert table.indptr.tolist() == [0, 3, 4]
    assert table.indices.tolist() == [4, 1, 3, 2]
    assert table.last_page_len.tolist() == [1, 1]


@given(case=paged_cases())
def test_csr_page_table_invariants(case: PagedCase) -> None:
    """int32 everywhere; last_page_len in [1, block_size]; each sequence's page count and
    length agree with kv_lens; indices are the table's leading entries, in order."""
    inputs = materialize(case)
    table = csr_page_table(inputs.block_tables, inputs.kv_lens, case.block_size)
    assert {table.indptr.dtype, table.indices.dtype, table.last_page_len.dtype} == {torch.int32}
    indptr, last = table.indptr.tolist(), table.last_page_len.tolist()
    assert indptr[0] == 0 and indptr[-1] == len(table.indices)
    for i, kv_len in enumerate(case.kv_lens):
        pages = indptr[i + 1] - indptr[i]
        assert 1 <= last[i] <= case.block_size
        assert case.block_size * (pages - 1) + last[i] == kv_len
        assert table.indices[indptr[i]:indptr[i + 1]].tolist() == \
            inputs.block_tables[i, :pages].tolist()


@pytest.mark.parametrize("layout", LAYOUTS)
@given(case=paged_cases())
def test_gather_through_flashinfer_layout_matches_canonical(layout: str, case: PagedCase) -> None:
    """K and V read through the CSR table and the layout's cache are the logical K/V."""
    inputs = materialize(case)
    table = csr_page_table(inputs.block_tables, inputs.kv_lens, case.block_size)
    cache = to_flashinfer_cache(inputs.kv_cache, layout)
    got = _gather_flashinfer(cache, table.indptr.tolist(), table.indices.tolist(),
                             table.last_page_len.tolist(), case.block_size, layout)
    for (k, v), (k_ref, v_ref) in zip(got, gather_kv(inputs)):
        assert torch.equal(k, k_ref) and torch.equal(v, v_ref)


@given(case=paged_cases())
def test_hnd_cache_round_trips(case: PagedCase) -> None:
    """HND is the canonical cache with block_size and num_kv_heads swapped, NaN poison
    included: swapping them back gives the canonical cache bit for bit."""
    inputs = materialize(case)
    hnd = to_flashinfer_cache(inputs.kv_cache, "HND")
    assert hnd.shape == (case.pool_blocks, 2, case.num_kv_heads, case.block_size, case.head_dim)
    assert hnd.is_contiguous()
    back = hnd.permute(0, 1, 3, 2, 4)  # [num_blocks, 2, block_size, hkv, d]
    torch.testing.assert_close(back, inputs.kv_cache, rtol=0, atol=0, equal_nan=True)


def test_nhd_cache_is_the_canonical_tensor() -> None:
    inputs = materialize(PagedCase(kv_lens=(5, 17), num_q_heads=4, num_kv_heads=2,
                                   head_dim=64, block_size=16))
    assert to_flashinfer_cache(inputs.kv_cache, "NHD") is inputs.kv_cache


def test_unknown_layout_is_refused() -> None:
    with pytest.raises(ValueError, match="kv_layout must be one of"):
        to_flashinfer_cache(torch.zeros(2, 2, 4, 1, 8), "NDH")


def test_csr_page_table_refuses_short_tables() -> None:
    with pytest.raises(ValueError, match="block_tables has 1 columns"):
        csr_page_table(torch.tensor([[0]], dtype=torch.int32),
                       torch.tensor([17], dtype=torch.int32), 16)
    with pytest.raises(ValueError, match="block_size must be >= 1"):
        csr_page_table(torch.tensor([[0]], dtype=torch.int32),
                       torch.tensor([1], dtype=torch.int32), 0)


@pytest.mark.parametrize("sliding_window, expected", [(None, -1), (1, 0), (64, 63)])
def test_window_left_is_window_minus_one(sliding_window, expected) -> None:
    """window_left is how many keys left of the query it sees: a window of W keys (the
    query's own position and the W - 1 before it) is window_left = W - 1."""
    assert window_left(sliding_window) == expected


def test_window_left_refuses_empty_window() -> None:
    with pytest.raises(ValueError, match="sliding_window must be None or >= 1"):
        window_left(0)


@pytest.mark.gpu
@pytest.mark.parametrize("adapter_cls", [FlashInferNHD, FlashInferHND], ids=["nhd", "hnd"])
@pytest.mark.parametrize("q_lens", [None, (1, 5, 16)], ids=["decode", "mixed-prefill"])
def test_flashinfer_matches_truth_and_repeats(adapter_cls, q_lens) -> None:
    """Boundary lengths at block size 16, GQA 5 (the tensor-core decode path): the output
    passes the tolerance policy, and a second run of the same plan is bit-identical."""
    adapter = adapter_cls()
    availability = adapter.available("cuda")
    if not availability.ok:
        pytest.skip(availability.reason)
    case = PagedCase(kv_lens=(1, 16, 17), q_lens=q_lens, num_q_heads=10, num_kv_heads=2,
                     head_dim=128, block_size=16, dtype="bfloat16", sliding_window=12,
                     name="fi-pinned")
    assert adapter.why_unsupported(case, "cuda") == []
    prepared = adapter.prepare(materialize(case, "cuda"))
    first = adapter.run(prepared).clone()
    cpu = materialize(case)
    assert_matches_truth(first, cpu, case.case_id)
    assert torch.equal(adapter.run(prepared), first)
