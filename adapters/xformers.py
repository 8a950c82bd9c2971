"""xformers' paged attention: ``memory_efficient_attention_forward`` with a paged bias (CUDA).

``xformers`` calls ``xformers.ops.fmha.memory_efficient_attention_forward(q, k, v,
attn_bias=PagedBlockDiagonalCausalWithOffsetPaddedKeysMask, scale=, op=)`` with the op
pinned to xformers' own paged kernel, ``triton_splitk.FwOp`` ("triton_splitKF"); left to
the dispatcher (``fmha/dispatch.py``) the kernel, and its limits, would depend on batch
size and head counts. Sources: ``xformers/ops/fmha/attn_bias.py`` and ``triton_splitk.py``
of xformers 0.0.35, ``tests/test_mem_eff_attention.py::paged_attention_run_inner`` at
commit ca6d2aa.

- K/V: the pool flattened to ``[1, num_blocks * block_size, G, H, D]`` (BMGHK: ``G =
  num_kv_heads``, ``H = num_q_heads / num_kv_heads``, the KV head expanded with stride 0);
  token ``t`` of sequence ``b`` is row ``block_tables[b, t // block_size] * block_size + t
  % block_size`` (:func:`xformers_paged`). Queries: packed ``[1, total_q, G, H, D]``.
- The bias: ``from_seqlens(q_seqlen, kv_seqlen, block_tables, page_size)``, causal
  bottom-right per sequence (:func:`paged_bias`).

Limits, from ``triton_splitk.FwOp``: compute capability 8.0, fp16/bf16, head_dim in {16,
32, 64, 128, 256, 512}, block size a multiple of 64 (``BLOCK_N``); with a causal bias one
query length for all sequences, at most 16 (:meth:`XformersSplitK.why_unsupported`). No
sliding window (no paged local bias in 0.0.35), no soft cap.

The Triton split-k kernel needs none of xformers' compiled C++/CUDA ops (``_C.so``), which
load only beside the torch and CUDA runtime the wheel was built for (0.0.35:
``libcudart.so.12``); whether they loaded is recorded (``cpp_extensions`` in the listing's
details and each result's ``impl_details``: :func:`cpp_extensions_status`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from pagedbench.reference import PagedCase, PagedInputs

from .base import MultipleOf, Prepared
from .cuda_probe import CudaPeerAdapter, PeerUnusable, cuda_capabilities, installed_distribution

INSTALL = "pip install 'pagedbench[xformers]'"
#: triton_splitk's ``BLOCK_N``: paged block sizes must be multiples of it.
SPLITK_BLOCK_N = 64
#: triton_splitk: "Query length should not be larger than 16 for causal ... biases".
SPLITK_MAX_CAUSAL_Q_LEN = 16

CAPABILITIES = cuda_capabilities(
    head_dims=frozenset({16, 32, 64, 128, 256, 512}),
    block_sizes=frozenset({MultipleOf(SPLITK_BLOCK_N)}),
    modes=frozenset({"decode", "prefill"}),
    min_compute_capability=(8, 0),
)


@dataclass(frozen=True)
class XformersPagedInputs:
    """A case in xformers' paged layout, before the bias object is built.

    Attributes
    ----------
    q : Tensor[1, total_q, num_kv_heads, num_q_heads // num_kv_heads, head_dim]
        A view of the canonical ``q`` (BMGHK).
    k, v : Tensor[1, num_blocks * block_size, num_kv_heads, num_q_heads // num_kv_heads, head_dim]
        The canonical K and V made contiguous, flattened over blocks, the KV head
        expanded (stride 0) over its query heads.
    q_seqlen : list[int]
        Queries per sequence (``[batch]``).
    kv_seqlen : list[int]
        Keys per sequence (``[batch]``), the canonical ``kv_lens``.
    block_tables : Tensor[batch, max_blocks_per_seq], int32
    page_size : int
        The case's ``block_size``.
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    q_seqlen: list[int]
    kv_seqlen: list[int]
    block_tables: torch.Tensor
    page_size: int


#: Longest reason recorded for xformers' C++/CUDA ops not loading (characters).
MAX_STATUS_CHARS = 300


def cpp_extensions_status() -> str:
    """``"loaded"`` when ``import xformers`` loaded its compiled ops (``_C.so``), else
    ``"not loaded: "`` and why (the loader's error, e.g. a missing ``libcudart.so.12``),
    from ``xformers._cpp_lib._cpp_library_load_exception``."""
    from xformers import _cpp_lib

    error = _cpp_lib._cpp_library_load_exception
    if error is None:
        return "loaded"
    cause = error.__cause__ or error
    text = " ".join(str(cause).split()) or type(cause).__name__
    return f"not loaded: {type(cause).__name__}: {text}"[:MAX_STATUS_CHARS]


def xformers_paged(inputs: PagedInputs) -> XformersPagedInputs:
    """Convert canonical inputs to xformers' paged BMGHK layout (plain torch, no copies of Q)."""
    case = inputs.case
    groups, per_group, d = case.num_kv_heads, case.gqa_ratio, case.head_dim
    rows = case.pool_blocks * case.block_size

    def flat(cache: torch.Tensor) -> torch.Tensor:
        # [num_blocks, block_size, hkv, d] -> [1, num_blocks * block_size, hkv, ratio, d]
        return cache.contiguous().view(1, rows, groups, 1, d).expand(1, rows, groups,
                                                                     per_group, d)

    cu = inputs.cu_seqlens_q.tolist()
    return XformersPagedInputs(
        q=inputs.q.view(1, case.total_q, groups, per_group, d),  # [1, total_q, G, H, D]
        k=flat(inputs.k_cache),
        v=flat(inputs.v_cache),
        q_seqlen=[end - start for start, end in zip(cu, cu[1:])],
        kv_seqlen=inputs.kv_lens.tolist(),
        block_tables=inputs.block_tables.to(torch.int32).contiguous(),
        page_size=case.block_size,
    )


def paged_bias(paged: XformersPagedInputs):
    """xformers' causal paged bias for ``paged``, on the device of its block tables.

    Returns
    -------
    xformers.ops.fmha.attn_bias.PagedBlockDiagonalCausalWithOffsetPaddedKeysMask
        Built with ``from_seqlens(q_seqlen, kv_seqlen, block_tables, page_size)``.

    Raises
    ------
    ImportError
        If xformers is not installed.
    """
    from xformers.ops.fmha.attn_bias import PagedBlockDiagonalCausalWithOffsetPaddedKeysMask

    return PagedBlockDiagonalCausalWithOffsetPaddedKeysMask.from_seqlens(
        q_seqlen=paged.q_seqlen,
        kv_seqlen=paged.kv_seqlen,
        block_tables=paged.block_tables,
        page_size=paged.page_size,
        device=paged.block_tables.device,
    )


class XformersSplitK(CudaPeerAdapter):
    """xformers' paged attention through its Triton split-K kernel."""

    name = "xformers"
    description = "xformers memory_efficient_attention_forward, paged bias, triton_splitKF (CUDA)"
    CAPABILITIES = CAPABILITIES
    peer_module = "xformers"
    install = INSTALL

    def why_unsupported(self, case: PagedCase, device: str) -> list[str]:
        """:data:`CAPABILITIES`' reasons, plus triton_splitk's rule for causal biases:
        every sequence has the same number of queries, at most 16."""
        reasons = super().why_unsupported(case, device)
        q_lens = set(case.q_lens_or_decode)
        if len(q_lens) > 1:
            reasons.append(f"q_lens {sorted(q_lens)} differ; triton_splitKF's causal bias "
                           "needs one query length for all sequences")
        if max(q_lens) > SPLITK_MAX_CAUSAL_Q_LEN:
            reasons.append(f"q_len {max(q_lens)} > {SPLITK_MAX_CAUSAL_Q_LEN}, triton_splitKF's "
                           "limit with a causal bias")
        return reasons

    def import_peer(self, device: str) -> dict[str, str]:
        from xformers.ops.fmha import triton_splitk

        if installed_distribution("triton") is None:
            raise PeerUnusable("its triton_splitKF kernel needs triton, which is not "
                               "installed")
        return {"op": triton_splitk.FwOp.NAME, "cpp_extensions": cpp_extensions_status()}

    def prepare(self, inputs: PagedInputs) -> Prepared:
        from xformers.ops.fmha import memory_efficient_attention_forward, triton_splitk

        paged = xformers_paged(inputs)
        call = functools.partial(
            memory_efficient_attention_forward,
            paged.q, paged.k, paged.v,
            attn_bias=paged_bias(paged),
            scale=inputs.scale,
            op=triton_splitk.FwOp,
        )  # returns [1, total_q, G, H, D]
        return Prepared(call, out_shape=tuple(inputs.q.shape),
                        facts={"cpp_extensions": cpp_extensions_status()})
