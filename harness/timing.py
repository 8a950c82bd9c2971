"""Timing: how long one ``run()`` takes, and what it moves.

- CPU: ``time.perf_counter_ns`` around each call, after warm-up, with the thread count
  fixed by the caller (``torch.set_num_threads``); median and p10/p90 over the repetitions.
- CUDA: ``triton.testing.do_bench``, which times with CUDA events and clears the L2 cache
  before every repetition (cold-L2 timing, as FlashInfer's ``bench_gpu_time`` in
  ``flashinfer/testing/utils.py`` defaults to); median and p10/p90.

Derived bandwidth counts the bytes a case must move at least once (FlashInfer's
``attention_tb_per_sec_with_actual_seq_lens`` and tritonbench's ``decoding_attention``
count from the actual sequence lengths): Q, the K and V of every attended token, O, and
the block tables. GB/s uses GB = 1e9 bytes.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pagedbench.reference import PagedCase


@dataclass(frozen=True)
class Timing:
    """Latency statistics of one implementation on one case.

    Attributes
    ----------
    median_ms, p10_ms, p90_ms : float
        Milliseconds per call.
    n : int
        Timed repetitions.
    method : str
        ``"perf_counter"`` (CPU wall clock), ``"cuda_events"`` (``do_bench``, cold L2),
        or ``"interpreted"`` (wall clock of an interpreter: never ranked).
    """

    median_ms: float
    p10_ms: float
    p90_ms: float
    n: int
    method: str

    def to_dict(self) -> dict[str, float | int | str]:
        return {"median": self.median_ms, "p10": self.p10_ms, "p90": self.p90_ms,
                "n": self.n, "method": self.method}


def _quantiles(samples_ms: list[float], method: str) -> Timing:
    if len(samples_ms) == 1:
        (only,) = samples_ms
        return Timing(only, only, only, 1, method)
    deciles = statistics.quantiles(samples_ms, n=10, method="inclusive")
    return Timing(statistics.median(samples_ms), deciles[0], deciles[-1], len(samples_ms), method)


def time_cpu(
    fn: Callable[[], object],
    *,
    warmup: int = 3,
    repetitions: int = 30,
    budget_s: float = 10.0,
    method: str = "perf_counter",
) -> Timing:
    """Time ``fn()`` on the CPU with ``time.perf_counter_ns``.

    Parameters
    ----------
    fn : callable
        One complete call of the implementation (no arguments).
    warmup : int
        Untimed calls first (caches, lazy initialisation).
    repetitions : int
        Timed calls at most; fewer when ``budget_s`` runs out (at least one).
    budget_s : float
        Seconds of timed calls after which repetition stops.
    method : str
        Recorded in :attr:`Timing.method` (pass ``"interpreted"`` for interpreters).

    Raises
    ------
    ValueError
        If ``warmup`` < 0 or ``repetitions`` < 1.
    """
    if warmup < 0 or repetitions < 1:
        raise ValueError(f"need warmup >= 0 and repetitions >= 1, got {warmup}, {repetitions}")
    for _ in range(warmup):
        fn()
    samples_ms: list[float] = []
    deadline = time.perf_counter_ns() + int(budget_s * 1e9)
    for _ in range(repetitions):
        start = time.perf_counter_ns()
        fn()
        end = time.perf_counter_ns()
        samples_ms.append((end - start) / 1e6)
        if end > deadline:
            break
    return _quantiles(samples_ms, method)


def time_cuda(fn: Callable[[], object], *, warmup_ms: float = 25, rep_ms: float = 100) -> Timing:
    """Time ``fn()`` on the current CUDA device with ``triton.testing.do_bench`` (CUDA
    events, L2 cleared before each repetition).

    ``warmup_ms``/``rep_ms`` are do_bench's budgets in milliseconds (its defaults).

    Raises
    ------
    RuntimeError
        If CUDA is not available.
    """
    if not torch.cuda.is_available():
        raise RuntimeError("time_cuda needs a CUDA device; none is visible to torch")
    from triton.testing import do_bench

    times = do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="all")
    return _quantiles([float(t) for t in times], "cuda_events")


def bytes_moved(case: PagedCase) -> int:
    """Bytes a kernel must move at least once for ``case`` (bytes).

    Q and O (``total_q * num_q_heads * head_dim`` elements each), K and V of every token
    each sequence attends to (``sum(kv_lens) * num_kv_heads * head_dim`` each, at the KV
    cache's element size: 1 byte for fp8; with a sliding window, only the keys inside it),
    and the used block-table entries (int32).
    """
    elem = torch.empty((), dtype=case.torch_dtype).element_size()
    kv_elem = torch.empty((), dtype=case.kv_torch_dtype).element_size()  # 1 for fp8
    qo = 2 * case.total_q * case.num_q_heads * case.head_dim * elem
    attended = sum(
        min(kv, case.sliding_window + q - 1) if case.sliding_window else kv
        for kv, q in zip(case.kv_lens, case.q_lens_or_decode)
    )
    kv = 2 * attended * case.num_kv_heads * case.head_dim * kv_elem
    tables = sum(case.blocks_per_seq) * 4
    return qo + kv + tables


def flops(case: PagedCase) -> int:
    """Floating-point operations of the two matmuls (FLOPs): ``4 * head_dim * num_q_heads``
    per visible (query, key) pair (FlashInfer's ``attention_flops_with_actual_seq_lens``)."""
    pairs = 0
    for kv, q in zip(case.kv_lens, case.q_lens_or_decode):
        for i in range(q):
            pos = kv - q + i
            lo = max(0, pos - case.sliding_window + 1) if case.sliding_window else 0
            pairs += pos - lo + 1
    return 4 * case.head_dim * case.num_q_heads * pairs
