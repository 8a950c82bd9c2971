"""Known fault, pinned: compiled FlexAttention reads the unused V slots of a partly filled
last block, so the NaN poison there reaches the output; flex-paged therefore declares
``nan_safe_tail=False`` and is checked with finite stale values in those slots.

The CPU kernel (``cpp_flex_attention_template.py``) masks scores to -inf, so the masked
slots get probability 0, then multiplies the whole KV block of probabilities by the
whole block of V: ``0 * NaN = NaN``. Poisoning K alone is harmless (the mask replaces
the NaN score), poisoning V alone is not. Same class as SDPA's pytorch/pytorch#101967;
vLLM zeroes such V rows in its kernel (vllm-project/vllm#641). If a PyTorch release
fixes it, ``test_poisoned_v_tail_reaches_the_output`` fails: drop the declaration in
``flex_paged.CAPABILITIES``.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from pagedbench.adapters.flex_paged import FlexPaged
from pagedbench.harness.verdict.conformance import tail_poison
from pagedbench.harness.verdict.tolerance import (Expected, assert_close_report,
                                                  assert_matches_truth)
from pagedbench.reference import PagedCase, PagedInputs, materialize

#: Sequences 0 and 2 end inside a block (5 = 0 * 16 + 5, 90 = 5 * 16 + 10); sequence 1
#: fills its last block. Same shape family as the decode case of
#: test_flex_paged_matches_dense.py (batch 3, 8/2 heads, head_dim 64, 20 blocks of 16).
CASE = PagedCase(kv_lens=(5, 48, 90), num_q_heads=8, num_kv_heads=2, head_dim=64,
                 block_size=16, dtype="float32", num_blocks=20, name="poison")
PARTIAL = [0, 2]


def _tail_slots_filled(inputs: PagedInputs, kv_index: int) -> PagedInputs:
    """``inputs`` with the unused slots of each partly filled last block set to 0 in K
    (``kv_index`` 0) or V (1); every other NaN stays."""
    kv_cache = inputs.kv_cache.clone()
    bs = inputs.case.block_size
    for table, kv_len in zip(inputs.block_tables.tolist(), inputs.case.kv_lens):
        last_block = table[(kv_len - 1) // bs]
        for offset in range(kv_len % bs or bs, bs):
            kv_cache[last_block, kv_index, offset] = 0.0
    return replace(inputs, kv_cache=kv_cache)


def test_partly_filled_last_block_is_declared_nan_unsafe(flex_paged: FlexPaged) -> None:
    """The declaration, and what conformance does with it: stale finite values in the
    tails (not NaN) and the output is correct."""
    caps = flex_paged.capabilities("cpu")
    assert not caps.nan_safe_tail and tail_poison(caps) == "stale"
    assert flex_paged.why_unsupported(CASE, "cpu") == []
    inputs = materialize(CASE, tail_poison="stale")
    out = flex_paged.run(flex_paged.prepare(inputs))
    assert_matches_truth(out, inputs, f"{CASE.case_id}:stale")


@pytest.mark.parametrize("poisoned", ["k-and-v", "v-only"])
def test_poisoned_v_tail_reaches_the_output(flex_paged: FlexPaged, poisoned: str) -> None:
    inputs = materialize(CASE)
    if poisoned == "v-only":
        inputs = _tail_slots_filled(inputs, kv_index=0)
    out = flex_paged.run(flex_paged.prepare(inputs))  # decode: row i is sequence i
    nan_rows = [i for i in range(CASE.batch_size) if bool(out[i].isnan().all())]
    assert nan_rows == PARTIAL
    full = [i for i in range(CASE.batch_size) if i not in PARTIAL]
    expected = Expected.of(inputs)
    assert_close_report(out[full], Expected(expected.truth[full], expected.naive[full]),
                        CASE.dtype, f"{CASE.case_id}:{poisoned}")


def test_poisoned_k_tail_alone_is_masked(flex_paged: FlexPaged) -> None:
    inputs = _tail_slots_filled(materialize(CASE), kv_index=1)
    out = flex_paged.run(flex_paged.prepare(inputs))
    assert_matches_truth(out, inputs, f"{CASE.case_id}:k-only")
