"""Canonical tensors of a case: :class:`PagedInputs` and :func:`materialize`.

The canonical layout is vLLM's and FlashInfer's "NHD" 5-D cache,
``kv_cache[num_blocks, 2, block_size, num_kv_heads, head_dim]`` (index 0 of dim 1 is K,
1 is V), addressed through ``block_tables[batch, max_blocks_per_seq]`` (int32). Adapters
convert from here in their untimed ``prepare()``.

Every slot that holds no live token is poisoned: the tail of each sequence's last block,
every unused block, the block that table padding points to, and whatever else the case's
``layout`` puts around the tensors (other layers, the K and V columns of a fused QKV
buffer). The poison is the case's (``PagedCase.poison``: NaN by default, also +Inf, -Inf
or the dtype's largest finite value), values are finite elsewhere, so any read past ``kv_lens`` (or
through a padded table entry) shows in the output. An fp8 cache holds the fp8 NaN (byte
``0x7F`` in both E4M3 "fn" and E5M2) in those slots.
"""

from __future__ import annotations

import math
import os
import random
from dataclasses import dataclass

import torch

from .allocator import BlockAllocator
from .axes import POISONS
from .case import PagedCase
from .errors import PagedTypeError, PagedValueError
from .writes import OUTLIER_CHANNEL_FRACTION, OUTLIER_CHANNEL_GAIN, store

#: Attention-sink logits are drawn uniformly from ``[SINK_LOW, SINK_HIGH)``: the range of
#: the scaled logits of unit-normal Q and K, so that a sink takes a visible share of the
#: softmax of short and long sequences alike without swamping it.
SINK_LOW, SINK_HIGH = -1.0, 4.0
_PADDING_SEQ = "__table_padding__"


def alibi_slopes(num_heads: int) -> torch.Tensor:
    """ALiBi slopes, one per head, ``Tensor[num_heads]``, float32.

    Press, Smith and Lewis, "Train Short, Test Long: Attention with Linear Biases Enables
    Input Length Extrapolation" (ICLR 2022), s. 3: for ``n`` heads, a power of two, the
    slopes are the geometric sequence ``2**(-8 * i / n)`` for ``i = 1 .. n``. For other
    ``n`` the authors' code (``get_slopes`` in ofirpress/attention_with_linear_biases)
    takes the ``m = 2**floor(log2 n)`` slopes of ``m`` heads, then the first ``n - m`` of
    every other slope of ``2 m`` heads (``i = 1, 3, 5, ...``); vLLM (``_get_alibi_slopes``)
    and FlashAttention's tests use the same rule. Computed in float64, rounded to float32,
    the type kernels take them in.

    Raises
    ------
    PagedTypeError, PagedValueError
        If ``num_heads`` is not an int >= 1.
    """
    if isinstance(num_heads, bool) or not isinstance(num_heads, int):
        raise PagedTypeError("num_heads", num_heads, "an int >= 1")
    if num_heads < 1:
        raise PagedValueError("num_heads", num_heads, ">= 1")
    m = 2 ** math.floor(math.log2(num_heads))
    slopes = [2.0 ** (-8.0 * i / m) for i in range(1, m + 1)]
    slopes += [2.0 ** (-8.0 * i / (2 * m)) for i in range(1, 2 * (num_heads - m), 2)]
    return torch.tensor(slopes, dtype=torch.float64).to(torch.float32)


@dataclass(frozen=True)
class PagedInputs:
    """The tensors of one :class:`PagedCase`, in the canonical layout.

    Attributes
    ----------
    case : PagedCase
    q : Tensor[total_q, num_q_heads, head_dim], case dtype
        Queries of all sequences packed in order; sequence ``i`` owns rows
        ``cu_seqlens_q[i] : cu_seqlens_q[i + 1]``. Strided with ``layout="fused_qkv"``.
    kv_cache : Tensor[num_blocks, 2, block_size, num_kv_heads, cache_head_dim], kv_cache_dtype
        K (``[:, 0, ..., :head_dim]``) and V (``[:, 1, ..., :v_head_dim]``;
        ``cache_head_dim`` is the larger of the two); poisoned wherever no live token is
        stored. The element type is ``case.kv_torch_dtype``: the case dtype, or for an
        fp8 case the quantized values (K means ``kv_cache[:, 0] * k_scale``, V
        ``kv_cache[:, 1] * v_scale``). A view into a larger allocation for the
        ``layer_pool``, ``every_other_block`` and ``layer_in_block`` layouts.
    block_tables : Tensor[batch, max_blocks_per_seq], int32
        Physical block of each logical block; padding entries point to ``padding_block``.
    kv_lens : Tensor[batch], int32
    cu_seqlens_q : Tensor[batch + 1], int32
        Prefix sums of ``q_lens``, starting at 0.
    slot_mapping : Tensor[sum(kv_lens)], int64
        Physical slot (``block * block_size + offset``) of every token, sequences in order.
    padding_block : int
        The poisoned block that table padding points to.
    alibi_slopes : Tensor[num_q_heads], float32, or None
        ALiBi slope of each query head (:func:`alibi_slopes`) when ``case.alibi``.
    sinks : Tensor[num_q_heads], float32, or None
        Attention-sink logit of each query head when ``case.sinks``.
    """

    case: PagedCase
    q: torch.Tensor
    kv_cache: torch.Tensor
    block_tables: torch.Tensor
    kv_lens: torch.Tensor
    cu_seqlens_q: torch.Tensor
    slot_mapping: torch.Tensor
    padding_block: int
    alibi_slopes: torch.Tensor | None = None
    sinks: torch.Tensor | None = None

    def __post_init__(self) -> None:
        """Refuse tensors whose type, shape, dtype or device disagree with the case (the
        values are checked by :meth:`check_values`)."""
        case = self.case
        if not isinstance(case, PagedCase):
            raise PagedTypeError("case", case, "a PagedCase")
        hkv, d = case.num_kv_heads, case.head_dim
        expected = {
            "q": ((case.total_q, case.num_q_heads, d), case.torch_dtype),
            "kv_cache": ((None, 2, case.block_size, hkv, case.cache_head_dim),
                         case.kv_torch_dtype),
            "block_tables": ((case.batch_size, None), torch.int32),
            "kv_lens": ((case.batch_size,), torch.int32),
            "cu_seqlens_q": ((case.batch_size + 1,), torch.int32),
            "slot_mapping": ((sum(case.kv_lens),), torch.int64),
        }
        if case.alibi or self.alibi_slopes is not None:
            expected["alibi_slopes"] = ((case.num_q_heads,), torch.float32)
        if case.sinks or self.sinks is not None:
            expected["sinks"] = ((case.num_q_heads,), torch.float32)
        for name, (shape, dtype) in expected.items():
            tensor = getattr(self, name)
            if not isinstance(tensor, torch.Tensor):
                raise PagedTypeError(name, tensor, f"a torch.Tensor of shape {_shape(shape)}")
            if tensor.dim() != len(shape) or any(
                    want is not None and got != want for got, want in zip(tensor.shape, shape)):
                raise PagedValueError(name, tuple(tensor.shape), f"of shape {_shape(shape)}",
                                      f"{name} must have shape {_shape(shape)} for case "
                                      f"{case.case_id}, got {tuple(tensor.shape)}")
            if tensor.dtype != dtype:
                raise PagedValueError(name, tensor.dtype, f"of dtype {dtype}")
            if tensor.device != self.q.device:
                raise PagedValueError(name, tensor.device, f"on the device of q ({self.q.device})")
        if case.alibi != (self.alibi_slopes is not None):
            raise PagedValueError("alibi_slopes", self.alibi_slopes,
                                  "given exactly when case.alibi is True")
        if case.sinks != (self.sinks is not None):
            raise PagedValueError("sinks", self.sinks, "given exactly when case.sinks is True")
        num_blocks = self.kv_cache.shape[0]
        if self.block_tables.shape[1] < case.max_blocks_per_seq:
            raise PagedValueError("block_tables", tuple(self.block_tables.shape),
                                  f"at least {case.max_blocks_per_seq} columns")
        if isinstance(self.padding_block, bool) or not isinstance(self.padding_block, int):
            raise PagedTypeError("padding_block", self.padding_block, "an int")
        if not 0 <= self.padding_block < num_blocks:
            raise PagedValueError("padding_block", self.padding_block, f"in 0..{num_blocks - 1}")

    def check_values(self) -> None:
        """Refuse values that disagree with the case: ``kv_lens``, ``cu_seqlens_q``, every
        block-table entry a sequence uses (in ``0 .. num_blocks - 1``) and
        ``slot_mapping`` (the slots those entries give). Reads the tensors back to the
        host.

        Raises
        ------
        PagedValueError
            Naming the tensor, the entry and the allowed values.
        """
        case = self.case
        if tuple(self.kv_lens.tolist()) != case.kv_lens:
            raise PagedValueError("kv_lens", self.kv_lens.tolist(),
                                  f"case.kv_lens {list(case.kv_lens)}")
        cu = [0]
        for q_len in case.q_lens_or_decode:
            cu.append(cu[-1] + q_len)
        if self.cu_seqlens_q.tolist() != cu:
            raise PagedValueError("cu_seqlens_q", self.cu_seqlens_q.tolist(),
                                  f"{cu} (prefix sums of q_lens)")
        num_blocks, bs = self.kv_cache.shape[0], case.block_size
        slots = []
        for i, (row, used) in enumerate(zip(self.block_tables.tolist(), case.blocks_per_seq)):
            bad = [b for b in row[:used] if not 0 <= b < num_blocks]
            if bad:
                raise PagedValueError(f"block_tables[{i}]", bad[0], f"in 0..{num_blocks - 1}")
            slots += [row[t // bs] * bs + t % bs for t in range(case.kv_lens[i])]
        found = self.slot_mapping.tolist()
        if found != slots:
            j = next(j for j, (a, b) in enumerate(zip(found, slots)) if a != b)
            raise PagedValueError(f"slot_mapping[{j}]", found[j],
                                  f"{slots[j]} (block_tables[seq][t // block_size] * "
                                  "block_size + t % block_size)")

    @property
    def k_cache(self) -> torch.Tensor:
        """``[num_blocks, block_size, num_kv_heads, head_dim]`` view of K."""
        return self.kv_cache[:, 0, ..., : self.case.head_dim]

    @property
    def v_cache(self) -> torch.Tensor:
        """``[num_blocks, block_size, num_kv_heads, v_head_dim]`` view of V."""
        return self.kv_cache[:, 1, ..., : self.case.v_head_dim]

    @property
    def device(self) -> torch.device:
        return self.q.device

    @property
    def scale(self) -> float:
        """The softmax scale applied: :attr:`PagedCase.scale` (``case.sm_scale`` when
        given, else ``1 / sqrt(head_dim)``)."""
        return self.case.scale

    def to(self, device: str | torch.device) -> PagedInputs:
        """The same inputs on another device, each view into a larger allocation (the
        case's ``layout``) still a view of the same shape, strides and offset."""
        move = lambda t: None if t is None else _move(t, device)  # noqa: E731
        return PagedInputs(
            self.case,
            move(self.q),
            move(self.kv_cache),
            move(self.block_tables),
            move(self.kv_lens),
            move(self.cu_seqlens_q),
            move(self.slot_mapping),
            self.padding_block,
            move(self.alibi_slopes),
            move(self.sinks),
        )


def _shape(shape: tuple[int | None, ...]) -> str:
    return "[" + ", ".join("*" if n is None else str(n) for n in shape) + "]"


def _move(t: torch.Tensor, device: str | torch.device) -> torch.Tensor:
    """``t`` on ``device``; a view of a contiguous base moves with its base and is viewed
    again with the same strides and offset (``Tensor.to`` would compact a strided view)."""
    base = t._base
    if base is None or not base.is_contiguous() or t.device == torch.device(device):
        return t.to(device)
    moved = base.to(device)
    return moved.as_strided(t.shape, t.stride(), t.storage_offset() - base.storage_offset())


def new_output(inputs: PagedInputs) -> torch.Tensor:
    """An output buffer ``[total_q, num_q_heads, v_head_dim]`` in the case dtype, all NaN.

    Adapters whose library writes into a caller's buffer must pass this one, so that an
    element the kernel never writes shows as NaN and fails the comparison. With
    ``layout="strided_out"`` it is the second half of the channels of a ``[total_q,
    num_q_heads, 2 * v_head_dim]`` NaN buffer (row and head strides doubled, a storage
    offset): a kernel that ignores the output's strides writes the wrong elements.
    """
    case = inputs.case
    rows, heads, dv = case.total_q, case.num_q_heads, case.v_head_dim
    if case.layout != "strided_out":
        return torch.full((rows, heads, dv), float("nan"), dtype=case.torch_dtype,
                          device=inputs.device)
    wide = torch.full((rows, heads, 2 * dv), float("nan"), dtype=case.torch_dtype,
                      device=inputs.device)
    return wide[..., dv:]


def _allocate(case: PagedCase) -> tuple[list[list[int]], list[list[int]], int]:
    """Grow all sequences block by block, interleaved, from a shuffled pool of the blocks
    ``min_block_id .. pool_blocks - 1``.

    Returns per-sequence block tables, per-sequence slot mappings, and the padding block.
    """
    low, bs = case.min_block_id, case.block_size
    allocator = BlockAllocator(case.pool_blocks - low, bs, seed=case.seed)
    allocator.add_sequence(_PADDING_SEQ)
    allocator.append_tokens(_PADDING_SEQ, 1)
    padding_block = allocator.block_table(_PADDING_SEQ)[0]

    slots: list[list[int]] = [[] for _ in case.kv_lens]
    shared = case.shared_blocks or (0,) * case.batch_size
    # A sequence that shares blocks starts as a fork once the sequence whose own table
    # holds those blocks (the one before it, or further back along a chain sharing at
    # least as many) holds exactly them, full and committed, as a beam forks or a prompt
    # hits the prefix cache; the others start now.
    waiting = [i for i in range(case.batch_size) if shared[i]]
    parent = {}
    for i in waiting:
        j = i - 1
        while j > 0 and shared[j] >= shared[i]:
            j -= 1
        parent[i] = j
    for i in range(case.batch_size):
        if not shared[i]:
            allocator.add_sequence(i)
    # Append in rounds of one block per sequence, in a seeded random order each round,
    # as a serving engine interleaves requests.
    rng = random.Random(case.seed + 1)
    pending = [i for i in range(case.batch_size) if i not in waiting]

    def fork_ready() -> None:
        for i in list(waiting):
            j = parent[i]
            if j not in waiting and len(slots[j]) == shared[i] * bs:
                allocator.fork(j, i)
                slots[i] = list(slots[j])
                waiting.remove(i)
                pending.append(i)

    fork_ready()
    while pending:
        rng.shuffle(pending)
        for i in pending:
            take = min(case.block_size, case.kv_lens[i] - len(slots[i]))
            slots[i].extend(allocator.append_tokens(i, take))
            if waiting:
                allocator.commit(i, len(slots[i]))
        fork_ready()
        pending = [i for i in pending if len(slots[i]) < case.kv_lens[i]]
    assert not waiting, f"sequences {waiting} never forked"  # a bug here, not bad input
    tables = [[low + b for b in allocator.block_table(i)] for i in range(case.batch_size)]
    slots = [[low * bs + s for s in seq] for seq in slots]
    return tables, slots, low + padding_block


#: Magnitude of the finite "stale" V values that ``tail_poison="stale"`` leaves in the
#: unused slots of each last block: large enough that weighting one by a nonzero
#: probability gives an error far above any tolerance.
STALE_SCALE = 30.0
TAIL_POISONS = ("nan", "stale")
#: Layers of the pools that the ``layer_pool`` and ``layer_in_block`` layouts allocate,
#: and the one a case's cache is (not the first, so that its offset is not 0).
NUM_LAYERS, LAYER = 3, 1


def poison_value(poison: str, dtype: torch.dtype) -> float:
    """The value ``poison`` (one of :data:`~.axes.POISONS`) stands for in ``dtype``.

    Raises
    ------
    PagedValueError
        If ``poison`` is not one of :data:`~.axes.POISONS`.
    """
    if poison not in POISONS:
        raise PagedValueError("poison", poison, f"one of {POISONS}")
    if poison == "nan":
        return float("nan")
    largest = torch.finfo(dtype).max
    if poison == "huge":
        return largest
    magnitude = largest if dtype == torch.float8_e4m3fn else float("inf")
    return magnitude if poison == "inf" else -magnitude


def _cache_view(case: PagedCase, fill: float, device: torch.device) -> torch.Tensor:
    """The canonical cache ``[num_blocks, 2, block_size, num_kv_heads, cache_head_dim]``
    filled with ``fill`` on ``device``, laid out as ``case.layout`` says (a view into a
    larger, ``fill``-filled allocation for the pooled layouts)."""
    shape = (case.pool_blocks, 2, case.block_size, case.num_kv_heads, case.cache_head_dim)
    dtype = case.kv_torch_dtype
    if case.layout == "layer_pool":
        return torch.full((NUM_LAYERS, *shape), fill, dtype=dtype, device=device)[LAYER]
    if case.layout == "every_other_block":
        return torch.full((2 * shape[0], *shape[1:]), fill, dtype=dtype, device=device)[1::2]
    if case.layout == "layer_in_block":
        nb, _, bs, hkv, d = shape
        pool = torch.full((nb, 2, NUM_LAYERS, hkv, bs, d), fill, dtype=dtype, device=device)
        return pool[:, :, LAYER].transpose(2, 3)  # [nb, 2, bs, hkv, d] through HND strides
    return torch.full(shape, fill, dtype=dtype, device=device)


def _query_buffer(case: PagedCase, fill: float, device: torch.device) -> torch.Tensor:
    """``q`` ``[total_q, num_q_heads, head_dim]`` filled with ``fill``: its own tensor, or
    for ``layout="fused_qkv"`` the Q columns of a ``[total_q, (num_q_heads + 2 *
    num_kv_heads) * head_dim]`` projection whose K and V columns hold ``fill``."""
    rows, hq, d = case.total_q, case.num_q_heads, case.head_dim
    if case.layout != "fused_qkv":
        return torch.full((rows, hq, d), fill, dtype=case.torch_dtype, device=device)
    qkv = torch.full((rows, (hq + 2 * case.num_kv_heads) * d), fill, dtype=case.torch_dtype,
                     device=device)
    return qkv[:, : hq * d].view(rows, hq, d)


def _rounded(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` (float32) clamped to ``dtype``'s finite range and rounded to it."""
    limit = torch.finfo(dtype).max
    return x.clamp(-limit, limit).to(dtype)


def resolve_device(device: object) -> torch.device:
    """``device`` as a ``torch.device`` that exists on this machine.

    Raises
    ------
    PagedTypeError
        If ``device`` is not a str or ``torch.device``.
    PagedValueError
        If it is not ``cpu``, ``cuda`` or ``cuda:N``, or names a CUDA device this machine
        does not have (checked before anything is built).
    """
    allowed = "'cpu', 'cuda' or 'cuda:N'"
    if isinstance(device, str):
        try:
            resolved = torch.device(device)
        except RuntimeError:
            raise PagedValueError("device", device, allowed) from None
    elif isinstance(device, torch.device):
        resolved = device
    else:
        raise PagedTypeError("device", device, f"a str or torch.device: {allowed}")
    if resolved.type not in ("cpu", "cuda"):
        raise PagedValueError("device", device, allowed)
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            raise PagedValueError(
                "device", str(device), "'cpu' on this machine",
                f"device {str(device)!r}: no CUDA device is visible to torch here "
                f"(torch {torch.__version__}); allowed: 'cpu'")
        count = torch.cuda.device_count()
        if resolved.index is not None and resolved.index >= count:
            raise PagedValueError("device", str(device), f"'cpu' or cuda:0..cuda:{count - 1}")
    return resolved


def device_memory_bytes(device: torch.device) -> int | None:
    """Total memory of ``device`` (bytes): the GPU's, or the host's physical memory;
    ``None`` when the host does not say."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return torch.cuda.get_device_properties(index).total_memory
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return None


#: How many caches' worth of memory each layout allocates for the KV pool.
_POOL_COPIES = {"layer_pool": NUM_LAYERS, "layer_in_block": NUM_LAYERS, "every_other_block": 2}


def footprint_bytes(case: PagedCase) -> int:
    """Bytes :func:`materialize` allocates for ``case`` at least: the KV pool
    (``pool_blocks * 2 * block_size * num_kv_heads * cache_head_dim`` elements, times
    the layers or blocks around it that the layout allocates), Q and an output of its
    size, and the float32 draws of the longest sequence's K and V."""
    pool = (case.pool_blocks * 2 * case.block_size * case.num_kv_heads * case.cache_head_dim
            * _POOL_COPIES.get(case.layout, 1))
    rows = case.total_q * case.num_q_heads * case.cache_head_dim
    draws = 2 * max(case.kv_lens) * case.num_kv_heads * case.cache_head_dim
    return pool * case.kv_torch_dtype.itemsize + 2 * rows * case.torch_dtype.itemsize + 4 * draws


def check_fits(case: PagedCase, device: str | torch.device = "cpu") -> None:
    """Refuse a case whose tensors could never fit in ``device``'s memory, before anything
    is allocated (a block_size of 1e9 asks for terabytes of KV pool).

    Raises
    ------
    PagedValueError
        Naming the parameter that makes the pool this large (``num_blocks`` when set,
        else ``block_size`` when it exceeds every sequence, else ``kv_lens``), the bytes
        needed and the device's memory.
    """
    resolved = resolve_device(device)
    total = device_memory_bytes(resolved)
    need = footprint_bytes(case)
    if total is None or need <= total:
        return
    if case.num_blocks is not None:
        parameter, value = "num_blocks", case.num_blocks
    elif case.block_size > max(case.kv_lens):
        parameter, value = "block_size", case.block_size
    else:
        parameter, value = "kv_lens", list(case.kv_lens)
    raise PagedValueError(
        parameter, value, f"small enough for {total / 1e9:.3g} GB",
        f"{parameter}={value}: case {case.case_id} needs {need / 1e9:.3g} GB "
        f"({case.pool_blocks} blocks x 2 x block_size {case.block_size} x num_kv_heads "
        f"{case.num_kv_heads} x head_dim {case.head_dim} of {case.kv_cache_dtype} KV cache, "
        f"plus Q and the output), more than the {total / 1e9:.3g} GB of memory of "
        f"{resolved.type}; allowed: a case that fits in it")


def logit_bound(case: PagedCase) -> float:
    """A bound on every scaled logit ``|q . k| * scale`` of :func:`materialize`'s inputs
    for ``case`` (float, before any soft cap): ``|logit_offset|`` plus eight times the
    drawn part's standard deviation were every channel an outlier,
    ``OUTLIER_CHANNEL_GAIN * qk_magnitude**2 * sqrt(head_dim) * scale``, times the
    rounding of Q to the case dtype and of K to the cache's (``1 + eps / 2`` each: 6.25%
    for fp8 e4m3). Held against materialized inputs in
    ``suites/reference/test_logit_bound.py``. For the declarations that depend on how far
    the logits reach (``why_unsupported``)."""
    drawn = OUTLIER_CHANNEL_GAIN * case.qk_magnitude ** 2 * math.sqrt(case.head_dim) * case.scale
    rounding = ((1 + torch.finfo(case.torch_dtype).eps / 2)
                * (1 + torch.finfo(case.kv_torch_dtype).eps / 2))
    return (abs(case.logit_offset) + 8 * drawn) * rounding


def materialize(
    case: PagedCase, device: str | torch.device = "cpu", *, tail_poison: str = "nan",
    on_device: bool = False,
) -> PagedInputs:
    """Build the canonical tensors of ``case`` on ``device``, deterministically from its seed.

    Q, K and V are normal with standard deviation ``qk_magnitude`` (Q, K; K with a few
    outlier channels, see :data:`OUTLIER_CHANNEL_GAIN`) and ``v_magnitude`` (V), drawn in
    float32, clamped to the dtype's finite range and rounded to the case dtype; for an
    fp8 ``kv_cache_dtype``, K and V are instead divided by ``k_scale``/``v_scale``,
    clamped to the fp8 type's finite range (saturating, as vLLM's fp8 cache writers do)
    and rounded to it. A ``logit_offset`` sets channel 0 of every Q and K row (see
    :class:`PagedCase`); with ``latent_cache`` V is K's first ``head_dim_v`` channels. Block tables come from
    :class:`~pagedbench.reference.allocator.BlockAllocator` with a shuffled free list,
    over the blocks from ``case.min_block_id`` up; with ``case.shared_blocks`` a
    sequence starts as a fork (:meth:`~pagedbench.reference.allocator.BlockAllocator.fork`)
    of the one whose blocks it shares, and the K/V of its shared tokens are what their
    first owner wrote (its own draws for them are discarded, so its other tokens have the
    values of the unshared case). ``case.poison`` fills every slot
    without a live token and everything the ``layout`` allocates around the tensors.
    ``tail_poison`` chooses what fills the V half of the unused slots at the end of each
    sequence's partly filled last block: ``"nan"`` (the case's poison, the strict
    default) or ``"stale"``, finite values ``STALE_SCALE * N(0, 1)`` (stored like V),
    standing for what an earlier request left there. K stays poisoned there, so a kernel
    that computes a logit for a key past ``kv_len`` still shows it; every other unused
    slot is poisoned either way. See ``Capabilities.nan_safe_tail``.
    ``on_device``: draw and build everything on ``device`` with a generator there (same
    seed, so reproducible on that device; a CUDA generator draws other values than the
    host's, a CPU one the same), so that nothing of the size of the KV pool touches the
    host: for cases whose pool the host cannot hold (``harness/verdict/truth.py``, device truth).
    With ``case.alibi``, ``alibi_slopes`` holds :func:`alibi_slopes`; with
    ``case.sinks``, ``sinks`` holds logits uniform in ``[SINK_LOW, SINK_HIGH)``, drawn
    after Q from the same generator (so cases without sinks keep their values).

    Raises
    ------
    PagedTypeError
        If ``case`` is not a :class:`PagedCase`, or ``device`` not a str/device.
    PagedValueError
        If ``tail_poison`` is not one of :data:`TAIL_POISONS`, ``device`` does not exist
        here (:func:`resolve_device`), or the case cannot fit in its memory
        (:func:`check_fits`); all checked before anything is built.
    """
    if not isinstance(case, PagedCase):
        raise PagedTypeError("case", case, "a PagedCase")
    if tail_poison not in TAIL_POISONS:
        raise PagedValueError("tail_poison", tail_poison, f"one of {TAIL_POISONS}")
    fill = poison_value(case.poison, case.kv_torch_dtype)
    check_fits(case, device)
    where = resolve_device(device) if on_device else torch.device("cpu")
    gen = torch.Generator(device=where).manual_seed(case.seed)
    dtype = case.torch_dtype
    hkv, d, dv, bs = case.num_kv_heads, case.head_dim, case.v_head_dim, case.block_size
    tables, slots, padding_block = _allocate(case)

    outliers = torch.rand(hkv, d, generator=gen, device=where) < OUTLIER_CHANNEL_FRACTION
    channel_gain = torch.where(outliers, OUTLIER_CHANNEL_GAIN, 1.0)  # [hkv, d]
    # Channel 0 of Q and K when a logit offset is asked for: q0 * k0 * scale = offset.
    offset_channel = math.sqrt(abs(case.logit_offset) / case.scale)
    offset_sign = math.copysign(1.0, case.logit_offset)

    kv_dtype = case.kv_torch_dtype
    kv_cache = _cache_view(case, fill, where)
    shared = case.shared_blocks or (0,) * case.batch_size
    for n, seq_slots, first in zip(case.kv_lens, slots, shared):
        slot = torch.tensor(seq_slots, dtype=torch.int64, device=where)
        block, offset = slot // bs, slot % bs  # [n] each
        k = torch.randn(n, hkv, d, generator=gen, device=where) * channel_gain * case.qk_magnitude
        v = torch.randn(n, hkv, dv, generator=gen, device=where) * case.v_magnitude
        if case.logit_offset:
            k[..., 0] = offset_channel
        if case.latent_cache:  # MLA: V is K's first dv channels (v's draws keep Q's stream)
            v = k[..., :dv]
        own = slice(first * bs, n)  # a shared block holds the K/V its first owner wrote
        kv_cache[block[own], 0, offset[own], :, :d] = store(k[own], case.k_scale, kv_dtype)
        kv_cache[block[own], 1, offset[own], :, :dv] = store(v[own], case.v_scale, kv_dtype)
    if tail_poison == "stale":
        stale_gen = torch.Generator(device=where).manual_seed(case.seed + 2)
        for n, table in zip(case.kv_lens, tables):
            free = -n % bs  # unused slots at the end of the last block
            if free:
                stale = STALE_SCALE * torch.randn(free, hkv, dv, generator=stale_gen,
                                                  device=where)
                kv_cache[table[-1], 1, bs - free :, :, :dv] = store(stale, case.v_scale,
                                                                    kv_dtype)

    drawn = torch.randn(case.total_q, case.num_q_heads, d, generator=gen,
                        device=where) * case.qk_magnitude
    if case.logit_offset:
        drawn[..., 0] = offset_sign * offset_channel
    q = _query_buffer(case, poison_value(case.poison, dtype), where)
    q.copy_(_rounded(drawn, dtype))
    sinks = None
    if case.sinks:
        sinks = SINK_LOW + (SINK_HIGH - SINK_LOW) * torch.rand(
            case.num_q_heads, generator=gen, device=where
        )  # [num_q_heads] float32
    block_tables = torch.full(
        (case.batch_size, case.max_blocks_per_seq), padding_block, dtype=torch.int32
    )
    for i, table in enumerate(tables):
        block_tables[i, : len(table)] = torch.tensor(table, dtype=torch.int32)
    small = lambda t: t.to(where)  # noqa: E731  (tables and lengths: built on the host)
    q_lens = torch.tensor(case.q_lens_or_decode, dtype=torch.int32)
    cu_seqlens_q = torch.zeros(case.batch_size + 1, dtype=torch.int32)
    cu_seqlens_q[1:] = torch.cumsum(q_lens, 0)
    inputs = PagedInputs(
        case=case,
        q=q,
        kv_cache=kv_cache,
        block_tables=small(block_tables),
        kv_lens=small(torch.tensor(case.kv_lens, dtype=torch.int32)),
        cu_seqlens_q=small(cu_seqlens_q),
        slot_mapping=small(torch.tensor([s for seq in slots for s in seq], dtype=torch.int64)),
        padding_block=padding_block,
        alibi_slopes=small(alibi_slopes(case.num_q_heads)) if case.alibi else None,
        sinks=sinks,
    )
    return inputs if resolve_device(device).type == "cpu" else inputs.to(device)


def unshare_blocks(inputs: PagedInputs) -> PagedInputs:
    """The same problem with every shared block copied to a fresh block of its own: each
    table entry that repeats a block an earlier entry (of any sequence) already uses is
    pointed to a copy of that block appended after the pool. The logical K/V, the truth
    and every other tensor are unchanged; the case is ``inputs.case`` with
    ``shared_blocks`` cleared and ``num_blocks`` the new pool's size. For the metamorphic
    check that sharing changes no output bit of a batch-invariant kernel.

    Returns
    -------
    PagedInputs
        ``kv_cache : Tensor[num_blocks + copies, 2, block_size, num_kv_heads,
        cache_head_dim]`` (contiguous), new ``block_tables`` and ``slot_mapping``.

    Raises
    ------
    PagedTypeError
        If ``inputs`` is not a :class:`PagedInputs`.
    """
    if not isinstance(inputs, PagedInputs):
        raise PagedTypeError("inputs", inputs, "a PagedInputs (see materialize)")
    case, bs = inputs.case, inputs.case.block_size
    cache = inputs.kv_cache.cpu()
    tables = inputs.block_tables.cpu().tolist()
    seen: set[int] = set()
    copies: list[int] = []
    for row, used in zip(tables, case.blocks_per_seq):
        for j in range(used):
            if row[j] in seen:
                copies.append(row[j])
                row[j] = cache.shape[0] + len(copies) - 1
            seen.add(row[j])
    fresh = torch.cat([cache, cache[copies]]) if copies else cache.clone()
    slots = [row[t // bs] * bs + t % bs for row, n in zip(tables, case.kv_lens)
             for t in range(n)]
    unshared = case.with_(shared_blocks=None, num_blocks=fresh.shape[0])
    device = inputs.device
    return PagedInputs(
        case=unshared, q=inputs.q, kv_cache=fresh.to(device),
        block_tables=torch.tensor(tables, dtype=torch.int32, device=device),
        kv_lens=inputs.kv_lens, cu_seqlens_q=inputs.cu_seqlens_q,
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        padding_block=inputs.padding_block, alibi_slopes=inputs.alibi_slopes,
        sinks=inputs.sinks)
