"""How vLLM launches its three Triton attention kernels, for the adapters and their
interpreter cost model.

vLLM's dispatch choices (which sub-kernel, how many KV splits) are restated here so that
``prepare`` makes the call vLLM's backend would make, and the tile sizes so that
:class:`~pagedbench.adapters.interpreted.InterpretedWork` counts the programs and key-loop steps
of one call. Each constant names the vLLM 0.32.0 file it is read from. If vLLM changes
one, the calls stay valid but are no longer the ones vLLM's backends make, and the
interpreter estimates (which decide what is too large on the CPU) drift.
"""

from __future__ import annotations

import torch

from pagedbench.reference import PagedCase

from .interpreted import InterpretedWork, cdiv

#: ``vllm/v1/attention/backends/triton_attn.py`` (``TritonAttentionMetadataBuilder``): the
#: 2D kernel's minimum launch grid, whence the batch size below which decode batches take
#: the 3D (split-KV) kernel, and the number of KV segments in 3D.
MIN_LAUNCH_GRID_SIZE_2D = 128
NUM_PAR_SOFTMAX_SEGMENTS = 16
#: ``unified_attention``'s KV tile: 32 keys in 2D launches, 16 in 3D.
UNIFIED_TILE_2D, UNIFIED_TILE_3D = 32, 16
#: ``vllm/v1/attention/backends/mla/triton_mla.py``: KV tokens per split of
#: ``decode_attention_fwd`` before a further (power-of-two) split pays off, and the cap
#: on splits per multiprocessor on CUDA.
MIN_WORK_PER_SPLIT = 512
SPLIT_OCCUPANCY_MULTIPLIER = 2
#: ``triton_decode_attention.py``: ``BLOCK_N`` of the KV loop (64 off ROCm) and ``BLOCK_H``
#: of the grouped (GQA) kernel.
DECODE_KV_TILE, DECODE_HEAD_TILE = 64, 16
#: ``prefix_prefill.context_attention_fwd``'s tiles: query rows, cached-context tokens and
#: new tokens; ``chunked_prefill_paged_decode``'s decode tile is the block size (at most
#: 128) for a power-of-two block size, else 32.
PREFILL_Q_TILE, PREFILL_CONTEXT_TILE, PREFILL_NEW_TILE = 128, 32, 64
CHUNKED_DECODE_MAX_TILE, CHUNKED_DECODE_ODD_TILE = 128, 32


def unified_uses_3d(case: PagedCase) -> bool:
    """Whether vLLM's metadata builder sends ``case`` to the 3D (split-KV) kernel: decode
    batches of at most ``MIN_LAUNCH_GRID_SIZE_2D // num_kv_heads`` sequences."""
    return (case.mode == "decode"
            and case.batch_size <= MIN_LAUNCH_GRID_SIZE_2D // case.num_kv_heads)


def unified_3d_rows(case: PagedCase) -> int:
    """Rows of the 3D kernel's softmax scratch (``seq_threshold_3D``)."""
    return MIN_LAUNCH_GRID_SIZE_2D // case.num_kv_heads


def unified_work(case: PagedCase) -> InterpretedWork:
    """Programs and KV-tile steps of one ``unified_attention`` call (2D: ``BLOCK_M = 16``
    query rows, or the GQA group rounded up to a power of two, per program)."""
    block_m = 16 if case.gqa_ratio <= 16 else 1 << (case.gqa_ratio - 1).bit_length()
    block_q = block_m // case.gqa_ratio
    lens = list(zip(case.q_lens_or_decode, case.kv_lens))
    q_programs = (case.total_q // block_q + case.batch_size) * case.num_kv_heads
    weight = case.head_dim / 64
    if unified_uses_3d(case):
        programs = (q_programs * NUM_PAR_SOFTMAX_SEGMENTS  # attention, then the reduction
                    + case.total_q * case.num_q_heads)
        steps = case.num_kv_heads * sum(cdiv(kv, UNIFIED_TILE_3D) for _, kv in lens)
        return InterpretedWork(programs, steps, weight)
    steps = case.num_kv_heads * sum(cdiv(q, block_q) * cdiv(kv, UNIFIED_TILE_2D)
                                    for q, kv in lens)
    return InterpretedWork(q_programs, steps, weight)


def decode_num_kv_splits(case: PagedCase, device: str | torch.device) -> int:
    """vLLM's Triton MLA choice: ``next_pow2(max(1, max_kv_len // 512))``, capped at twice
    the multiprocessor count on CUDA (uncapped elsewhere)."""
    ideal = 1 << (max(1, max(case.kv_lens) // MIN_WORK_PER_SPLIT) - 1).bit_length()
    if torch.device(device).type != "cuda":
        return ideal
    sm_count = torch.cuda.get_device_properties(device).multi_processor_count
    return min(ideal, sm_count * SPLIT_OCCUPANCY_MULTIPLIER)


def decode_work(case: PagedCase) -> InterpretedWork:
    """Programs and KV-tile steps of one ``decode_attention_fwd`` call (stage 1 per
    sequence, head group and split; stage 2 per sequence and query head)."""
    splits = decode_num_kv_splits(case, "cpu")
    if case.gqa_ratio == 1:
        head_programs = case.num_q_heads
    else:
        head_programs = case.num_kv_heads * cdiv(case.gqa_ratio, DECODE_HEAD_TILE)
    programs = case.batch_size * (head_programs * splits + case.num_q_heads)
    steps = head_programs * sum(
        splits * cdiv(cdiv(kv, splits), DECODE_KV_TILE) for kv in case.kv_lens)
    return InterpretedWork(programs, steps, (case.head_dim + case.v_head_dim) / 128)


def chunked_work(case: PagedCase) -> InterpretedWork:
    """Programs and steps of one ``chunked_prefill_paged_decode`` call: the paged decode
    kernel on the decode rows, ``context_attention_fwd`` on the prefill rows."""
    bs = case.block_size
    decode_tile = (min(bs, CHUNKED_DECODE_MAX_TILE) if bs & (bs - 1) == 0
                   else CHUNKED_DECODE_ODD_TILE)
    lens = list(zip(case.q_lens_or_decode, case.kv_lens))
    programs = case.batch_size * case.num_kv_heads
    steps = case.num_kv_heads * sum(cdiv(kv, decode_tile) for q, kv in lens if q == 1)
    max_q = max(case.q_lens_or_decode)
    if max_q > 1:
        programs += case.batch_size * case.num_q_heads * cdiv(max_q, PREFILL_Q_TILE)
        steps += case.num_q_heads * sum(
            cdiv(q, PREFILL_Q_TILE) * (cdiv(kv - q, PREFILL_CONTEXT_TILE)
                                        + cdiv(q, PREFILL_NEW_TILE))
            for q, kv in lens if q > 1)
    return InterpretedWork(programs, steps, case.head_dim / 64)
