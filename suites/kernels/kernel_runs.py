"""Kernel runs and case strategies that several kernel test modules share (not collected).

``run_split`` and ``run_prefill`` call our Triton kernels with every feature of an input's
case, into a NaN-filled output buffer; ``feature_cases`` draws the cases both kernels'
searches use.
"""

from __future__ import annotations

import torch
from hypothesis import strategies as st

from pagedbench.kernels.paged_prefill import paged_prefill
from pagedbench.kernels.paged_split_decode import paged_split_decode
from pagedbench.reference import PagedCase, PagedInputs, new_output

DTYPES = ("float32", "float16", "bfloat16")


def run_split(inputs: PagedInputs, **options) -> torch.Tensor:
    """The kernel on ``inputs`` with every feature of its case, into a NaN buffer."""
    case = inputs.case
    return paged_split_decode(
        inputs.q, inputs.kv_cache, inputs.block_tables, inputs.kv_lens, inputs.scale,
        out=new_output(inputs), sliding_window=case.sliding_window,
        logits_soft_cap=case.logits_soft_cap, alibi_slopes=inputs.alibi_slopes,
        sinks=inputs.sinks, k_scale=case.k_scale, v_scale=case.v_scale, **options)


def run_prefill(inputs: PagedInputs) -> torch.Tensor:
    """The kernel on ``inputs`` with every feature of its case, into a NaN buffer."""
    case = inputs.case
    return paged_prefill(
        inputs.q, inputs.kv_cache, inputs.block_tables, inputs.kv_lens, inputs.cu_seqlens_q,
        inputs.scale, out=new_output(inputs), sliding_window=case.sliding_window,
        logits_soft_cap=case.logits_soft_cap, alibi_slopes=inputs.alibi_slopes,
        sinks=inputs.sinks, k_scale=case.k_scale, v_scale=case.v_scale)


@st.composite
def feature_cases(draw, max_kv_len: int = 100, prefill: bool = False) -> PagedCase:
    """Cases over block sizes 1/16/48, GQA 1/4/7, every feature and fp8 type; with
    ``prefill``, each sequence's q_len is 1, its kv_len, or up to 12 of it."""
    block_size = draw(st.sampled_from((1, 16, 48)))
    boundary = st.sampled_from(sorted({1, block_size, block_size + 1}))
    kv_lens = draw(st.lists(st.one_of(boundary, st.integers(1, max_kv_len)), min_size=1,
                            max_size=3))
    q_lens = None
    if prefill:
        q_lens = tuple(draw(st.sampled_from(sorted({1, kv, min(kv, 12)}))) for kv in kv_lens)
    fp8 = draw(st.sampled_from(("auto", "fp8_e4m3", "fp8_e5m2")))
    scales = {} if fp8 == "auto" else {"k_scale": 0.5, "v_scale": 2.0}
    return PagedCase(
        kv_lens=tuple(kv_lens), q_lens=q_lens, num_q_heads=draw(st.sampled_from((1, 4, 7))),
        num_kv_heads=1, head_dim=draw(st.sampled_from((64, 80))), block_size=block_size,
        dtype=draw(st.sampled_from(DTYPES)),
        sliding_window=draw(st.one_of(st.none(), st.integers(1, max_kv_len))),
        logits_soft_cap=draw(st.sampled_from((None, 5.0))),
        alibi=draw(st.booleans()), sinks=draw(st.booleans()),
        kv_cache_dtype=fp8, **scales, seed=draw(st.integers(0, 2**16)), name="hyp")
