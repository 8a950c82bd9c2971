"""Shared blocks as a case property (``PagedCase.shared_blocks``): the tables share exactly
the blocks the case names (prefix caching, beam forks, chains), the logical K/V and the
truth are those of the same problem with every block its own (``unshare_blocks``), and an
implementation that declares it cannot take them gets ``unsupported`` with the reason."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedbench.adapters.base import Capabilities
from pagedbench.harness.cases.strategies import paged_cases
from pagedbench.reference import PagedCase, gather_kv, materialize, reference_attention
from pagedbench.reference.inputs import unshare_blocks

BS = 4


def _case(kv_lens, shared, **fields) -> PagedCase:
    return PagedCase(kv_lens=kv_lens, num_q_heads=2, num_kv_heads=1, head_dim=8,
                     block_size=BS, dtype="float32", shared_blocks=shared, **fields)


def _used(inputs) -> list[list[int]]:
    """Each sequence's table entries that hold its tokens."""
    return [row[:n] for row, n in zip(inputs.block_tables.tolist(),
                                      inputs.case.blocks_per_seq)]


@pytest.mark.parametrize("kv_lens, shared, owners", [
    # prefix caching: two later prompts hit the first one's two blocks
    ((11, 13, 9), (0, 2, 2), {0: 3, 1: 3}),
    # a beam fork: all but the last block shared
    ((13, 14, 15), (0, 3, 3), {0: 3, 1: 3, 2: 3}),
    # a chain that shares less further on: sequence 2 shares block 0 with 0 and 1
    ((13, 14, 15), (0, 3, 1), {0: 3, 1: 2, 2: 2}),
    # two groups: sequence 2 starts a prompt of its own that sequence 3 shares
    ((9, 10, 9, 12), (0, 2, 0, 2), {0: 2, 1: 2}),
])
def test_tables_share_exactly_the_named_blocks(kv_lens, shared, owners) -> None:
    """``owners``: how many tables hold sequence 0's logical block j (for the first
    group); every other block is in exactly one table, and the pool holds no block twice
    otherwise."""
    inputs = materialize(_case(kv_lens, shared))
    tables = _used(inputs)
    counts = Counter(b for row in tables for b in row)
    for j, n in owners.items():
        assert counts[tables[0][j]] == n, (j, tables)
    for i in range(1, len(tables)):
        assert tables[i][: shared[i]] == tables[i - 1][: shared[i]]
    # Distinct blocks: what the sequences need, a shared one once (so no two tables hold
    # a block in common but the ones named).
    assert len(counts) == sum(inputs.case.blocks_per_seq) - sum(shared)


def test_forks_past_the_16_bit_block_ids_share_them() -> None:
    """min_block_id 32766 and 65534: the shared blocks themselves lie past 32767 and
    65535 (not only the unshared ones)."""
    for low, edge in ((32766, 32767), (65534, 65535)):
        inputs = materialize(_case((13, 14), (0, 3), min_block_id=low))
        tables = _used(inputs)
        assert tables[0][:3] == tables[1][:3]
        assert min(tables[0][:3]) >= low and max(tables[0][:3]) >= edge, tables


@settings(max_examples=40, deadline=None)
@given(paged_cases(max_batch=4, max_kv_len=40, max_kv_heads=1, dtypes=("float32",)),
       st.integers(1, 3))
def test_sharing_changes_no_logical_value_and_no_truth(case, share) -> None:
    """Sequence i's logical K/V and the float64 truth are those of the same tensors with
    every shared block copied to a block of its own; the shared positions hold the first
    owner's K/V."""
    most = [0] + [min(a, b) // case.block_size for a, b in zip(case.kv_lens, case.kv_lens[1:])]
    case = case.with_(shared_blocks=tuple(min(share, m) for m in most))
    inputs = materialize(case)
    unshared = unshare_blocks(inputs)
    assert unshared.case.shared_blocks is None
    unshared.check_values()
    used = [b for row in _used(unshared) for b in row]
    assert len(used) == len(set(used)), "unshare_blocks left a block in two tables"
    for (k, v), (k2, v2) in zip(gather_kv(inputs), gather_kv(unshared)):
        assert torch.equal(k, k2) and torch.equal(v, v2)
    kv = gather_kv(inputs)
    for i in range(1, case.batch_size):
        n = (case.shared_blocks or (0,) * case.batch_size)[i] * case.block_size
        assert torch.equal(kv[i][0][:n], kv[i - 1][0][:n])
    assert torch.equal(reference_attention(inputs), reference_attention(unshared))


def test_sharing_keeps_the_other_values_of_the_unshared_case() -> None:
    """A sequence's unshared tokens have the values the same seed gives without sharing
    (its draws for the shared tokens are discarded), and sequence 0 is untouched."""
    case = _case((11, 13, 9), (0, 2, 2))
    shared = gather_kv(materialize(case))
    plain = gather_kv(materialize(case.with_(shared_blocks=None)))
    assert torch.equal(shared[0][0], plain[0][0])
    for i in (1, 2):
        assert torch.equal(shared[i][0][2 * BS:], plain[i][0][2 * BS:])
        assert not torch.equal(shared[i][0][: 2 * BS], plain[i][0][: 2 * BS])


def test_all_zero_sharing_is_no_sharing() -> None:
    case = _case((11, 13), (0, 0))
    assert case.shared_blocks is None and "share" not in case.case_id
    assert PagedCase.from_dict(_case((11, 13), (0, 2)).to_dict()).shared_blocks == (0, 2)
    assert _case((11, 13), (0, 2)).case_id.endswith("share0.2")


@pytest.mark.parametrize("kv_lens, shared, message", [
    ((11, 13), (0, 3), r"shared_blocks\[1\]=3: only full blocks are shared.*allowed: 0..2"),
    ((11, 3), (0, 1), r"shared_blocks\[1\]=1.*allowed: 0..0"),
    ((11, 13), (0, -1), r"shared_blocks\[1\]"),
])
def test_sharing_more_than_the_full_blocks_in_common_is_refused(kv_lens, shared, message) -> None:
    with pytest.raises(ValueError, match=message):
        _case(kv_lens, shared)


def test_an_implementation_that_cannot_share_declares_it() -> None:
    caps = Capabilities(devices=frozenset({"cpu"}), dtypes=frozenset({"float32"}),
                        shared_blocks=False, notes={"shared_blocks": "keys scratch by block id"})
    reasons = caps.why_unsupported(_case((11, 13), (0, 2)), "cpu")
    assert reasons == ["shared blocks [0, 2] not supported (block tables that point to the "
                       "same physical block) (keys scratch by block id)"]
    assert caps.why_unsupported(_case((11, 13), None), "cpu") == []
    assert caps.to_dict()["shared_blocks"] is False


@settings(max_examples=60, deadline=None, database=None)
@given(st.data())
def test_the_search_draws_sharing_only_where_declared(data) -> None:
    caps = Capabilities(devices=frozenset({"cpu"}), dtypes=frozenset({"float32"}),
                        shared_blocks=False, modes=frozenset({"decode", "prefill"}))
    assert data.draw(paged_cases(caps, max_batch=4)).shared_blocks is None


def test_the_search_draws_sharing() -> None:
    """Some of the everyday box's cases share blocks (a fixed seed: not a flaky count)."""
    found = []

    @settings(max_examples=150, deadline=None, database=None, derandomize=True)
    @given(paged_cases(max_batch=4, max_kv_len=100))
    def draw(case):
        found.append(case.shared_blocks is not None)

    draw()
    assert sum(found) >= 5, sum(found)
