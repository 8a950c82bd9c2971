"""What a point moves and computes, what its device sustains, and the least time the two
allow: the roofline of every timed point.

Bytes count what a case must move at least once (FlashInfer's
``attention_tb_per_sec_with_actual_seq_lens`` and tritonbench's ``decoding_attention``
count from the actual sequence lengths): Q, the K and V of every attended token (V with
``head_dim_v``; a latent cache, whose V is inside K, once), O, and the block tables; FLOPs
count the two matmuls. :class:`DevicePeaks` holds what
:func:`~pagedbench.harness.measure.timing.measure_peaks` measured. GB = 1e9 bytes,
TFLOP = 1e12 FLOPs.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedbench.reference import PagedCase


@dataclass(frozen=True)
class DevicePeaks:
    """What the device sustained when measured, for fractions of peak and rooflines.

    Attributes
    ----------
    copy_gbps : float
        ``dst.copy_(src)`` of :data:`~pagedbench.harness.measure.timing.COPY_BYTES`,
        counting its read and its write (GB/s).
    bf16_tflops : float
        A square bf16 matmul (``2 n^3`` FLOPs) at its median time (TFLOP/s).
    method : str
        The timing method (``torch_timer`` or ``cuda_events``).
    cache_copy_gbps : float or None
        The fastest ``dst.copy_(src)`` of
        :data:`~pagedbench.harness.measure.timing.CACHE_COPY_BYTES`, whose source and
        destination stay in a cache between calls (GB/s, read plus write;
        :func:`~pagedbench.harness.measure.timing.cache_copy_gbps`); None when not measured.
    """

    copy_gbps: float
    bf16_tflops: float
    method: str
    cache_copy_gbps: float | None = None

    def to_dict(self) -> dict[str, object]:
        return {"copy_gbps": self.copy_gbps, "bf16_tflops": self.bf16_tflops,
                "method": self.method, "cache_copy_gbps": self.cache_copy_gbps}



def bytes_moved(case: PagedCase) -> int:
    """Bytes a kernel must move at least once for ``case`` (bytes).

    Q (``total_q * num_q_heads * head_dim`` elements) and O (``... * head_dim_v``), K and
    V of every token each sequence attends to (``sum(kv_lens) * num_kv_heads`` times
    ``head_dim`` for K and ``head_dim_v`` for V, at the KV cache's element size: 1 byte
    for fp8; with a sliding window, only the keys inside it; a latent cache's V is K's
    first channels, read with K: counted once), and the used block-table entries (int32).
    """
    elem = case.torch_dtype.itemsize
    kv_elem = case.kv_torch_dtype.itemsize  # 1 for fp8
    qo = case.total_q * case.num_q_heads * (case.head_dim + case.v_head_dim) * elem
    attended = sum(
        min(kv, case.sliding_window + q - 1) if case.sliding_window else kv
        for kv, q in zip(case.kv_lens, case.q_lens_or_decode)
    )
    channels = case.head_dim + (0 if case.latent_cache else case.v_head_dim)
    kv = attended * case.num_kv_heads * channels * kv_elem
    tables = sum(case.blocks_per_seq) * 4
    return qo + kv + tables


def flops(case: PagedCase) -> int:
    """Floating-point operations of the two matmuls (FLOPs): ``2 * (head_dim + head_dim_v)
    * num_q_heads`` per visible (query, key) pair (FlashInfer's
    ``attention_flops_with_actual_seq_lens``)."""
    pairs = 0
    for kv, q in zip(case.kv_lens, case.q_lens_or_decode):
        first = kv - q  # position of the first query token
        if case.sliding_window:
            for pos in range(first, kv):
                pairs += pos - max(0, pos - case.sliding_window + 1) + 1
        else:  # sum of (pos + 1) for pos in [first, kv)
            pairs += (kv * (kv + 1) - first * (first + 1)) // 2
    return 2 * (case.head_dim + case.v_head_dim) * case.num_q_heads * pairs


def roofline_floor_ms(moved: int, work: int, peaks: DevicePeaks) -> float:
    """The least time a call can take on a device with ``peaks``: the longer of moving
    ``moved`` bytes at the copy bandwidth and doing ``work`` FLOPs at the bf16 throughput
    (ms)."""
    return max(moved / (peaks.copy_gbps * 1e9), work / (peaks.bf16_tflops * 1e12)) * 1e3


__all__ = ["DevicePeaks", "bytes_moved", "flops", "roofline_floor_ms"]
