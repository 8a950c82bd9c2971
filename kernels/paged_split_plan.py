"""The split planner of the split-KV paged decode (:mod:`.paged_split_decode`): how many
splits a launch gets and how many interpreter steps it costs, from the lengths alone.

Balanced mode follows FlashAttention's ``num_splits_heuristic`` (hopper/heuristics.h):
the fewest splits reaching 85% of the best wave efficiency, with the slots of the GPU
counted as SMs x programs per SM (FlashInfer's decode planner also fills SMs x
occupancy). Batch-invariant mode fixes the split size in keys instead (FlashInfer's
``fixed_split_size``; vLLM uses it under ``VLLM_BATCH_INVARIANT``). Host-side Python:
the kernels read the plan as launch arguments; :func:`visible_tiles` is the host twin of
the kernels' ``_visible_tiles``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .paged_features import LaunchConfig, launch_config

#: SMs the split count plans for when the launch is on the CPU (interpreted): an H100
#: SXM's or H200's 132, so the interpreter runs the grid those GPUs would get.
CPU_STAND_IN_SM_COUNT = 132
#: Most splits per sequence (FlashAttention's ``num_splits_heuristic`` caps at 128).
MAX_SPLITS = 128
#: Keys per split in batch-invariant mode (a multiple of every ``kv_tile`` in the launch
#: table). Unmeasured; smaller than vLLM's 2048 (its FlashInfer decode under
#: ``VLLM_BATCH_INVARIANT``) so that batch 1 at 4k keys still has 8 splits per KV head.
BATCH_INVARIANT_SPLIT_SIZE = 512


def visible_tiles(kv_len: int, sliding_window: int | None, kv_tile: int) -> int:
    """Tiles of ``kv_tile`` keys from the one holding the first visible key to the last
    (what the kernel's ``_visible_tiles`` computes)."""
    first_key = 0 if sliding_window is None else max(kv_len - sliding_window, 0)
    return -(-kv_len // kv_tile) - first_key // kv_tile


def split_count_heuristic(programs: int, num_tiles: int, slots: int,
                          max_splits: int = MAX_SPLITS) -> int:
    """Splits per sequence that fill ``slots`` program slots with ``programs`` (sequences x
    KV heads) whose longest range has ``num_tiles`` tiles.

    FlashAttention's ``num_splits_heuristic`` (hopper/heuristics.h), in our own words: no
    split once the programs fill 80% of the slots; otherwise, over ``n`` in ``1 ..
    min(max_splits, slots, num_tiles)``, the wave efficiency ``w / ceil(w)`` with
    ``w = programs * n / slots``, and the smallest ``n`` within 85% of the best.
    (FlashAttention also refuses to split 4 tiles or fewer; here a split is one tile at
    least, and its partial costs ``group x head_dim`` floats against a tile's
    ``kv_tile x head_dim`` K and V, so short contexts split too.)
    """
    if programs >= 0.8 * slots or num_tiles <= 1:
        return 1
    limit = max(1, min(max_splits, slots, num_tiles))
    efficiency = [(programs * n / slots) / math.ceil(programs * n / slots)
                  for n in range(1, limit + 1)]
    best = max(efficiency)
    return next(n for n, e in enumerate(efficiency, start=1) if e >= 0.85 * best)


@dataclass(frozen=True)
class SplitPlan:
    """How one launch splits the keys (from the lengths alone; see :func:`plan_splits`).

    Attributes
    ----------
    config : LaunchConfig
        Tile, warps and stages of the split kernel.
    num_splits : int
        Grid extent along the splits (balanced: every sequence's split count; batch
        invariant: the most any sequence needs).
    tiles_per_split : int
        Batch invariant: ``split_size / kv_tile``; balanced: 0 (each sequence's tiles
        are shared out over ``num_splits``).
    batch_invariant : bool
    """

    config: LaunchConfig
    num_splits: int
    tiles_per_split: int
    batch_invariant: bool

    @property
    def direct_output(self) -> bool:
        """One balanced split: the split kernel writes the output, no merge."""
        return self.num_splits == 1 and not self.batch_invariant

    def steps(self, kv_lens: Sequence[int], num_kv_heads: int,
              sliding_window: int | None) -> int:
        """Loop iterations of both kernels, all programs, plus one per program (the cost
        unit of the interpreter): tiles visited, programs launched, merge reads."""
        tiles = sum(visible_tiles(n, sliding_window, self.config.kv_tile) for n in kv_lens)
        programs = len(kv_lens) * self.num_splits
        if self.direct_output:
            return (tiles + programs) * num_kv_heads
        if self.batch_invariant:
            merge_reads = sum(-(-visible_tiles(n, sliding_window, self.config.kv_tile)
                                // self.tiles_per_split) for n in kv_lens)
        else:
            merge_reads = len(kv_lens) * self.num_splits
        return (tiles + programs + len(kv_lens) + 2 * merge_reads) * num_kv_heads


def plan_splits(
    kv_lens: Sequence[int],
    num_kv_heads: int,
    head_dim: int,
    cache_element_size: int,
    sliding_window: int | None = None,
    *,
    batch_invariant: bool = False,
    split_size: int = BATCH_INVARIANT_SPLIT_SIZE,
    num_splits: int | None = None,
    num_sms: int = CPU_STAND_IN_SM_COUNT,
) -> SplitPlan:
    """Choose the split grid of a launch from the batch, the context and the SM count.

    Parameters
    ----------
    kv_lens : sequence of int
        Keys per sequence, ``[batch]``.
    num_kv_heads, head_dim : int
    cache_element_size : int
        Bytes per K/V element (1 for fp8, 4 for float32): picks the tile.
    sliding_window : int or None
        Only the keys inside the window are split.
    batch_invariant : bool
        Fixed ``split_size`` keys per split instead of the balanced count.
    split_size : int
        Keys per split in batch-invariant mode; a positive multiple of the tile.
    num_splits : int or None
        Balanced mode: force this many splits (>= 1); None chooses
        (:func:`split_count_heuristic` with ``num_sms x programs_per_sm`` slots).
    num_sms : int
        SMs of the device (:data:`CPU_STAND_IN_SM_COUNT` for the CPU).

    Raises
    ------
    ValueError
        If ``split_size`` is not a positive multiple of the tile, ``num_splits`` < 1 or
        given with ``batch_invariant``, or ``num_sms`` < 1.
    """
    config = launch_config("split_decode", head_dim, cache_element_size)
    tiles = [visible_tiles(n, sliding_window, config.kv_tile) for n in kv_lens]
    if num_sms < 1:
        raise ValueError(f"num_sms must be >= 1, got {num_sms}")
    if batch_invariant:
        if num_splits is not None:
            raise ValueError("num_splits cannot be forced in batch-invariant mode "
                             "(the split size fixes it); pass split_size instead")
        if split_size < 1 or split_size % config.kv_tile:
            raise ValueError(f"split_size must be a positive multiple of the tile "
                             f"({config.kv_tile} keys), got {split_size}")
        per_split = split_size // config.kv_tile
        grid = max(1, max(-(-t // per_split) for t in tiles))
        return SplitPlan(config, grid, per_split, True)
    if num_splits is None:
        num_splits = split_count_heuristic(len(kv_lens) * num_kv_heads, max(tiles),
                                           num_sms * config.programs_per_sm)
    elif not (isinstance(num_splits, int) and num_splits >= 1):
        raise ValueError(f"num_splits must be None or an int >= 1, got {num_splits!r}")
    return SplitPlan(config, num_splits, 0, False)


def device_sm_count(device: torch.device) -> int:
    """SMs of a CUDA ``device``; :data:`CPU_STAND_IN_SM_COUNT` for any other."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return CPU_STAND_IN_SM_COUNT
