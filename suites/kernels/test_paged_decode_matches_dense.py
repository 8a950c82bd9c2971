"""The Triton paged-decode kernel agrees with float64 dense attention.

Hypothesis covers block_size {1, 2, 8, 16, 32, 48, 64, 128}, GQA ratios {1, 2, 4, 5, 8},
head_dim {64, 80, 96, 128} and float32/float16/bfloat16, with ragged batches of up to 3
sequences whose first length sits on a block boundary (1, block_size - 1, block_size,
block_size + 1). The pinned examples alone cover every value of every axis once, so a
run of the ``ci`` profile always sees all of them. On the CPU the kernel is interpreted
(suites/conftest.py sets TRITON_INTERPRET=1), bfloat16 included: the launcher upcasts
its ``tl.dot`` operands there (triton-lang/triton#11584).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from pagedbench.harness.verdict.tolerance import assert_matches_truth
from pagedbench.reference import PagedCase, materialize

pytest.importorskip("triton")
from pagedbench.kernels.paged_decode import paged_decode  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BLOCK_SIZES = (1, 2, 8, 16, 32, 48, 64, 128)
GQA_RATIOS = (1, 2, 4, 5, 8)
HEAD_DIMS = (64, 80, 96, 128)
DTYPES = ("float32", "float16", "bfloat16")
#: Longest random context: keeps a case to a few interpreted loop steps per program.
MAX_KV_LEN = 100


def boundary_lens(block_size: int) -> list[int]:
    """Lengths where paged kernels go wrong: first key, one short of, at, one past a block."""
    return sorted({n for n in (1, block_size - 1, block_size, block_size + 1) if n >= 1})


@st.composite
def decode_cases(draw) -> PagedCase:
    block_size = draw(st.sampled_from(BLOCK_SIZES))
    num_kv_heads = draw(st.sampled_from((1, 2)))
    batch = draw(st.integers(1, 3))
    boundary = st.sampled_from(boundary_lens(block_size))
    others = st.lists(st.one_of(boundary, st.integers(1, MAX_KV_LEN)),
                      min_size=batch - 1, max_size=batch - 1)
    return PagedCase(
        kv_lens=(draw(boundary), *draw(others)),
        num_q_heads=num_kv_heads * draw(st.sampled_from(GQA_RATIOS)),
        num_kv_heads=num_kv_heads,
        head_dim=draw(st.sampled_from(HEAD_DIMS)),
        block_size=block_size,
        dtype=draw(st.sampled_from(DTYPES)),
        seed=draw(st.integers(0, 2**16)),
        name="triton-decode",
    )


def _case(kv_lens, ratio, num_kv_heads, head_dim, block_size, dtype) -> PagedCase:
    return PagedCase(kv_lens=kv_lens, num_q_heads=ratio * num_kv_heads,
                     num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size,
                     dtype=dtype, seed=block_size, name="triton-decode")


@given(case=decode_cases())
@example(case=_case((1, 60, 2), 1, 2, 64, 1, "float32"))
@example(case=_case((2, 1, 3), 2, 1, 80, 2, "float16"))
@example(case=_case((7, 9, 95), 4, 2, 96, 8, "bfloat16"))
@example(case=_case((16, 15, 17), 5, 1, 128, 16, "float32"))
@example(case=_case((33, 1), 8, 2, 64, 32, "float16"))
@example(case=_case((49, 47, 48), 1, 1, 80, 48, "bfloat16"))
@example(case=_case((64, 100), 5, 2, 96, 64, "bfloat16"))
@example(case=_case((129, 127), 2, 1, 128, 128, "float16"))
def test_decode_matches_dense(case: PagedCase):
    inputs = materialize(case, DEVICE)
    out = paged_decode(inputs.q, inputs.kv_cache, inputs.block_tables, inputs.kv_lens,
                       inputs.scale)
    assert_matches_truth(out, inputs, case.case_id)


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_head_dim_256_matches_dense(dtype: str):
    """head_dim 256 (gemma2-9b), outside the hypothesis space to keep its steps cheap."""
    case = _case((1, 33, 70), 2, 1, 256, 16, dtype)
    inputs = materialize(case, DEVICE)
    out = paged_decode(inputs.q, inputs.kv_cache, inputs.block_tables, inputs.kv_lens,
                       inputs.scale)
    assert_matches_truth(out, inputs, case.case_id)
