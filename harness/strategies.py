"""Hypothesis strategies for paged-attention cases (imported by the test suites only).

The axes and the values drawn from them follow the peers' own test grids: block sizes 1
to 256 including a non-power of two (48: vLLM's ``tests/kernels/attention/test_cpu_attn.py``;
FlashInfer's ``tests/attention/test_batch_prefill_kernels.py`` uses 1, 5 and 16), GQA
ratios including 5 (Llama 4's 40 query over 8 KV heads; FlashInfer's
``tests/attention/test_trtllm_gen_attention_decode.py``), head dims 64/80/96/128, and
ragged batches whose lengths always include the block boundaries 1, block_size - 1,
block_size and block_size + 1 where paged kernels break. Drawn values are restricted to
what the implementation under test declares, so no example is wasted on an unsupported
case.
"""

from __future__ import annotations

from hypothesis import strategies as st

from pagedbench.adapters.base import FEATURES, Capabilities, allows
from pagedbench.reference import PagedCase
from pagedbench.reference.case import KV_CACHE_DTYPES

BLOCK_SIZES = (1, 2, 8, 16, 32, 48, 64, 128, 256)
GQA_RATIOS = (1, 2, 4, 5, 8)
HEAD_DIMS = (64, 80, 96, 128)
DTYPES = ("float32", "float16", "bfloat16")


def _allowed(values: tuple[int, ...], allowed: frozenset | None) -> list[int]:
    return [v for v in values if allows(allowed, v)]


@st.composite
def paged_cases(
    draw: st.DrawFn,
    capabilities: Capabilities | None = None,
    *,
    max_batch: int = 4,
    max_kv_len: int = 300,
    max_kv_heads: int = 2,
    dtypes: tuple[str, ...] = DTYPES,
) -> PagedCase:
    """A random :class:`PagedCase` within ``capabilities`` (all axes when ``None``).

    ``sm_scale`` is the default or an explicit value. Lengths per sequence are drawn
    from ``{1, block_size - 1, block_size, block_size + 1, uniform(1, max_kv_len)}``; prefill (q_len > 1), the optional features
    and fp8 KV caches (with non-unit scales, as vLLM's tests use) appear only when the
    capabilities declare them.

    Raises
    ------
    ValueError
        If the capabilities leave no value on some axis (nothing to draw).
    """
    caps = capabilities
    block_sizes = _allowed(BLOCK_SIZES, caps.block_sizes if caps else None)
    ratios = _allowed(GQA_RATIOS, caps.gqa_ratios if caps else None)
    head_dims = _allowed(HEAD_DIMS, caps.head_dims if caps else None)
    dtype_choices = [d for d in dtypes if caps is None or d in caps.dtypes]
    for axis, values in (("block_size", block_sizes), ("gqa ratio", ratios),
                         ("head_dim", head_dims), ("dtype", dtype_choices)):
        if not values:
            raise ValueError(f"capabilities leave no {axis} to draw from")
    block_size = draw(st.sampled_from(block_sizes))
    num_kv_heads = draw(st.integers(1, max_kv_heads))
    ratio = draw(st.sampled_from(ratios))
    batch = draw(st.integers(1, max_batch))
    boundary = [n for n in (1, block_size - 1, block_size, block_size + 1) if 1 <= n <= max_kv_len]
    length = st.one_of(st.sampled_from(boundary), st.integers(1, max_kv_len))
    kv_lens = tuple(draw(st.lists(length, min_size=batch, max_size=batch)))

    modes = caps.modes if caps else frozenset({"decode", "prefill"})
    q_lens = None
    if "prefill" in modes and draw(st.booleans()):
        q_lens = tuple(draw(st.integers(1, min(kv, 16))) for kv in kv_lens)
    features = caps.features if caps else FEATURES
    sliding_window = None
    if "sliding_window" in features and draw(st.booleans()):
        sliding_window = draw(st.integers(1, max_kv_len))
    soft_cap = None
    if "logits_soft_cap" in features and draw(st.booleans()):
        soft_cap = draw(st.sampled_from((5.0, 30.0, 50.0)))
    alibi = "alibi" in features and draw(st.booleans())
    sinks = "sinks" in features and draw(st.booleans())
    kv_cache_dtypes = sorted(caps.kv_cache_dtypes if caps else KV_CACHE_DTYPES)
    kv_cache_dtype = draw(st.sampled_from(kv_cache_dtypes))
    scales = {}
    if kv_cache_dtype != "auto":
        scales = {"k_scale": draw(st.sampled_from((0.5, 1.0, 2.0))),
                  "v_scale": draw(st.sampled_from((0.25, 1.0)))}
    # None (1/sqrt(head_dim)) or an explicit scale in the range models use (Gemma-2's
    # query_pre_attn_scalar, muP-style 1/head_dim, a softmax temperature).
    sm_scale = draw(st.one_of(st.none(), st.sampled_from((0.03, 0.0625, 0.2, 0.5))))
    return PagedCase(
        kv_lens=kv_lens,
        q_lens=q_lens,
        num_q_heads=num_kv_heads * ratio,
        num_kv_heads=num_kv_heads,
        head_dim=draw(st.sampled_from(head_dims)),
        block_size=block_size,
        dtype=draw(st.sampled_from(dtype_choices)),
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        logits_soft_cap=soft_cap,
        alibi=alibi,
        sinks=sinks,
        kv_cache_dtype=kv_cache_dtype,
        **scales,
        seed=draw(st.integers(0, 2**16)),
        name="hyp",
    )
