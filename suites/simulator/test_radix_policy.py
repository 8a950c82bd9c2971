"""RadixAttention in the capacity simulator: the prefix tree by hand, the ``Radix`` policy
on a worked conversation, against block-hash prefix caching where the two must agree,
the traces that share prefixes, and ``pagedbench simulate --trace-kind``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedbench.harness.capacity.prefix_traces import TRACE_KINDS
from pagedbench.harness.capacity.traces import read_trace
from pagedbench.harness.cli import main
from pagedbench.reference.kv_policies import Policy
from pagedbench.reference.radix_tree import RadixTree
from pagedbench.reference.simulator import simulate
from pagedbench.reference.workload import Request, TraceError, validate_trace


def test_tree_matches_splits_and_counts_by_hand() -> None:
    tree = RadixTree(page_size=1)
    assert tree.insert([1, 2, 3, 4]) == 0 and tree.evictable_tokens == 4
    assert tree.insert([1, 2, 9]) == 2  # shares [1, 2]: the node is split there
    assert tree.total_tokens == 5
    hit, node = tree.match([1, 2, 3, 7])
    assert hit == 3 and node.key == (3,)
    assert tree.match([1, 2, 3, 4], limit=3)[0] == 3
    tree.lock(node)  # [1, 2] and [3] protected
    assert (tree.protected_tokens, tree.evictable_tokens) == (3, 2)
    tree.check()
    paged = RadixTree(page_size=2)
    paged.insert([1, 2, 3, 4, 5])  # the partial page is not cached
    assert paged.total_tokens == 4
    assert paged.match([1, 2, 3, 9])[0] == 2 and paged.match([1, 2, 3, 4])[0] == 4


def test_tree_evicts_least_recently_used_unlocked_leaves() -> None:
    tree = RadixTree()
    tree.insert([1, 1])
    tree.insert([2, 2])
    tree.insert([3, 3])
    tree.match([1, 1])  # [2, 2] is now the least recently used
    _, locked = tree.match([3, 3])
    tree.lock(locked)
    assert tree.evict(1) == 2  # a whole leaf
    assert tree.match([2, 2])[0] == 0 and tree.match([1, 1])[0] == 2
    assert tree.evict(10) == 2  # [1, 1]; the locked leaf stays
    assert tree.total_tokens == 2 and tree.match([3, 3])[0] == 2
    tree.unlock(locked)
    assert tree.evict(1) == 2 and tree.total_tokens == 0
    tree.check()


#: A conversation by hand: turn 1 has a 4-token prompt and 3 output tokens (7 in all);
#: turn 2's prompt is those 7 and 2 new tokens (9), 2 output tokens.
CONVERSATION = [Request(4, 3), Request(9, 2, parent=0)]


@pytest.mark.parametrize(("policy", "block_size", "hit"), [
    ("Radix", 1, 7),  # the whole history: every token but the new ones
    ("Radix", 4, 4),  # whole pages of it
    ("Paged+share", 4, 4),  # one full block; the partial one is not cached
    ("Paged+share", 1, 7),
])
def test_conversation_reuses_its_history_by_hand(policy, block_size, hit) -> None:
    result = simulate(CONVERSATION, Policy(policy, block_size), kv_budget_tokens=64,
                      max_context=16)
    assert result.prefix_hit_tokens == hit
    assert result.prefill_tokens == 4 + 9 - hit
    # Turn 2 arrives the step after turn 1 finished (its 3 decode steps: steps 1-3).
    assert result.steps == 4 + 3


@settings(max_examples=8, deadline=None)
@given(kind=st.sampled_from(["multi-turn", "agent", "few-shot"]), seed=st.integers(0, 99),
       page=st.sampled_from([1, 4, 16]))
def test_tree_and_blocks_agree_on_an_ample_budget(kind, seed, page) -> None:
    """With room for everything (nothing evicted or preempted), the radix tree at page
    size p and block-hash caching at block size p cache the same whole pages of the same
    sequences, so they hit and compute the same tokens: two independent models."""
    trace = TRACE_KINDS[kind](8, 256, seed)
    tree = simulate(trace, Policy("Radix", page), 1 << 12, 256)
    blocks = simulate(trace, Policy("Paged+share", page), 1 << 12, 256)
    assert tree.preemptions == blocks.preemptions == 0
    assert (tree.prefix_hit_tokens, tree.prefill_tokens, tree.steps) == (
        blocks.prefix_hit_tokens, blocks.prefill_tokens, blocks.steps)
    if page == 1:
        at_16 = simulate(trace, Policy("Paged+share", 16), 1 << 12, 256)
        assert tree.prefix_hit_tokens >= at_16.prefix_hit_tokens


@pytest.mark.parametrize("kind", ["multi-turn", "agent", "few-shot"])
def test_generated_traces_share_and_fit(kind) -> None:
    trace = TRACE_KINDS[kind](60, 512, 3)
    assert trace == TRACE_KINDS[kind](60, 512, 3) and len(trace) == 60
    validate_trace(trace, 512)  # parents first, each prompt outgrowing its parent
    assert any(r.prefix_id is not None for r in trace)
    if kind != "few-shot":
        assert sum(r.parent is not None for r in trace) > len(trace) // 2


def test_trace_files_carry_parents(tmp_path: Path) -> None:
    path = tmp_path / "chat.csv"
    path.write_text("prompt_len,output_len,parent\n4,3,\n9,2,0\n")
    assert read_trace(path, 16) == CONVERSATION
    path.write_text("prompt_len,output_len,parent\n4,3,\n7,2,0\n")
    with pytest.raises(TraceError, match=r"chat.csv:3: .*must exceed its parent 0's"):
        read_trace(path, 16)
    path.write_text("prompt_len,output_len,parent\n4,3,1\n9,2,\n")
    with pytest.raises(TraceError, match="parent 1 is not an earlier request"):
        read_trace(path, 16)


def test_simulate_json_has_a_radix_row_hitting_at_least_block_16(tmp_path: Path,
                                                                 capsys) -> None:
    code = main(["simulate", "--trace-kind", "multi-turn", "--num-requests", "16",
                 "--block-sizes", "16", "--output-dir", str(tmp_path), "--json"])
    assert code == 0
    rows = {(r["policy"], r["block_size"]): r for r in json.loads(capsys.readouterr().out)}
    radix = rows["Radix", 1]
    assert radix["prefix_hit_tokens"] >= rows["Paged+share", 16]["prefix_hit_tokens"] > 0
    assert radix["prefill_tokens"] <= rows["Paged+share", 16]["prefill_tokens"]


def test_simulate_refuses_mixed_only_options_with_a_trace_kind(tmp_path: Path, capsys) -> None:
    code = main(["simulate", "--trace-kind", "agent", "--prefix-share", "0.5",
                 "--output-dir", str(tmp_path)])
    assert code == 2
    assert "shape(s) the mixed trace only" in capsys.readouterr().err
