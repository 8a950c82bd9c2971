"""Pinned probes at the edges of the input space, for every implementation: degenerate rows,
high block ids and every poison, more than 64 blocks, the logit range, sliding windows of 1,
2 and block_size +- 1 on decode rows and on prefill rows beside them, the features with
decode-only shortcuts (sinks, ALiBi, soft cap, fp8 scales) on prefill rows, each at GQA
ratio 1 and 2, shared blocks, non-contiguous layouts, unusual shapes, and the metamorphic
properties (batch invariance, un-sharing blocks, q = 0, a single visible key); long 16-bit
contexts and the split thresholds are in ``test_pinned_probes``. Random search rarely lands
on these, so each is placed. A probe an implementation does not declare (a feature, a
layout, a shape, its interpreter budget) is skipped with the ``unsupported`` reason, never
failed. Implementations that run interpreted or compile per shape get only the :data:`CORE`
probes in the ``ci`` profile (seconds to minutes per case), every probe and property in the
others. A peer's probes are held to ``suites/peer_findings.py`` for its build and ISA path
(known faults are strict xfails there; docs/findings.md). Run one implementation: ``pytest
suites/conformance/test_edges.py --impl NAME``.
"""

from __future__ import annotations

import contextlib
from dataclasses import replace

import pytest
import torch
from hypothesis import settings

from pagedbench.harness.run import replay
from pagedbench.harness.verdict import tolerance
from pagedbench.harness.verdict.conformance import inputs_for
from pagedbench.reference import naive_attention
from pagedbench.reference.axes import LAYOUTS, POISONS
from pagedbench.reference.inputs import unshare_blocks
from pagedbench.suites import peer_findings

from .cases import pinned_case
from .conftest import DEVICE

#: Shared blocks: a common prompt prefix (prefix caching), a beam-search fork
#: sharing all but its last block, many sequences on one shared prompt, and forks placed
#: past the block ids where 16-bit table entries wrap; on decode rows, and with prefill
#: rows on the shared prompt.
SHARED_PROBES = {
    "shared-prefix": (lambda bs: (2 * bs + 3, 3 * bs + 1, 2 * bs + 5), 4, 2,
                      {"shared_blocks": (0, 2, 2)}),
    "shared-fork": (lambda bs: (3 * bs + 2, 3 * bs + 5, 3 * bs + 1), 4, 2,
                    {"shared_blocks": (0, 3, 3)}),
    "shared-fork-mha": (lambda bs: (3 * bs + 2, 3 * bs + 5, 3 * bs + 1), 2, 2,
                        {"shared_blocks": (0, 3, 3)}),
    "shared-prompt-6": (lambda bs: tuple(2 * bs + k for k in range(1, 7)), 4, 2,
                        {"shared_blocks": (0, 2, 2, 2, 2, 2)}),
    "shared-prefix-prefill": (lambda bs: (2 * bs + 3, 3 * bs + 1, 2 * bs + 5), 4, 2,
                              {"shared_blocks": (0, 2, 2), "q_lens": (1, 5, 3)}),
    "shared-block-id-32767": (lambda bs: (3 * bs + 1, 3 * bs + 2), 2, 1,
                              {"shared_blocks": (0, 3), "min_block_id": 32766}),
    "shared-block-id-65535": (lambda bs: (3 * bs + 1, 3 * bs + 2), 2, 1,
                              {"shared_blocks": (0, 3), "min_block_id": 65534}),
}

#: name -> (kv_lens(block_size), num_q_heads, num_kv_heads, other fields). Lengths and
#: fields may depend on the block size the implementation takes (callables of it).
PROBES = {
    # Degenerate rows (serving engines pad CUDA-graph batches with them): output 0.
    "empty-kv": (lambda bs: (0, bs + 1, 0, 3), 4, 2, {}),
    "empty-q": (lambda bs: (bs + 1, 5, 2 * bs), 4, 2, {"q_lens": (0, 3, 0)}),
    "unseen-rows": (lambda bs: (3, bs + 1), 4, 2, {"q_lens": (7, 2)}),
    "all-degenerate": (lambda bs: (0, 5, 3, 0), 4, 2, {"q_lens": (2, 0, 6, 0)}),
    # Blocks placed past the ids where a 16-bit table entry wraps, with a poison each.
    "block-id-32767": (lambda bs: (3 * bs + 1, 2), 2, 1,
                       {"min_block_id": 32766, "poison": "inf"}),
    "block-id-65535": (lambda bs: (3 * bs + 1, 2), 2, 1,
                       {"min_block_id": 65534, "poison": "-inf"}),
    **SHARED_PROBES,
    **{f"poison-{p}": (lambda bs: (bs + 1, 2 * bs - 1, 3), 4, 2, {"poison": p})
       for p in POISONS},
    # More than 64 blocks per sequence (long 16-bit contexts and the split thresholds:
    # test_pinned_probes).
    "many-blocks": (lambda bs: (65 * bs + 1,), 4, 2, {}),
    # The logit range (offsets of +-1e4: past that float32 logits decide more than the
    # kernel does; see MAX_LOGIT_OFFSET).
    "sm-scale-1e-3": (lambda bs: (bs + 1, 2 * bs + 3), 4, 2, {"sm_scale": 1e-3}),
    "sm-scale-1e3": (lambda bs: (bs + 1, 2 * bs + 3), 4, 2, {"sm_scale": 1e3}),
    "logits-far-from-0": (lambda bs: (bs + 1, 2 * bs + 3), 4, 2, {"qk_magnitude": 300.0}),
    # float32 logits of +-100..300: the channel sums' order decides more than the output
    # rounding there, so a correct kernel whose sums run in another order than the
    # yardstick's must still pass (reference/yardstick.py).
    "fp32-logits-far-from-0": (lambda bs: (bs + 1, 2 * bs + 3), 4, 2,
                               {"qk_magnitude": 10.0, "dtype": "float32"}),
    "offset+1e4": (lambda bs: (bs + 1, 2 * bs + 3), 4, 2, {"logit_offset": 1e4}),
    "offset-1e4": (lambda bs: (bs + 1, 2 * bs + 3), 4, 2, {"logit_offset": -1e4}),
    "soft-cap-below-logits": (lambda bs: (bs + 1, 2 * bs + 3), 4, 2,
                              {"logits_soft_cap": 0.05, "qk_magnitude": 30.0}),
    "soft-cap-above-logits": (lambda bs: (bs + 1, 2 * bs + 3), 4, 2,
                              {"logits_soft_cap": 1e4}),
    "fp16-near-65504": (lambda bs: (bs + 1, 2 * bs + 3), 4, 2,
                        {"dtype": "float16", "v_magnitude": 2e4}),
    **{f"window-{name}": (lambda bs: (3 * bs + 2, bs + 1), 4, 2,
                          {"sliding_window": window, "qk_magnitude": 30.0,
                           "logit_offset": -1e4})
       for name, window in (("1", 1), ("2", 2), ("bs-1", lambda bs: max(1, bs - 1)),
                            ("bs+1", lambda bs: bs + 1))},
    # Non-contiguous inputs.
    **{f"layout-{layout}": (lambda bs: (bs + 1, 2 * bs + 3), 4, 2, {"layout": layout})
       for layout in LAYOUTS if layout != "contiguous"},
    # Shapes.
    "head-dim-112": (lambda bs: (bs + 1, 3), 4, 2, {"head_dim": 112}),
    "head-dim-192": (lambda bs: (bs + 1, 3), 4, 2, {"head_dim": 192}),
    "head-dim-odd-33": (lambda bs: (bs + 1, 3), 4, 2, {"head_dim": 33}),
    **{f"gqa-{ratio}": (lambda bs: (bs + 1, 2 * bs - 1), ratio, 1, {})
       for ratio in (3, 6, 7, 16)},
    "block-size-512": (lambda bs: (513, 7), 4, 2, {"block_size": 512}),
    "block-size-48": (lambda bs: (49, 95, 3), 4, 2, {"block_size": 48}),
    "block-size-80": (lambda bs: (81, 159, 3), 4, 2, {"block_size": 80}),
    "batch-7": (lambda bs: (1, bs - 1 or 2, bs, bs + 1, 2 * bs + 3, 3, 5 * bs - 1), 4, 2, {}),
    "batch-13": (lambda bs: tuple(range(1, 4 * 13, 4)), 2, 1, {}),
    "mla-576-512": (lambda bs: (bs + 3, 2 * bs), 16, 1,
                    {"head_dim": 576, "head_dim_v": 512, "dtype": "bfloat16"}),
}

#: Heads of the probes run once per GQA path: real decode kernels take one code path for
#: ratio 1 (an elementwise product and sum) and another for ratio > 1 (a matrix product).
HEADS = {"mha": (2, 2), "gqa": (4, 2)}
#: The logit-range probes above (all at ratio 2), again at ratio 1.
LOGIT_RANGE = ("sm-scale-1e-3", "sm-scale-1e3", "logits-far-from-0", "fp32-logits-far-from-0",
               "offset+1e4", "offset-1e4", "soft-cap-below-logits", "soft-cap-above-logits",
               "fp16-near-65504", "window-1", "window-2", "window-bs-1", "window-bs+1")
PROBES |= {f"{name}-mha": (PROBES[name][0], *HEADS["mha"], PROBES[name][3])
           for name in LOGIT_RANGE}

#: Sliding windows on prefill rows beside decode rows: lengths of the decode
#: row, a chunk of block_size + 1 rows and a whole prompt of 2 * block_size, so that
#: every window starts and ends on a block boundary for some row; 1, 2, block_size +- 1
#: and 2 * block_size (the decode row of kv_len 3 * block_size then sees exactly blocks
#: 1 and 2, block 0 all masked), with logits near 0 and far below it (an all-masked
#: tile's running max is -inf there, not a number near the logits).
WINDOWS = (("1", 1), ("2", 2), ("bs-1", lambda bs: max(1, bs - 1)), ("bs+1", lambda bs: bs + 1),
           ("2bs", lambda bs: 2 * bs))
LOGITS = {"near0": {}, "below0": {"qk_magnitude": 30.0, "logit_offset": -1e4}}
PROMPT_ROWS = {"q_lens": lambda bs: (1, bs + 1, 2 * bs)}
PROBES |= {
    f"prefill-window-{name}-{logits}-{heads}": (
        lambda bs: (3 * bs, 4 * bs + 1, 2 * bs), *HEADS[heads],
        {**PROMPT_ROWS, "sliding_window": window, **LOGITS[logits]})
    for name, window in WINDOWS for logits in LOGITS for heads in HEADS}

#: Features with a decode-only shortcut in real kernels, on decode rows alone and on
#: prefill rows beside decode rows, at each GQA path.
FEATURE_FIELDS = {
    "sinks": {"sinks": True},
    "alibi": {"alibi": True},
    "soft-cap": {"logits_soft_cap": 5.0, "qk_magnitude": 3.0},
    "fp8-e4m3": {"kv_cache_dtype": "fp8_e4m3", "k_scale": 0.5, "v_scale": 0.25},
    "fp8-e5m2": {"kv_cache_dtype": "fp8_e5m2", "k_scale": 2.0, "v_scale": 0.25},
}
PROBES |= {
    f"{feature}-{mode}-{heads}": (
        lambda bs: (bs + 3, 2 * bs + 1, 5), *HEADS[heads],
        {**fields, **({"q_lens": lambda bs: (1, bs + 1, 5)} if mode == "prefill" else {})})
    for feature, fields in FEATURE_FIELDS.items() for mode in ("decode", "prefill")
    for heads in HEADS}

#: The order tests run in (what ``pagedbench selftest --first-catch`` stops at first): the
#: degenerate rows, the block ids, shared blocks and one window on prefill rows first.
_FIRST = [*list(PROBES)[: list(PROBES).index("shared-block-id-65535") + 1],
          "prefill-window-1-near0-mha"]
PROBES = {name: PROBES[name] for name in _FIRST} | PROBES

#: The probes every implementation gets in every profile: one per kind of edge.
CORE = ("empty-kv", "empty-q", "unseen-rows", "block-id-65535", "offset-1e4", "window-1",
        "layout-every_other_block", "fp32-logits-far-from-0", "prefill-window-2bs-below0-mha",
        "shared-fork")


@pytest.mark.parametrize("probe", list(PROBES))
def test_edge_probe_matches_dense(adapter, impl, probe, request) -> None:
    """Each probe against the truth; for a peer, held to what ``suites/peer_findings.py``
    expects of its build and ISA path (a known fault there is a strict xfail; a deviation
    on a combination the table does not name, a non-strict xfail recorded under build/)."""
    if probe not in CORE:
        _skip_if_slow_in_ci(adapter)
    kv_lens, num_q_heads, num_kv_heads, fields = PROBES[probe]
    case = pinned_case(adapter, kv_lens, num_q_heads, num_kv_heads, probe, **fields)
    peer_findings.check_conformance(adapter, case, DEVICE, impl, probe, request.config.rootpath)


def _skip_if_slow_in_ci(adapter) -> None:
    """Skip unless the ``ci`` profile is off or ``adapter`` runs compiled once (not
    interpreted, not compiled per shape): seconds to minutes per case otherwise."""
    slow = adapter.is_interpreted(DEVICE) or adapter.compiles_per_shape
    if slow and settings.get_current_profile_name() == "ci":
        pytest.skip(f"{adapter.name} runs interpreted or compiles per shape: core probes "
                    "only in the ci profile")


@contextlib.contextmanager
def _replay_hint(case, impl: str):
    """Append the replay command of ``case`` (:func:`replay.hint`) to an assertion's
    message, as every conformance failure ends."""
    try:
        yield
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{replay.hint(case, impl)}") from exc


def test_batch_invariance(adapter, impl) -> None:
    """A sequence's output does not change when others join its batch: bit for bit for
    an implementation that declares ``batch_invariant``, within the tolerance of its own
    truth for the others."""
    _skip_if_slow_in_ci(adapter)
    case = pinned_case(adapter, lambda bs: (2 * bs + 5, 7 * bs + 1, 1, 3 * bs), 4, 2,
                       "batch-invariance")
    batched_inputs = inputs_for(adapter, case, DEVICE)
    alone_inputs = _first_sequence(batched_inputs)
    batched = adapter.run(adapter.prepare(batched_inputs))[: alone_inputs.case.total_q]
    single = adapter.run(adapter.prepare(alone_inputs))
    with _replay_hint(case, impl):
        if adapter.capabilities(DEVICE).batch_invariant:
            assert torch.equal(batched, single), (
                f"{adapter.name} declares batch_invariant but sequence 0 changes when "
                f"others join (max diff {(batched.double() - single.double()).abs().max():.3g})")
        tolerance.assert_matches_truth(batched, alone_inputs.to("cpu"),
                                       f"{adapter.name}:batched")


def test_unsharing_blocks_changes_no_bit(adapter, impl) -> None:
    """Copying every shared block to a fresh block id (``unshare_blocks``: the same
    logical K/V, no table entry repeated) changes no output bit of an implementation
    that declares ``batch_invariant`` (nothing it computes for a sequence depends on
    where its blocks lie or who else holds them); for the others both outputs are
    judged against the truth."""
    _skip_if_slow_in_ci(adapter)
    case = pinned_case(adapter, lambda bs: (3 * bs + 2, 3 * bs + 5, 2 * bs + 1, 3), 4, 2,
                       "unshare", shared_blocks=(0, 3, 2, 0))
    shared_inputs = inputs_for(adapter, case, DEVICE)
    unshared_inputs = unshare_blocks(shared_inputs)
    shared = adapter.run(adapter.prepare(shared_inputs))
    unshared = adapter.run(adapter.prepare(unshared_inputs))
    with _replay_hint(case, impl):
        if adapter.capabilities(DEVICE).batch_invariant:
            assert torch.equal(shared, unshared), (
                f"{adapter.name} declares batch_invariant but un-sharing the blocks changes "
                f"its output (max diff {(shared.double() - unshared.double()).abs().max():.3g})")
        tolerance.assert_matches_truth(shared, shared_inputs.to("cpu"), f"{adapter.name}:shared")
        tolerance.assert_matches_truth(unshared, unshared_inputs.to("cpu"),
                                       f"{adapter.name}:unshared")


def _first_sequence(inputs):
    """The same tensors with only sequence 0 left in the batch (its rows of ``q``, its
    table row; the cache, the other sequences' blocks included, untouched)."""
    case = inputs.case
    alone = case.with_(kv_lens=case.kv_lens[:1],
                       q_lens=None if case.q_lens is None else case.q_lens[:1],
                       num_blocks=inputs.kv_cache.shape[0])
    rows, kv_len = alone.total_q, alone.kv_lens[0]
    return replace(inputs, case=alone, q=inputs.q[:rows],
                   block_tables=inputs.block_tables[:1, : alone.max_blocks_per_seq],
                   kv_lens=inputs.kv_lens[:1], cu_seqlens_q=inputs.cu_seqlens_q[:2],
                   slot_mapping=inputs.slot_mapping[:kv_len])


def _visible_positions(q_len: int, kv_len: int, row: int, window: int | None) -> list[int]:
    """Key positions query ``row`` of a sequence sees (bottom-right causal, window)."""
    pos = kv_len - q_len + row
    return [t for t in range(kv_len) if t <= pos and (window is None or t > pos - window)]


def _values_by_slot(inputs) -> list[torch.Tensor]:
    """Each sequence's V rows ``[kv_len, num_kv_heads, v_head_dim]`` float64, read through
    ``slot_mapping`` (not the block tables the implementation reads)."""
    case, bs, dv = inputs.case, inputs.case.block_size, inputs.case.v_head_dim
    cache = inputs.kv_cache.cpu()
    slots, out, start = inputs.slot_mapping.cpu(), [], 0
    for kv_len in case.kv_lens:
        s = slots[start : start + kv_len]
        out.append(cache[s // bs, 1, s % bs, :, :dv].double())  # [kv_len, hkv, dv]
        start += kv_len
    return out


def _expected_from_rows(inputs, keys_of) -> tolerance.Expected:
    """The truth built from V rows alone: row ``j`` of sequence ``i`` is the mean of the V
    rows ``keys_of(i, q_len, kv_len, j)`` (0 for none), beside the naive yardstick."""
    case = inputs.case
    values, cu = _values_by_slot(inputs), inputs.cu_seqlens_q.tolist()
    ratio = case.gqa_ratio
    truth = torch.zeros(case.total_q, case.num_q_heads, case.v_head_dim, dtype=torch.float64)
    for i, kv_len in enumerate(case.kv_lens):
        q_len = cu[i + 1] - cu[i]
        for j in range(q_len):
            keys = keys_of(q_len, kv_len, j)
            if keys:
                mean = values[i][keys].mean(dim=0)  # [hkv, dv]
                truth[cu[i] + j] = mean.repeat_interleave(ratio, dim=0)
    return tolerance.Expected(truth, naive_attention(inputs.to("cpu")))


def test_zero_query_gives_the_mean_of_the_visible_values(adapter, impl) -> None:
    """q = 0 makes every visible logit 0: each row is the plain mean of the V rows it
    sees (causal rows see a growing prefix)."""
    _skip_if_slow_in_ci(adapter)
    prefill = "prefill" in adapter.capabilities(DEVICE).modes
    case = pinned_case(adapter, lambda bs: (bs + 3, 2 * bs, 1), 4, 2, "zero-q",
                       q_lens=(3, 2, 1) if prefill else None)
    inputs = inputs_for(adapter, case, DEVICE)
    inputs.q.zero_()
    out = adapter.run(adapter.prepare(inputs))
    expected = _expected_from_rows(
        inputs, lambda q_len, kv_len, j: _visible_positions(q_len, kv_len, j, None))
    with _replay_hint(case, impl):
        tolerance.assert_close_report(out, expected, case.dtype,
                                      f"{adapter.name}:{case.case_id}", inputs.cu_seqlens_q.cpu())


def test_single_visible_key_gives_its_value(adapter, impl) -> None:
    """A row that sees one key outputs that key's V: sliding window 1 (every row sees
    only its own position) where declared, else sequences of one token."""
    _skip_if_slow_in_ci(adapter)
    window = "sliding_window" in adapter.capabilities(DEVICE).features
    case = pinned_case(adapter, (lambda bs: (1, bs + 1, 2 * bs)) if window else
                       (lambda bs: (1, 1, 1)), 4, 2, "one-key",
                       sliding_window=1 if window else None)
    inputs = inputs_for(adapter, case, DEVICE)
    out = adapter.run(adapter.prepare(inputs))
    expected = _expected_from_rows(inputs, lambda q_len, kv_len, j: [kv_len - q_len + j])
    with _replay_hint(case, impl):
        tolerance.assert_close_report(out, expected, case.dtype,
                                      f"{adapter.name}:{case.case_id}", inputs.cu_seqlens_q.cpu())
