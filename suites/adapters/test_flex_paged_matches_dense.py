"""flex-paged agrees with the float64 truth on every mode, feature and dtype it declares.

One small case per claim (each is one compiled shape family: 5-30 s on two cores with a
cold inductor cache): decode through both of the CPU kernel's templates (FLEX_ATTENTION,
and FLEX_DECODING, which it picks for one query row when the pool holds at least 512
tokens per sequence, ``cpp_flex_attention_template.py``), prefill mixed with decode,
sliding window, soft cap; GQA, MQA and MHA; block sizes 16, 32, 48 (not a power of two);
head dims 64, 80, 128; float32, float16, bfloat16. Every kv_len is a multiple of
block_size: see test_flex_paged_poison.py for why, and for the partly filled blocks.
"""

from __future__ import annotations

import pytest

from pagedbench.adapters.flex_paged import FlexPaged
from pagedbench.harness.verdict.tolerance import assert_matches_truth
from pagedbench.reference import PagedCase, materialize

CASES = [
    # decode, GQA 4, FLEX_ATTENTION template (pool of 20 * 16 tokens for 3 sequences)
    PagedCase(kv_lens=(16, 48, 96), num_q_heads=8, num_kv_heads=2, head_dim=64,
              block_size=16, dtype="float32", num_blocks=20, name="decode"),
    # decode, MQA, FLEX_DECODING template (pool of 60 * 32 tokens for 2 sequences)
    PagedCase(kv_lens=(512, 1024), num_q_heads=8, num_kv_heads=1, head_dim=128,
              block_size=32, dtype="bfloat16", num_blocks=60, name="decode-long"),
    # prefill chunks mixed with a decode, MHA, block_size not a power of two
    PagedCase(kv_lens=(48, 96, 144), q_lens=(1, 40, 7), num_q_heads=4, num_kv_heads=4,
              head_dim=80, block_size=48, dtype="float16", name="mixed"),
    # sliding window shorter than a block, across block boundaries, in prefill
    PagedCase(kv_lens=(16, 64, 96), q_lens=(16, 5, 33), num_q_heads=8, num_kv_heads=2,
              head_dim=64, block_size=16, dtype="bfloat16", sliding_window=11, name="window"),
    # soft cap where tanh bends: scaled logits have a std of about 5.6 here (q.k sums 60
    # unit-variance channels and 4 outlier channels of variance 16, times sm_scale 0.5)
    PagedCase(kv_lens=(16, 48, 96), num_q_heads=8, num_kv_heads=1, head_dim=64,
              block_size=16, dtype="float32", logits_soft_cap=5.0, sm_scale=0.5, name="softcap"),
]


#: The cases every run checks (a decode and a windowed prefill); the rest are ``nightly``.
EVERY_RUN = ("decode", "window")


@pytest.mark.parametrize("case", [
    pytest.param(c, marks=() if c.name in EVERY_RUN else pytest.mark.nightly) for c in CASES],
    ids=[c.case_id for c in CASES])
def test_flex_paged_matches_dense(flex_paged: FlexPaged, case: PagedCase) -> None:
    assert flex_paged.why_unsupported(case, "cpu") == []
    inputs = materialize(case)
    out = flex_paged.run(flex_paged.prepare(inputs))
    assert_matches_truth(out, inputs, f"{flex_paged.name}:{case.case_id}")
