"""flex-paged's contract guards: what it reports where it cannot run, and the two ways a
timed ``run`` could silently measure something else (a recompilation, or a kernel
compiled for another thread count), which it refuses.
"""

from __future__ import annotations

import functools
from dataclasses import replace

import pytest
import torch

from pagedbench.adapters.flex_paged import FlexPaged
from pagedbench.reference import PagedCase, materialize

#: Same shape family as the decode case of test_flex_paged_matches_dense.py.
CASE = PagedCase(kv_lens=(16, 48, 96), num_q_heads=8, num_kv_heads=2, head_dim=64,
                 block_size=16, dtype="float32", num_blocks=20, name="decode")


@pytest.fixture(scope="module")
def prepared(flex_paged: FlexPaged):
    return flex_paged, flex_paged.prepare(materialize(CASE))


def test_cuda_is_reported_unavailable_and_unsupported() -> None:
    flex = FlexPaged()
    availability = flex.available("cuda")
    assert not availability.ok and "CPU only" in availability.reason
    assert flex.why_unsupported(CASE, "cuda") == ["device 'cuda' not in ['cpu']"]


def test_run_refuses_a_thread_count_other_than_prepares(prepared) -> None:
    flex, state = prepared
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    try:
        with pytest.raises(RuntimeError, match=rf"is {threads + 1} but the kernel was compiled "
                                               rf"for {threads}"):
            flex.run(state)
    finally:
        torch.set_num_threads(threads)
    assert flex.run(state).shape == (CASE.total_q, CASE.num_q_heads, CASE.head_dim)


def test_run_refuses_to_compile(prepared) -> None:
    """A call that ``prepare`` did not compile (here: another sm_scale, a constant of the
    compiled kernel) must raise in ``run`` rather than be compiled, or run eagerly, inside
    the timed call."""
    flex, state = prepared
    with pytest.raises(RuntimeError, match="fail_on_recompile"):
        scale = state.call.keywords["scale"]
        flex.run(replace(state, call=functools.partial(state.call, scale=scale / 2)))


def test_undeclared_features_and_fp8_cache_are_reported_unsupported() -> None:
    case = PagedCase(kv_lens=(16,), num_q_heads=2, num_kv_heads=1, head_dim=64, block_size=16,
                     dtype="bfloat16", alibi=True, sinks=True, kv_cache_dtype="fp8_e4m3",
                     name="features")
    assert FlexPaged().why_unsupported(case, "cpu") == [
        "feature 'alibi' not supported",
        "feature 'sinks' not supported",
        "kv_cache_dtype 'fp8_e4m3' not in ['auto']",
    ]
