"""The paged-decode kernel reads only live slots, wherever the blocks lie.

- NaN poison never leaks: every slot past ``kv_len`` and the block that table padding
  points to hold NaN, and the output is finite and right (a multiply-by-zero mask, an
  unmasked load or a read through a padded table entry would turn it NaN).
- Every output element is written (the buffer starts as NaN).
- Paging is invisible: permuting the physical blocks and patching the block table gives
  bit-identical output (xformers' paged test does the same with one swap), and so does a
  cache stored head-major and viewed in the canonical shape (read through its strides).
"""

from __future__ import annotations

import pytest
import torch

from pagedbench.harness.verdict.tolerance import assert_matches_truth
from pagedbench.reference import PagedCase, materialize, new_output

pytest.importorskip("triton")
from pagedbench.kernels.paged_decode import paged_decode  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BLOCK_SIZE = 8
#: Lengths that end mid-block (the tail of the last block is poison) and differ, so the
#: shorter sequences' tables end in padding entries.
KV_LENS = (3, 13, 29)


@pytest.fixture(params=["float32", "bfloat16"])
def inputs(request):
    case = PagedCase(kv_lens=KV_LENS, num_q_heads=4, num_kv_heads=2, head_dim=64,
                     block_size=BLOCK_SIZE, dtype=request.param, seed=7, name="poison")
    return materialize(case, DEVICE)


def _run(inputs, kv_cache=None, block_tables=None):
    return paged_decode(inputs.q, inputs.kv_cache if kv_cache is None else kv_cache,
                        inputs.block_tables if block_tables is None else block_tables,
                        inputs.kv_lens, inputs.scale, out=new_output(inputs))


def test_decode_poison_never_leaks(inputs):
    case = inputs.case
    tables = inputs.block_tables.tolist()
    # The poison is really there: the tail of each last block and the padding block.
    for table, kv_len, blocks in zip(tables, case.kv_lens, case.blocks_per_seq):
        assert kv_len % BLOCK_SIZE, "each length must end mid-block"
        tail = inputs.kv_cache[table[blocks - 1], :, kv_len % BLOCK_SIZE:]
        assert bool(tail.isnan().all())
    padding = [entry for table, blocks in zip(tables, case.blocks_per_seq)
               for entry in table[blocks:]]
    assert padding and set(padding) == {inputs.padding_block}
    assert bool(inputs.kv_cache[inputs.padding_block].isnan().all())

    out = _run(inputs)
    assert bool(torch.isfinite(out).all()), "NaN/Inf leaked into the output"
    assert_matches_truth(out, inputs, case.case_id)


def test_decode_permuted_blocks_give_identical_output(inputs):
    num_blocks = inputs.kv_cache.shape[0]
    gen = torch.Generator().manual_seed(11)
    perm = torch.randperm(num_blocks, generator=gen).to(DEVICE)  # new position of block b
    permuted = torch.empty_like(inputs.kv_cache)
    permuted[perm] = inputs.kv_cache  # [num_blocks, 2, block_size, hkv, d]
    tables = perm[inputs.block_tables.long()].to(torch.int32)  # [batch, max_blocks]
    assert not torch.equal(tables, inputs.block_tables)
    assert torch.equal(_run(inputs, permuted, tables), _run(inputs))


def test_decode_reads_a_strided_cache_in_place(inputs):
    nb, _, bs, hkv, d = inputs.kv_cache.shape
    head_major = inputs.kv_cache.permute(0, 1, 3, 2, 4).contiguous()  # [nb, 2, hkv, bs, d]
    view = head_major.permute(0, 1, 3, 2, 4)  # [nb, 2, bs, hkv, d], not contiguous
    assert not view.is_contiguous()
    torch.testing.assert_close(view, inputs.kv_cache, rtol=0, atol=0, equal_nan=True)
    assert torch.equal(_run(inputs, kv_cache=view), _run(inputs))
