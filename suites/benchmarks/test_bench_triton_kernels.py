"""Benchmark: this project's Triton kernels (pytest-benchmark), on the CPU or on CUDA.

Kernels: ``split`` (split-KV decode, planned splits), ``split-invariant`` (fixed split
size), ``prefill`` (the GQA-packed prefill kernel run on the decode batch) and
``decode`` (``pagedbench-triton``, one program per sequence and KV head, for reference).

- CPU: the kernels run under Triton's interpreter; one wall-clock round of a small Llama-3-8B-shaped
  case (4 query heads per KV head, head_dim 128), recorded with ``timing_method
  "interpreted"`` and ``ranked: false``: an interpreter's wall clock says nothing about
  a GPU and is never compared with anything. The output is checked against the truth.
- CUDA: Llama-3-8B decode (bf16, 32 query / 8 KV heads, head_dim 128, block_size 16,
  every sequence at the full context) at batch 1/8/32 and contexts 4k/16k, timed by the
  harness (``triton.testing.do_bench``, L2 cleared; harness/measure/timing.py), whose samples
  are pytest-benchmark's rounds (suites/benchmarks/recording.py); ``extra_info``
  carries that median with ``bytes_moved``, ``flops`` and the resulting GB/s. The floors these figures are compared with are in
  docs/KERNELS.md.
"""

from __future__ import annotations

import pytest
import torch

from pagedbench.harness.measure.timing import time_cuda, time_once
from pagedbench.harness.measure.roofline import bytes_moved, flops
from pagedbench.harness.verdict.tolerance import assert_matches_truth
from pagedbench.reference import PagedCase, materialize
from pagedbench.suites.benchmarks.recording import record_timing

pytestmark = pytest.mark.bench
pytest.importorskip("triton")
from pagedbench.kernels.paged_decode import plan_paged_decode  # noqa: E402
from pagedbench.kernels.paged_prefill import plan_paged_prefill  # noqa: E402
from pagedbench.kernels.paged_split_decode import plan_paged_split_decode  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
KERNELS = ("split", "split-invariant", "prefill", "decode")


def _llama(batch: int, context: int) -> PagedCase:
    return PagedCase(kv_lens=(context,) * batch, num_q_heads=32, num_kv_heads=8,
                     head_dim=128, block_size=16, dtype="bfloat16", name="llama3-8b")


if DEVICE == "cuda":
    CASES = [_llama(batch, context) for batch in (1, 8, 32) for context in (4096, 16384)]
else:  # interpreted: one sequence pair, 2 KV heads of Llama-3-8B's shape
    CASES = [PagedCase(kv_lens=(160, 100), num_q_heads=8, num_kv_heads=2, head_dim=128,
                       block_size=16, dtype="bfloat16", name="llama3-8b-interp")]


def _plan(kernel: str, inputs):
    base = (inputs.q, inputs.kv_cache, inputs.block_tables, inputs.kv_lens)
    if kernel == "split":
        return plan_paged_split_decode(*base, inputs.scale)
    if kernel == "split-invariant":
        return plan_paged_split_decode(*base, inputs.scale, batch_invariant=True)
    if kernel == "prefill":
        return plan_paged_prefill(*base, inputs.cu_seqlens_q, inputs.scale)
    return plan_paged_decode(*base, inputs.scale)


@pytest.mark.parametrize("case", CASES, ids=[c.case_id for c in CASES])
@pytest.mark.parametrize("kernel", KERNELS)
def test_bench_triton_kernel(benchmark, kernel: str, case: PagedCase) -> None:
    benchmark.group = f"triton-{case.case_id}"
    inputs = materialize(case, DEVICE)
    launch = _plan(kernel, inputs)
    out = launch()  # compiles (GPU) or warms the interpreter (CPU)
    info = {"kernel": kernel, "device": DEVICE, "bytes_moved": bytes_moved(case),
            "flops": flops(case)}
    if DEVICE == "cuda":
        timing = time_cuda(launch)
        info.update(timing_method=timing.method, ranked=True, cuda_median_ms=timing.median_ms,
                    bandwidth_gbps=info["bytes_moved"] / timing.median_ms / 1e6)
        assert bool(torch.isfinite(out).all())
    else:
        timing = time_once(launch)
        info.update(timing_method=timing.method, ranked=False)
        assert_matches_truth(out, inputs, f"{kernel}:{case.case_id}")
    record_timing(benchmark, timing)
    benchmark.extra_info.update(info)
