"""Batch-invariant split decode: a sequence's output is bitwise the same in any batch.

With ``batch_invariant=True`` the split size is fixed, so one sequence's splits, their
arithmetic and the merge's loop depend on it alone. Here one sequence (the probe) is run
alone and inside batches whose other sequences are shorter, longer and differently
placed, at several positions, and its rows must be equal bit for bit, with a window and
sinks too. The balanced mode plans different split counts for those batches (so the
equality is the mode's doing, not an accident of one grid), and the batch-invariant
output still matches the float64 truth.
"""

from __future__ import annotations

import pytest
import torch

from pagedbench.harness.verdict.tolerance import assert_matches_truth
from pagedbench.reference import PagedCase, materialize

pytest.importorskip("triton")
from pagedbench.kernels.paged_split_plan import plan_splits  # noqa: E402
from pagedbench.suites.kernels.kernel_runs import run_split  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
#: Keys per split: 2 tiles of 64, so the probe (150 keys) has 2 splits and the others 1-3.
SPLIT_SIZE = 128
PROBE_LEN = 150


def _batch(kv_lens, dtype, **features) -> PagedCase:
    return PagedCase(kv_lens=kv_lens, num_q_heads=4, num_kv_heads=1, head_dim=64,
                     block_size=16, dtype=dtype, seed=5, name="invariant", **features)


def _probe_rows(case: PagedCase, index: int) -> torch.Tensor:
    """The output rows of sequence ``index``, whose q/K/V (and sinks) are those of the
    probe: the probe's inputs are materialized alone and copied into the batch's."""
    alone = materialize(case.with_(kv_lens=(PROBE_LEN,)), DEVICE)
    inputs = materialize(case, DEVICE)
    table = inputs.block_tables[index, : alone.block_tables.shape[1]].long()
    inputs.kv_cache[table] = alone.kv_cache[alone.block_tables[0].long()]
    inputs.q[index] = alone.q[0]
    if case.sinks:  # drawn per batch; the probe's must be the batch's
        inputs.sinks.copy_(alone.sinks)
    out = run_split(inputs, batch_invariant=True, split_size=SPLIT_SIZE)
    assert_matches_truth(out, inputs, case.case_id)
    return out[index]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("features", [{}, {"sliding_window": 200, "sinks": True}],
                         ids=["plain", "window-sinks"])
def test_split_decode_batch_invariant_rows_are_bitwise_equal(dtype, features):
    batches = [((PROBE_LEN,), 0), ((5, PROBE_LEN), 1), ((PROBE_LEN, 300, 1), 0)]
    rows = [_probe_rows(_batch(lens, dtype, **features), index) for lens, index in batches]
    for (lens, _), row in zip(batches[1:], rows[1:]):
        assert torch.equal(row, rows[0]), f"probe differs in batch {lens}"
    balanced = {plan_splits(lens, 1, 64, 4 if dtype == "float32" else 2,
                            features.get("sliding_window")).num_splits
                for lens, _ in batches}
    assert len(balanced) > 1, "the balanced mode should plan these batches differently"
