"""FlashAttention's paged kernels: FA2 (``flash_attn``) and FA3 (``flash_attn_3``), CUDA only.

``flash-attn2`` runs decode cases through ``flash_attn_with_kvcache(..., block_table=)``
and prefill/mixed cases through ``flash_attn_varlen_func(..., block_table=)``;
``flash-attn3`` runs every case through FA3's ``flash_attn_with_kvcache(...,
page_table=, cu_seqlens_q=)``, which takes packed variable-length queries. ``prepare()``
builds every argument; ``run()`` is the one call.

Conventions (sources: ``flash_attn/flash_attn_interface.py``,
``hopper/flash_attn_interface.py`` and ``csrc/flash_attn/flash_api.cpp`` of
Dao-AILab/flash-attention at commit 0251105; anchors s. 4.1):

- Paged K and V are separate tensors ``[num_blocks, page_block_size, num_kv_heads,
  head_dim]`` with a contiguous last dimension: the canonical cache's ``[:, 0]`` and
  ``[:, 1]`` made contiguous (:func:`flash_attn_paged`).
- ``block_table`` / ``page_table`` ``[batch, max_blocks_per_seq]`` int32 and
  ``cache_seqlens`` ``[batch]`` int32 are the canonical ``block_tables`` and ``kv_lens``;
  FA2's varlen path takes key lengths as prefix sums instead, ``cu_seqlens_k [batch + 1]``
  int32 (``seqlen_k = cu_seqlens_k[i + 1] - cu_seqlens_k[i]``, ``block_info.h``).
- Causal masks are aligned bottom-right ("If causal=True, the causal mask is aligned to
  the bottom right corner"), as in the reference.
- A window ``W`` is ``window_size = (W - 1, 0)``: query ``i`` sees keys in ``[i + s_k -
  s_q - left, i + s_k - s_q + right]``; ``(-1, -1)`` is no window.
- ``softcap = c`` caps the scaled logits, ``0.0`` turns it off.
- The log-sum-exp FlashAttention can return is natural-log (``softmax_lse``); the adapter
  contract returns only the output.

Limits declared: fp16/bf16; head_dim a multiple of 8 up to 256 (``flash_api.cpp``:
"head_size <= 256", "multiple of 8"); FA2 needs a block size divisible by 256
(``flash_api.cpp``: "Paged KV cache block size must be divisible by 256") and compute
capability 8.0 ("FlashAttention only supports Ampere GPUs or newer"); FA3 takes any block
size ("page_block_size can be arbitrary (e.g, 1, 2, 3, 64, etc.)";
Dao-AILab/flash-attention#1627) and is built for Hopper (README: "Requirements: H100 /
H800 GPU"), so 9.0.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass

import torch

from pagedbench.reference import PagedInputs

from .base import Adapter, Availability, Capabilities, MultipleOf
from .cuda_probe import probe_cuda_peer

#: head_dim values FlashAttention accepts: multiples of 8 up to 256.
HEAD_DIMS = frozenset(range(8, 257, 8))
#: FA2's paged block-size rule (``flash_api.cpp``).
FA2_BLOCK_SIZE_MULTIPLE = 256

FA2_CAPABILITIES = Capabilities(
    devices=frozenset({"cuda"}),
    dtypes=frozenset({"float16", "bfloat16"}),
    head_dims=HEAD_DIMS,
    block_sizes=frozenset({MultipleOf(FA2_BLOCK_SIZE_MULTIPLE)}),
    modes=frozenset({"decode", "prefill"}),
    features=frozenset({"sliding_window", "logits_soft_cap"}),
    min_compute_capability=(8, 0),
)
FA3_CAPABILITIES = Capabilities(
    devices=frozenset({"cuda"}),
    dtypes=frozenset({"float16", "bfloat16"}),
    head_dims=HEAD_DIMS,
    modes=frozenset({"decode", "prefill"}),
    features=frozenset({"sliding_window", "logits_soft_cap"}),
    min_compute_capability=(9, 0),
)


def window_size(sliding_window: int | None) -> tuple[int, int]:
    """FlashAttention's ``window_size`` for a causal window of ``sliding_window`` keys:
    ``(W - 1, 0)``, or ``(-1, -1)`` (no window) for ``None``.

    Raises
    ------
    ValueError
        If ``sliding_window`` is < 1.
    """
    if sliding_window is None:
        return (-1, -1)
    if sliding_window < 1:
        raise ValueError(f"sliding_window must be None or >= 1, got {sliding_window}")
    return (sliding_window - 1, 0)


@dataclass(frozen=True)
class FlashAttnPaged:
    """A case's arguments in FlashAttention's paged layout (shared with vLLM's fork).

    Attributes
    ----------
    k_cache, v_cache : Tensor[num_blocks, block_size, num_kv_heads, head_dim], case dtype
        Contiguous copies of the canonical ``kv_cache[:, 0]`` and ``kv_cache[:, 1]``.
    block_table : Tensor[batch, max_blocks_per_seq], int32
    cache_seqlens : Tensor[batch], int32
        Keys per sequence (``seqused_k`` in vLLM's fork).
    cu_seqlens_q : Tensor[batch + 1], int32
    cu_seqlens_k : Tensor[batch + 1], int32
        Prefix sums of ``cache_seqlens``, starting at 0 (FA2's varlen path).
    max_seqlen_q, max_seqlen_k : int
        Longest query and key run in the batch (tokens).
    window_size : tuple[int, int]
        See :func:`window_size`.
    softcap : float
        The soft cap, ``0.0`` when off.
    """

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_table: torch.Tensor
    cache_seqlens: torch.Tensor
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    window_size: tuple[int, int]
    softcap: float


def flash_attn_paged(inputs: PagedInputs) -> FlashAttnPaged:
    """Convert canonical inputs to FlashAttention's paged arguments (plain torch).

    Raises
    ------
    ValueError
        If the case's sliding window is invalid (see :func:`window_size`).
    """
    case = inputs.case
    kv_lens = inputs.kv_lens.to(torch.int32)
    cu_seqlens_k = torch.zeros(case.batch_size + 1, dtype=torch.int32, device=inputs.device)
    cu_seqlens_k[1:] = torch.cumsum(kv_lens, 0)
    return FlashAttnPaged(
        k_cache=inputs.k_cache.contiguous(),  # [num_blocks, block_size, hkv, d]
        v_cache=inputs.v_cache.contiguous(),
        block_table=inputs.block_tables.to(torch.int32).contiguous(),
        cache_seqlens=kv_lens.contiguous(),
        cu_seqlens_q=inputs.cu_seqlens_q.to(torch.int32).contiguous(),
        cu_seqlens_k=cu_seqlens_k,
        max_seqlen_q=max(case.q_lens_or_decode),
        max_seqlen_k=max(case.kv_lens),
        window_size=window_size(case.sliding_window),
        softcap=case.logits_soft_cap or 0.0,
    )


@dataclass(frozen=True)
class _Prepared:
    call: functools.partial  # the library call with every argument bound
    out_shape: tuple[int, int, int]  # (total_q, num_q_heads, head_dim)


def _missing_parameter(function, parameter: str) -> str:
    """Empty if ``function`` takes ``parameter``, else the reason it cannot be used."""
    if parameter in inspect.signature(function).parameters:
        return ""
    return f"{function.__module__}.{function.__name__} has no {parameter!r} parameter"


class FlashAttn2(Adapter):
    """FA2: ``flash_attn_with_kvcache`` for decode, ``flash_attn_varlen_func`` otherwise."""

    name = "flash-attn2"
    description = "FlashAttention 2 paged kvcache/varlen kernels (CUDA, block_size % 256)"
    install = "pip install flash-attn --no-build-isolation, which builds it from source"

    def capabilities(self) -> Capabilities:
        return FA2_CAPABILITIES

    def available(self, device: str = "cpu") -> Availability:
        found = probe_cuda_peer("flash_attn", device, FA2_CAPABILITIES.min_compute_capability,
                                self.install)
        if not found.ok:
            return found
        try:
            from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache
        except (ImportError, OSError, RuntimeError) as exc:
            return Availability(False, f"flash_attn {found.version} failed to import: {exc}",
                                found.version)
        missing = (_missing_parameter(flash_attn_varlen_func, "block_table")
                   or _missing_parameter(flash_attn_with_kvcache, "block_table"))
        if missing:
            return Availability(False, f"flash_attn {found.version}: {missing}", found.version)
        details = {**found.details, "decode": "flash_attn_with_kvcache",
                   "prefill": "flash_attn_varlen_func"}
        return Availability(True, version=found.version, details=details)

    def prepare(self, inputs: PagedInputs) -> _Prepared:
        from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache

        case = inputs.case
        paged = flash_attn_paged(inputs)
        options = dict(softmax_scale=case.scale, causal=True, window_size=paged.window_size,
                       softcap=paged.softcap)
        if case.mode == "decode":
            call = functools.partial(
                flash_attn_with_kvcache,
                inputs.q.unsqueeze(1),  # [batch, 1, num_q_heads, head_dim]
                paged.k_cache, paged.v_cache,
                cache_seqlens=paged.cache_seqlens, block_table=paged.block_table, **options,
            )
        else:
            call = functools.partial(
                flash_attn_varlen_func,
                inputs.q, paged.k_cache, paged.v_cache, paged.cu_seqlens_q,
                paged.cu_seqlens_k, paged.max_seqlen_q, paged.max_seqlen_k,
                block_table=paged.block_table, **options,
            )
        return _Prepared(call, tuple(inputs.q.shape))

    def run(self, prepared: _Prepared) -> torch.Tensor:
        return prepared.call().view(prepared.out_shape)  # [total_q, num_q_heads, head_dim]


class FlashAttn3(Adapter):
    """FA3: ``flash_attn_with_kvcache`` with ``page_table`` and packed varlen queries."""

    name = "flash-attn3"
    description = "FlashAttention 3 paged kvcache kernel, varlen queries (CUDA, Hopper)"
    install = "build it from github.com/Dao-AILab/flash-attention/tree/main/hopper"

    def capabilities(self) -> Capabilities:
        return FA3_CAPABILITIES

    def available(self, device: str = "cpu") -> Availability:
        found = probe_cuda_peer("flash_attn_3", device,
                                FA3_CAPABILITIES.min_compute_capability, self.install)
        if not found.ok:
            return found
        try:
            from flash_attn_3.flash_attn_interface import flash_attn_with_kvcache
        except (ImportError, OSError, RuntimeError) as exc:
            return Availability(False, f"flash_attn_3 {found.version} failed to import: {exc}",
                                found.version)
        missing = (_missing_parameter(flash_attn_with_kvcache, "page_table")
                   or _missing_parameter(flash_attn_with_kvcache, "cu_seqlens_q"))
        if missing:
            return Availability(False, f"flash_attn_3 {found.version}: {missing}",
                                found.version)
        details = {**found.details, "decode": "flash_attn_with_kvcache",
                   "prefill": "flash_attn_with_kvcache"}
        return Availability(True, version=found.version, details=details)

    def prepare(self, inputs: PagedInputs) -> _Prepared:
        from flash_attn_3.flash_attn_interface import flash_attn_with_kvcache

        case = inputs.case
        paged = flash_attn_paged(inputs)
        call = functools.partial(
            flash_attn_with_kvcache,
            inputs.q, paged.k_cache, paged.v_cache,
            cache_seqlens=paged.cache_seqlens, page_table=paged.block_table,
            cu_seqlens_q=paged.cu_seqlens_q, max_seqlen_q=paged.max_seqlen_q,
            softmax_scale=case.scale, causal=True, window_size=paged.window_size,
            softcap=paged.softcap,
        )
        return _Prepared(call, tuple(inputs.q.shape))

    def run(self, prepared: _Prepared) -> torch.Tensor:
        return prepared.call().view(prepared.out_shape)  # [total_q, num_q_heads, head_dim]
