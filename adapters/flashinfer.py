"""FlashInfer's paged attention wrappers, in its NHD and HND cache layouts (CUDA only).

``flashinfer-nhd`` and ``flashinfer-hnd`` drive ``BatchDecodeWithPagedKVCacheWrapper``
(decode cases) and ``BatchPrefillWithPagedKVCacheWrapper`` (prefill and mixed cases):
``prepare()`` converts the inputs and calls ``plan()``; ``run()`` is one ``wrapper.run()``
into a NaN-poisoned output. Sources: FlashInfer's ``docs/tutorials/kv_layout.rst``,
``flashinfer/decode.py`` and ``flashinfer/prefill.py`` at commit fb7d242, and vLLM's
``tests/kernels/attention/test_flashinfer.py``.

- Page table: CSR ``kv_indptr [batch + 1]``, ``kv_indices``, ``kv_last_page_len [batch]``
  in ``[1, page_size]``, all int32 (the docs: "int64 can cause indexing errors";
  :func:`csr_page_table`).
- Cache: ``[num_pages, 2, page_size, num_kv_heads, head_dim]`` in ``"NHD"`` is the
  canonical layout (no copy); ``"HND"`` swaps dims 2 and 3 (:func:`to_flashinfer_cache`).
- Window ``W`` is ``window_left = W - 1`` (-1 off); the soft cap applies to scaled logits.
- ``plan()`` defaults ``q_data_type`` to float16 and the prefill ``causal`` to False: both
  are passed explicitly (tile-ai/TileOPs#734 ran bf16 through fp16 plans).

Limits (:data:`CAPABILITIES`): fp16/bf16 (no fp32 kernel); head dims 64, 128, 256 (what
FlashInfer's own test grids cover for both wrappers); any page size; compute capability
8.0 (bf16). CUDA-core decode kernels exist only for GQA group sizes 1, 2, 3, 4, 6, 8
(``DISPATCH_GQA_GROUP_SIZE``, ``include/flashinfer/utils.cuh``), so decode above ratio 4
takes the tensor-core path (``use_tensor_cores=True``), as vLLM's FlashInfer backend does.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import ClassVar

import torch

from pagedbench.reference import PagedInputs, new_output

from .base import Adapter, Availability, Capabilities, Prepared
from .cuda_probe import cuda_peer_available

KV_LAYOUTS = ("NHD", "HND")
#: Float workspace per wrapper: FlashInfer's recommended 128 MB (bytes).
WORKSPACE_BYTES = 128 * 1024 * 1024
#: Decode uses FlashInfer's tensor-core (prefill-kernel) path above this GQA ratio.
TENSOR_CORE_DECODE_MIN_RATIO = 5
INSTALL = "pip install 'pagedbench[flashinfer]'"

CAPABILITIES = Capabilities(
    devices=frozenset({"cuda"}),
    dtypes=frozenset({"float16", "bfloat16"}),
    head_dims=frozenset({64, 128, 256}),
    modes=frozenset({"decode", "prefill"}),
    features=frozenset({"sliding_window", "logits_soft_cap"}),
    min_compute_capability=(8, 0),
)


@dataclass(frozen=True)
class CsrPageTable:
    """FlashInfer's page table for a batch, in the CSR form its wrappers' ``plan`` takes
    (an indptr, the page ids, the last page's length).

    Attributes
    ----------
    indptr : Tensor[batch + 1], int32
        ``indices[indptr[i]:indptr[i + 1]]`` are sequence ``i``'s pages, in order.
    indices : Tensor[indptr[-1]], int32
        Physical page (block) ids.
    last_page_len : Tensor[batch], int32
        Tokens in each sequence's last page, in ``[1, block_size]``.
    """

    indptr: torch.Tensor
    indices: torch.Tensor
    last_page_len: torch.Tensor


def csr_page_table(
    block_tables: torch.Tensor, kv_lens: torch.Tensor, block_size: int
) -> CsrPageTable:
    """Convert padded block tables to FlashInfer's CSR page table (plain torch, any device).

    Parameters
    ----------
    block_tables : Tensor[batch, max_blocks_per_seq], int32
        Physical block of each logical block; entries past a sequence's last block are
        padding and are dropped.
    kv_lens : Tensor[batch], int32
        Tokens per sequence, each >= 1.
    block_size : int
        Tokens per block (FlashInfer's ``page_size``), >= 1.

    Returns
    -------
    CsrPageTable
        On the device of ``block_tables``, all int32.

    Raises
    ------
    ValueError
        If ``block_size`` < 1, a ``kv_lens`` entry is < 1, the shapes disagree, or a
        sequence needs more blocks than its table row holds.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if block_tables.ndim != 2 or kv_lens.shape != block_tables.shape[:1]:
        raise ValueError(
            f"block_tables must be [batch, max_blocks] and kv_lens [batch]; got "
            f"{tuple(block_tables.shape)} and {tuple(kv_lens.shape)}"
        )
    kv_lens = kv_lens.to(torch.int64)
    if bool((kv_lens < 1).any()):
        raise ValueError(f"kv_lens must all be >= 1, got {kv_lens.tolist()}")
    num_pages = (kv_lens + block_size - 1) // block_size  # [batch]
    if int(num_pages.max()) > block_tables.shape[1]:
        raise ValueError(
            f"kv_lens {kv_lens.tolist()} need up to {int(num_pages.max())} blocks of "
            f"{block_size} tokens, but block_tables has {block_tables.shape[1]} columns"
        )
    indptr = torch.zeros(len(kv_lens) + 1, dtype=torch.int64, device=block_tables.device)
    indptr[1:] = torch.cumsum(num_pages, 0)
    column = torch.arange(block_tables.shape[1], device=block_tables.device)
    live = column[None, :] < num_pages[:, None]  # [batch, max_blocks]
    indices = block_tables[live]  # [sum(num_pages)], row-major: sequence by sequence
    last_page_len = kv_lens - (num_pages - 1) * block_size  # [batch], in [1, block_size]
    return CsrPageTable(
        indptr.to(torch.int32), indices.to(torch.int32), last_page_len.to(torch.int32)
    )


def to_flashinfer_cache(kv_cache: torch.Tensor, kv_layout: str) -> torch.Tensor:
    """The canonical cache in FlashInfer's 5-D layout ``kv_layout``.

    Parameters
    ----------
    kv_cache : Tensor[num_blocks, 2, block_size, num_kv_heads, head_dim]
        Canonical (NHD) cache, K at ``[:, 0]`` and V at ``[:, 1]``.
    kv_layout : str
        ``"NHD"`` (returns ``kv_cache`` itself, no copy) or ``"HND"`` (a contiguous
        ``Tensor[num_blocks, 2, num_kv_heads, block_size, head_dim]``).

    Raises
    ------
    ValueError
        If ``kv_layout`` is not one of :data:`KV_LAYOUTS` or ``kv_cache`` is not 5-D.
    """
    if kv_layout not in KV_LAYOUTS:
        raise ValueError(f"kv_layout must be one of {KV_LAYOUTS}, got {kv_layout!r}")
    if kv_cache.ndim != 5 or kv_cache.shape[1] != 2:
        raise ValueError(
            "kv_cache must be [num_blocks, 2, block_size, num_kv_heads, head_dim], got "
            f"{tuple(kv_cache.shape)}"
        )
    if kv_layout == "NHD":
        return kv_cache
    return kv_cache.transpose(2, 3).contiguous()  # [num_blocks, 2, hkv, block_size, d]


def window_left(sliding_window: int | None) -> int:
    """FlashInfer's ``window_left`` for a window of ``sliding_window`` keys: ``W - 1``,
    or ``-1`` (no window) for ``None``.

    Raises
    ------
    ValueError
        If ``sliding_window`` is < 1.
    """
    if sliding_window is None:
        return -1
    if sliding_window < 1:
        raise ValueError(f"sliding_window must be None or >= 1, got {sliding_window}")
    return sliding_window - 1


class _FlashInfer(Adapter):
    """FlashInfer with the cache in :attr:`kv_layout`; subclasses fix the layout."""

    kv_layout: ClassVar[str]

    def capabilities(self, device: str) -> Capabilities:
        return CAPABILITIES

    def available(self, device: str = "cpu") -> Availability:
        def load() -> dict[str, str]:
            import flashinfer  # noqa: F401  (the import is the check)

            return {
                "kv_layout": self.kv_layout,
                "decode": "BatchDecodeWithPagedKVCacheWrapper(backend='auto'), tensor cores "
                          f"when num_q_heads / num_kv_heads >= {TENSOR_CORE_DECODE_MIN_RATIO}",
                "prefill": "BatchPrefillWithPagedKVCacheWrapper(backend='auto', causal=True)",
            }

        return cuda_peer_available("flashinfer", device, INSTALL, load)

    def prepare(self, inputs: PagedInputs) -> Prepared:
        """Convert the page table (:func:`csr_page_table`) and cache, then ``plan()`` the
        wrapper; the bound call is ``wrapper.run(q, cache, out=out)``."""
        import flashinfer

        case = inputs.case
        table = csr_page_table(inputs.block_tables, inputs.kv_lens, case.block_size)
        cache = to_flashinfer_cache(inputs.kv_cache, self.kv_layout)
        workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=inputs.device)
        dtype = case.torch_dtype
        options = dict(
            window_left=window_left(case.sliding_window),
            logits_soft_cap=case.logits_soft_cap,
            sm_scale=inputs.scale,
            q_data_type=dtype,
            kv_data_type=dtype,
        )
        if case.mode == "decode":
            wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                workspace, self.kv_layout,
                use_tensor_cores=case.gqa_ratio >= TENSOR_CORE_DECODE_MIN_RATIO,
            )
            wrapper.plan(table.indptr, table.indices, table.last_page_len, case.num_q_heads,
                         case.num_kv_heads, case.head_dim, case.block_size, **options)
        else:
            wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, self.kv_layout)
            wrapper.plan(inputs.cu_seqlens_q, table.indptr, table.indices,
                         table.last_page_len, case.num_q_heads, case.num_kv_heads,
                         case.head_dim, case.block_size, causal=True, **options)
        out = new_output(inputs)
        return Prepared(functools.partial(wrapper.run, inputs.q, cache, out=out), out)


class FlashInferNHD(_FlashInfer):
    """FlashInfer on the canonical cache as it is (``kv_layout="NHD"``)."""

    name = "flashinfer-nhd"
    description = "FlashInfer batch decode/prefill wrappers, NHD cache (CUDA)"
    kv_layout = "NHD"


class FlashInferHND(_FlashInfer):
    """FlashInfer on the cache converted to heads-major pages (``kv_layout="HND"``)."""

    name = "flashinfer-hnd"
    description = "FlashInfer batch decode/prefill wrappers, HND cache (CUDA)"
    kv_layout = "HND"
