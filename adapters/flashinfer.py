"""FlashInfer's paged attention wrappers, in its NHD and HND cache layouts, and its MLA
wrapper (CUDA only).

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

``flashinfer-mla`` drives ``flashinfer.mla.BatchMLAPagedAttentionWrapper`` (``backend=
"auto"``: FA3 on SM90a, else FA2) on a latent cache (:mod:`.latent`): planned with
``MLAPlanMetadata.csr`` (the CSR page table, ``kv_len_arr`` = ``kv_lens``) and run on the
*packed* query ``[total_q, num_q_heads, 576]`` and cache ``[num_pages, page_size, 576]``,
which the wrapper splits into its 512 ``ckv`` and 64 ``kpe`` channels (flashinfer-python
0.7.0.post1, ``mla/_batch_mla/_wrapper.py``; the canonical-metadata form is new in 0.7.0).
Causal masks are bottom-right aligned (``tests/attention/test_deepseek_mla.py``'s
reference), so ``causal=True`` is our convention for decode and prefill alike.

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

from .base import Prepared
from .cuda_probe import CudaPeerAdapter, PeerUnusable, cuda_capabilities
from .latent import latent_cache

KV_LAYOUTS = ("NHD", "HND")
#: Float workspace per wrapper: FlashInfer's recommended 128 MB (bytes).
WORKSPACE_BYTES = 128 * 1024 * 1024
#: Decode uses FlashInfer's tensor-core (prefill-kernel) path above this GQA ratio.
TENSOR_CORE_DECODE_MIN_RATIO = 5
INSTALL = "pip install 'pagedbench[flashinfer]'"

CAPABILITIES = cuda_capabilities(
    head_dims=frozenset({64, 128, 256}),
    modes=frozenset({"decode", "prefill"}),
    features=frozenset({"sliding_window", "logits_soft_cap"}),
    min_compute_capability=(8, 0),
)
#: The MLA wrapper: DeepSeek's 512 + 64 latent head, the only split FlashInfer's MLA tests
#: cover (``test_deepseek_mla.py``), float16 (what those tests run) and bfloat16 (which its
#: plan accepts; its fp8 cache is not our case), any page size (1 and 16 in those tests),
#: decode and ragged prefill.
MLA_CAPABILITIES = cuda_capabilities(
    head_dims=frozenset({576}),
    v_head_dims=frozenset({512}),
    modes=frozenset({"decode", "prefill"}),
    features=frozenset({"head_dim_v"}),
    needs_latent_cache=True,
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


class _FlashInfer(CudaPeerAdapter):
    """FlashInfer with the cache in :attr:`kv_layout`; subclasses fix the layout."""

    CAPABILITIES = CAPABILITIES
    peer_module = "flashinfer"
    install = INSTALL
    kv_layout: ClassVar[str]

    def import_peer(self, device: str) -> dict[str, str]:
        import flashinfer  # noqa: F401  (the import is the check)

        return {
            "kv_layout": self.kv_layout,
            "decode": "BatchDecodeWithPagedKVCacheWrapper(backend='auto'), tensor cores "
                      f"when num_q_heads / num_kv_heads >= {TENSOR_CORE_DECODE_MIN_RATIO}",
            "prefill": "BatchPrefillWithPagedKVCacheWrapper(backend='auto', causal=True)",
        }

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


@dataclass(frozen=True)
class MlaArguments:
    """A latent case's arguments to FlashInfer's MLA wrapper.

    Attributes
    ----------
    qo_indptr : Tensor[batch + 1], int32
        ``cu_seqlens_q``: sequence ``i``'s queries are rows ``qo_indptr[i]:qo_indptr[i+1]``.
    kv_indptr, kv_indices : Tensor, int32
        The CSR page table (:func:`csr_page_table`).
    kv_len_arr : Tensor[batch], int32
        ``kv_lens``.
    kv_cache : Tensor[num_pages, page_size, head_dim], case dtype
        The packed latent cache: ``ckv`` is channels ``:head_dim_ckv``, ``kpe`` the rest.
    head_dim_ckv, head_dim_kpe : int
        ``head_dim_v`` and ``head_dim - head_dim_v`` (512 and 64 for DeepSeek).
    """

    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_len_arr: torch.Tensor
    kv_cache: torch.Tensor
    head_dim_ckv: int
    head_dim_kpe: int


def mla_arguments(inputs: PagedInputs) -> MlaArguments:
    """Convert a latent case's canonical inputs to the MLA wrapper's (plain torch).

    Raises
    ------
    ValueError
        If the case has no latent cache or more than one KV head (the wrapper's cache has
        no head axis), or as :func:`csr_page_table`.
    """
    case = inputs.case
    if not case.latent_cache or case.num_kv_heads != 1:
        raise ValueError("FlashInfer's MLA wrapper takes a latent_cache case with one KV "
                         f"head, got latent_cache={case.latent_cache}, num_kv_heads="
                         f"{case.num_kv_heads}")
    table = csr_page_table(inputs.block_tables, inputs.kv_lens, case.block_size)
    return MlaArguments(
        qo_indptr=inputs.cu_seqlens_q.to(torch.int32),
        kv_indptr=table.indptr,
        kv_indices=table.indices,
        kv_len_arr=inputs.kv_lens.to(torch.int32),
        kv_cache=latent_cache(inputs).squeeze(2),  # [num_pages, page_size, head_dim]
        head_dim_ckv=case.v_head_dim,
        head_dim_kpe=case.head_dim - case.v_head_dim,
    )


class FlashInferMla(CudaPeerAdapter):
    """FlashInfer's ``BatchMLAPagedAttentionWrapper`` on the packed latent cache."""

    name = "flashinfer-mla"
    description = "FlashInfer MLA paged wrapper, latent cache 576/512 (CUDA)"
    CAPABILITIES = MLA_CAPABILITIES
    peer_module = "flashinfer"
    install = INSTALL

    def import_peer(self, device: str) -> dict[str, str]:
        import flashinfer.mla

        if not hasattr(flashinfer.mla, "MLAPlanMetadata"):
            raise PeerUnusable("flashinfer.mla has no MLAPlanMetadata, the planning "
                               "form this adapter uses (flashinfer-python >= 0.7.0)")
        return {"wrapper": "BatchMLAPagedAttentionWrapper(backend='auto'): fa3 on "
                           "SM90a, else fa2; packed query and latent cache"}

    def prepare(self, inputs: PagedInputs) -> Prepared:
        """:func:`mla_arguments`, then ``plan()`` (causal, the case's ``sm_scale`` and
        dtype); the bound call is ``wrapper.run(query=q, kv_cache=..., out=out)``.
        ``facts``: the ``backend`` that ``"auto"`` picks on this device."""
        from flashinfer.mla import BatchMLAPagedAttentionWrapper, MLAPlanMetadata
        from flashinfer.utils import determine_mla_backend

        case = inputs.case
        args = mla_arguments(inputs)
        workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=inputs.device)
        wrapper = BatchMLAPagedAttentionWrapper(workspace)
        wrapper.plan(
            metadata=MLAPlanMetadata.csr(args.qo_indptr, args.kv_indptr, args.kv_indices,
                                         args.kv_len_arr),
            num_heads=case.num_q_heads, head_dim_ckv=args.head_dim_ckv,
            head_dim_kpe=args.head_dim_kpe, page_size=case.block_size, causal=True,
            sm_scale=inputs.scale, q_data_type=case.torch_dtype,
            kv_data_type=case.torch_dtype)
        out = new_output(inputs)
        call = functools.partial(wrapper.run, query=inputs.q, kv_cache=args.kv_cache, out=out)
        return Prepared(call, out,
                        facts={"backend": determine_mla_backend(inputs.device)})
