"""The canonical cache in vLLM's legacy split-x layout (``vllm-chunked-prefill``'s input).

Property: reading every live token back out of the converted K and V, token by token,
with the layout's documented index formula (vLLM's ``PagedAttention.split_kv_cache``:
K ``[num_blocks, num_kv_heads, head_dim // x, block_size, x]`` with ``x = 16 // element
size``, V ``[num_blocks, num_kv_heads, head_dim, block_size]``), gives exactly the logical
K/V of :func:`pagedbench.reference.gather_kv`; and the NaN poison of every slot that holds
no live token survives the conversion. Needs no vLLM (the conversion is ours).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from pagedbench.adapters.vllm_triton import split_x, to_split_x_layout
from pagedbench.reference import PagedCase, gather_kv, materialize

#: 16-byte vectors: elements per vector by dtype (the x of the layout), written out here
#: rather than computed, so the test does not share the code under test.
X_BY_DTYPE = {"float32": 4, "float16": 8, "bfloat16": 8}


@st.composite
def small_cases(draw: st.DrawFn) -> PagedCase:
    dtype = draw(st.sampled_from(sorted(X_BY_DTYPE)))
    block_size = draw(st.sampled_from([1, 3, 16, 32]))
    batch = draw(st.integers(1, 3))
    kv_lens = draw(st.lists(st.integers(1, 3 * block_size + 1), min_size=batch,
                            max_size=batch))
    num_kv_heads = draw(st.sampled_from([1, 2]))
    return PagedCase(
        kv_lens=tuple(kv_lens),
        num_q_heads=num_kv_heads,
        num_kv_heads=num_kv_heads,
        head_dim=X_BY_DTYPE[dtype] * draw(st.integers(1, 3)),
        block_size=block_size,
        dtype=dtype,
        seed=draw(st.integers(0, 2**16)),
        name="layout",
    )


def _read_back(case: PagedCase, key_cache: torch.Tensor, value_cache: torch.Tensor,
               block_tables: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each sequence's K/V, ``[kv_len, num_kv_heads, head_dim]``, element by element."""
    x = X_BY_DTYPE[case.dtype]
    out = []
    for seq, kv_len in enumerate(case.kv_lens):
        k = torch.empty(kv_len, case.num_kv_heads, case.head_dim, dtype=key_cache.dtype)
        v = torch.empty_like(k)
        for t in range(kv_len):
            block = int(block_tables[seq, t // case.block_size])
            slot = t % case.block_size
            for h in range(case.num_kv_heads):
                for d in range(case.head_dim):
                    k[t, h, d] = key_cache[block, h, d // x, slot, d % x]
                    v[t, h, d] = value_cache[block, h, d, slot]
        out.append((k, v))
    return out


@given(small_cases())
@example(PagedCase(kv_lens=(1, 16, 17), num_q_heads=2, num_kv_heads=2, head_dim=8,
                   block_size=16, dtype="float16", name="layout"))
@example(PagedCase(kv_lens=(32, 5), num_q_heads=1, num_kv_heads=1, head_dim=4,
                   block_size=32, dtype="float32", name="layout"))
def test_split_x_layout_gathers_back_to_logical_kv(case: PagedCase) -> None:
    inputs = materialize(case)
    key_cache, value_cache = to_split_x_layout(inputs.kv_cache)
    x = X_BY_DTYPE[case.dtype]
    num_blocks = case.pool_blocks
    assert key_cache.shape == (num_blocks, case.num_kv_heads, case.head_dim // x,
                               case.block_size, x)
    assert value_cache.shape == (num_blocks, case.num_kv_heads, case.head_dim,
                                 case.block_size)
    assert key_cache.dtype == value_cache.dtype == case.torch_dtype
    read = _read_back(case, key_cache, value_cache, inputs.block_tables)
    for seq, ((k, v), (k_ref, v_ref)) in enumerate(zip(read, gather_kv(inputs))):
        assert torch.equal(k, k_ref), f"{case.case_id}: K of sequence {seq} differs"
        assert torch.equal(v, v_ref), f"{case.case_id}: V of sequence {seq} differs"


@given(small_cases())
def test_split_x_layout_keeps_poison_in_every_unused_slot(case: PagedCase) -> None:
    inputs = materialize(case)
    key_cache, value_cache = to_split_x_layout(inputs.kv_cache)
    live = torch.zeros(case.pool_blocks, case.block_size, dtype=torch.bool)
    for slot in inputs.slot_mapping.tolist():
        live[slot // case.block_size, slot % case.block_size] = True
    # [num_blocks, block_size]: every channel of every head NaN in an unused slot,
    # none NaN in a live one.
    k_nan = key_cache.isnan().permute(0, 3, 1, 2, 4).flatten(2)  # [nb, bs, hkv*d]
    v_nan = value_cache.isnan().permute(0, 3, 1, 2).flatten(2)  # [nb, bs, hkv*d]
    for name, nan in (("K", k_nan), ("V", v_nan)):
        assert torch.equal(nan.all(-1), ~live), f"{case.case_id}: {name} lost poison"
        assert torch.equal(nan.any(-1), ~live), f"{case.case_id}: {name} gained NaN"


@pytest.mark.parametrize("dtype, expected", sorted(X_BY_DTYPE.items()))
def test_split_x_is_sixteen_bytes_of_elements(dtype: str, expected: int) -> None:
    assert split_x(getattr(torch, dtype)) == expected


def test_split_x_layout_rejects_head_dim_not_a_multiple_of_x() -> None:
    kv_cache = torch.zeros(3, 2, 16, 1, 12, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"head_dim must be a multiple of x=8.*got 12"):
        to_split_x_layout(kv_cache)


def test_split_x_layout_rejects_a_cache_that_is_not_canonical() -> None:
    with pytest.raises(ValueError, match=r"kv_cache must be \[num_blocks, 2, block_size"):
        to_split_x_layout(torch.zeros(3, 16, 1, 8))
