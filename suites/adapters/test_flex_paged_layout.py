"""flex-paged's layout conversion: reading Flex's pool through Flex's page table gives back
every sequence's logical K and V, and nothing else in the pool is live.

The reading side follows ``PagedAttention``'s documented addressing
(``torch/nn/attention/experimental/_paged_attention.py``, ``assign``: token ``t`` of batch
row ``b`` lives at ``page_table[b, t // page_size] * page_size + t % page_size`` of the
pool ``[1, H, n_pages * page_size, D]``), written here as plain Python loops; the expected
values come from :func:`pagedbench.reference.gather_kv`, which walks our block tables.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from hypothesis import example, given

from pagedbench.adapters.flex_paged import CAPABILITIES, to_flex_layout
from pagedbench.harness.cases.strategies import paged_cases
from pagedbench.reference import PagedCase, gather_kv, materialize


def _flex_addresses(page_table: list[int], kv_len: int, page_size: int) -> list[int]:
    """Pool address of each of a sequence's ``kv_len`` tokens, through Flex's page table."""
    return [page_table[t // page_size] * page_size + t % page_size for t in range(kv_len)]


def _case(kv_lens, block_size, num_q_heads, num_kv_heads, head_dim=16, dtype="float32"):
    return PagedCase(kv_lens=kv_lens, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
                     head_dim=head_dim, block_size=block_size, dtype=dtype, name="layout")


@given(case=paged_cases(CAPABILITIES, max_batch=5, max_kv_len=200, max_kv_heads=3))
@example(case=_case((1, 16, 17), 16, 4, 4))  # kv_len 1, block_size, block_size + 1; MHA
@example(case=_case((33, 2, 64, 1), 32, 8, 1, dtype="bfloat16"))  # ragged batch; MQA
@example(case=_case((7,), 1, 6, 2, dtype="float16"))  # one token per block
def test_flex_pool_read_through_page_table_equals_gather_kv(case: PagedCase) -> None:
    inputs = materialize(case)
    layout = to_flex_layout(inputs)
    paged = layout.paged
    bs, nb = case.block_size, case.pool_blocks
    assert layout.k_cache.shape == (1, case.num_kv_heads, nb * bs, case.head_dim)
    assert layout.v_cache.shape == layout.k_cache.shape
    assert layout.k_cache.dtype == layout.v_cache.dtype == case.torch_dtype
    assert (paged.n_pages, paged.page_size) == (nb, bs)

    live = torch.zeros(nb * bs, dtype=torch.bool)
    owned_by_any = set()
    for b, ((k, v), kv_len) in enumerate(zip(gather_kv(inputs), case.kv_lens)):
        row = paged.page_table[b].tolist()
        n = math.ceil(kv_len / bs)
        assert all(p == -1 for p in row[n:]), f"sequence {b}: pages past its last block"
        assert int(paged.capacity[b]) == n * bs
        addresses = _flex_addresses(row, kv_len, bs)
        index = torch.tensor(addresses)
        assert torch.equal(layout.k_cache[0][:, index].transpose(0, 1), k), f"K of sequence {b}"
        assert torch.equal(layout.v_cache[0][:, index].transpose(0, 1), v), f"V of sequence {b}"
        live[index] = True
        to_logical = paged.physical_to_logical[b].tolist()
        for page in range(nb):
            expected = row.index(page) if page in row[:n] else -1
            assert to_logical[page] == expected, f"physical_to_logical[{b}, {page}]"
        owned_by_any.update(row[:n])

    assert sorted(paged.empty_pages) == sorted(set(range(nb)) - owned_by_any)
    # The poison travels: every slot that no sequence reads is NaN, every read slot finite.
    for pool in (layout.k_cache, layout.v_cache):
        assert bool(pool[0][:, ~live].isnan().all())
        assert bool(pool[0][:, live].isfinite().all())


def test_to_flex_layout_rejects_a_block_named_twice() -> None:
    inputs = materialize(_case((40,), 16, 2, 2))
    tables = inputs.block_tables.clone()
    tables[0, 1] = tables[0, 0]
    with pytest.raises(ValueError, match=r"block_tables\[0\] names a block twice"):
        to_flex_layout(replace(inputs, block_tables=tables))


def test_to_flex_layout_rejects_a_block_outside_the_pool() -> None:
    inputs = materialize(_case((20, 3), 16, 2, 2))
    tables = inputs.block_tables.clone()
    tables[1, 0] = inputs.case.pool_blocks
    with pytest.raises(ValueError, match=rf"allowed: 0\.\.{inputs.case.pool_blocks - 1}"):
        to_flex_layout(replace(inputs, block_tables=tables))
