"""The host side of pagedbench's Triton paged kernels: argument checks and launchers.

:func:`check_paged_args` validates the arguments every launcher takes (the canonical
``kv_cache[num_blocks, 2, block_size, num_kv_heads, head_dim]`` in the query dtype or
fp8, int32 ``block_tables`` and ``kv_lens``, the optional features of
:class:`PagedFeatures`), so a bad call fails with the parameter's name before anything
launches; :func:`launcher` makes a kernel's launcher from its planner, so that its
arguments are declared once. The device side: :mod:`~pagedbench.kernels.paged_features`.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TypedDict

import torch

#: Data types of Q and the output, and of K and V unless they are fp8.
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
#: fp8 element types an fp8 KV cache may hold (vLLM's ``fp8_e4m3`` and ``fp8_e5m2``).
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def launcher(plan: Callable[..., Callable[[], torch.Tensor]], name: str,
             doc: str) -> Callable[..., torch.Tensor]:
    """The launcher of a kernel from its planner, so that the arguments are declared once
    (in ``plan``): the same signature, returning a tensor; a call validates and plans
    (``plan(...)``) and launches at once (``plan(...)()``). ``name`` and ``doc`` are the
    launcher's (its documentation, with the parameters' shapes and dtypes)."""
    def launch(*args: object, **kwargs: object) -> torch.Tensor:
        return plan(*args, **kwargs)()

    launch.__name__ = launch.__qualname__ = name
    launch.__module__, launch.__doc__ = plan.__module__, doc
    launch.__signature__ = inspect.signature(plan).replace(return_annotation=torch.Tensor)
    return launch


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


class PagedFeatures(TypedDict, total=False):
    """The optional features of the paged kernels, keyword arguments of each launcher
    (declared once here; meanings in
    :func:`~pagedbench.kernels.paged_split_decode.paged_split_decode`). Absent, or
    ``None`` and ``1.0``: off."""

    sliding_window: int | None
    logits_soft_cap: float | None
    alibi_slopes: torch.Tensor | None
    sinks: torch.Tensor | None
    k_scale: float
    v_scale: float


#: Every feature of :class:`PagedFeatures`, the ``takes`` of a kernel that has them all.
ALL_FEATURES = frozenset(PagedFeatures.__annotations__)


@dataclass(frozen=True)
class PagedArgs:
    """Validated arguments of one paged-attention launch (see :func:`check_paged_args`).

    Attributes
    ----------
    k_cache, v_cache : Tensor[num_blocks, block_size, num_kv_heads, head_dim]
        Views of ``kv_cache[:, 0]`` and ``kv_cache[:, 1]`` (no copy).
    features : PagedFeatures
        Every feature, absent ones as ``None`` or ``1.0``.
    kv_fp8 : bool
        Whether the cache holds fp8 values to be multiplied by ``k_scale``/``v_scale``.
    """

    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    kv_lens: torch.Tensor
    out: torch.Tensor
    sm_scale: float
    features: PagedFeatures
    kv_fp8: bool

    @property
    def group_size(self) -> int:
        return self.q.shape[1] // self.k_cache.shape[2]

    @property
    def block_size(self) -> int:
        return self.k_cache.shape[1]

    @property
    def num_kv_heads(self) -> int:
        return self.k_cache.shape[2]

    def feature_constexprs(self) -> dict[str, bool]:
        """The ``HAS_*`` switches of the kernels."""
        f = self.features
        return {"HAS_SLIDING_WINDOW": f["sliding_window"] is not None,
                "HAS_SOFT_CAP": f["logits_soft_cap"] is not None,
                "HAS_ALIBI": f["alibi_slopes"] is not None,
                "HAS_SINKS": f["sinks"] is not None}

    def feature_args(self) -> tuple:
        """Pointer and scalar arguments of the features, in the kernels' order: alibi
        slopes, sinks (the query as a stand-in pointer when absent: never read),
        ``sm_scale * k_scale``, ``v_scale``, soft cap, window."""
        f = self.features
        return (self.q if f["alibi_slopes"] is None else f["alibi_slopes"],
                self.q if f["sinks"] is None else f["sinks"],
                self.sm_scale * f["k_scale"], f["v_scale"],
                float(f["logits_soft_cap"] or 1.0), int(f["sliding_window"] or 0))


def _check_head_vector(name: str, t: torch.Tensor | None, num_q_heads: int,
                       device: torch.device) -> None:
    if t is None:
        return
    _check(isinstance(t, torch.Tensor) and tuple(t.shape) == (num_q_heads,)
           and t.dtype == torch.float32 and t.device == device,
           f"{name} must be None or a float32 Tensor[num_q_heads={num_q_heads}] on {device}, "
           f"got {t.dtype if isinstance(t, torch.Tensor) else type(t).__name__} "
           f"{tuple(t.shape) if isinstance(t, torch.Tensor) else ''}")


def check_paged_args(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                     kv_lens: torch.Tensor, sm_scale: float, *, out: torch.Tensor | None,
                     decode: bool, features: Mapping[str, object], kernel: str,
                     takes: frozenset[str] = ALL_FEATURES) -> PagedArgs:
    """Validate what every paged kernel takes; allocate ``out`` when it is None.

    See :func:`~pagedbench.kernels.paged_split_decode.paged_split_decode` for the meaning
    of each parameter.

    Parameters
    ----------
    decode : bool
        True: ``q`` is ``[batch, num_q_heads, head_dim]``, one query token per sequence,
        and ``kv_lens`` must be ``[batch]``. False: ``q`` is ``[total_q, num_q_heads,
        head_dim]``, and how ``total_q`` splits over the batch is the launcher's to check.
    features : PagedFeatures
        The launcher's keyword arguments past ``out``.
    kernel : str
        The launcher's name, for the errors.
    takes : frozenset[str]
        The features this kernel has (:mod:`~pagedbench.kernels.paged_decode`'s: the
        window and the soft cap); the scales need ``k_scale``/``v_scale`` in it, and only
        then may ``kv_cache`` hold fp8.

    Raises
    ------
    TypeError
        If q, kv_cache, block_tables or kv_lens is not a tensor, or ``features`` names
        one the kernel does not take.
    ValueError
        Naming the parameter and the allowed values: wrong rank, shape or dtype (q one of
        float32/float16/bfloat16; kv_cache q's dtype or, with the scales in ``takes``,
        float8_e4m3fn/float8_e5m2; block_tables and kv_lens int32), mixed devices,
        sm_scale, sliding_window, logits_soft_cap, k_scale or v_scale out of range (scales
        other than 1 need an fp8 cache), alibi_slopes or sinks not float32
        ``[num_q_heads]``, or an ``out`` unlike q.
    """
    for name, t in (("q", q), ("kv_cache", kv_cache), ("block_tables", block_tables),
                    ("kv_lens", kv_lens)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    unknown = sorted(set(features) - takes)
    if unknown:
        raise TypeError(f"{kernel}() got unexpected keyword argument(s) {unknown}; its "
                        f"features are {sorted(takes)}")
    sliding_window = features.get("sliding_window")
    logits_soft_cap = features.get("logits_soft_cap")
    alibi_slopes, sinks = features.get("alibi_slopes"), features.get("sinks")
    k_scale, v_scale = features.get("k_scale", 1.0), features.get("v_scale", 1.0)
    fp8_cache = "k_scale" in takes
    rows = "batch" if decode else "total_q"
    _check(q.dim() == 3, f"q must be [{rows}, num_q_heads, head_dim] (3-D), got shape "
                         f"{tuple(q.shape)}")
    _check(q.dtype in SUPPORTED_DTYPES,
           f"q.dtype must be one of {[str(d) for d in SUPPORTED_DTYPES]}, got {q.dtype}")
    _check(kv_cache.dim() == 5 and kv_cache.shape[1] == 2,
           "kv_cache must be [num_blocks, 2, block_size, num_kv_heads, head_dim], got "
           f"shape {tuple(kv_cache.shape)}")
    kv_fp8 = fp8_cache and kv_cache.dtype in FP8_DTYPES
    _check(kv_cache.dtype == q.dtype or kv_fp8,
           f"kv_cache.dtype ({kv_cache.dtype}) must equal q.dtype ({q.dtype})"
           + (f" or be one of {[str(d) for d in FP8_DTYPES]}" if fp8_cache else ""))
    _, num_q_heads, head_dim = q.shape
    _, _, block_size, num_kv_heads, cache_head_dim = kv_cache.shape
    _check(cache_head_dim == head_dim,
           f"kv_cache head_dim ({cache_head_dim}) must equal q head_dim ({head_dim})")
    _check(min(num_q_heads, head_dim, block_size, num_kv_heads) >= 1,
           f"every dimension of q {tuple(q.shape)} and kv_cache {tuple(kv_cache.shape)} "
           "must be >= 1")
    _check(num_q_heads % num_kv_heads == 0,
           f"num_q_heads ({num_q_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    _check(block_tables.dtype == torch.int32,
           f"block_tables.dtype must be torch.int32, got {block_tables.dtype}")
    _check(kv_lens.dtype == torch.int32, f"kv_lens.dtype must be torch.int32, got {kv_lens.dtype}")
    if decode:
        batch = q.shape[0]
        _check(batch >= 1 and tuple(kv_lens.shape) == (batch,),
               f"kv_lens must be [batch={batch}] (one query token per sequence, batch >= 1), "
               f"got shape {tuple(kv_lens.shape)}")
    else:
        _check(kv_lens.dim() == 1 and kv_lens.shape[0] >= 1,
               f"kv_lens must be [batch] with batch >= 1, got shape {tuple(kv_lens.shape)}")
        batch = kv_lens.shape[0]
    _check(block_tables.dim() == 2 and block_tables.shape[0] == batch,
           f"block_tables must be [batch={batch}, max_blocks_per_seq], got shape "
           f"{tuple(block_tables.shape)}")
    devices = {t.device for t in (q, kv_cache, block_tables, kv_lens)}
    _check(len(devices) == 1, f"q, kv_cache, block_tables and kv_lens must share one device, "
                              f"got {sorted(map(str, devices))}")
    sm_scale = float(sm_scale)
    _check(math.isfinite(sm_scale) and sm_scale > 0,
           f"sm_scale must be finite and > 0, got {sm_scale}")
    _check(sliding_window is None or (isinstance(sliding_window, int)
                                      and not isinstance(sliding_window, bool)
                                      and sliding_window >= 1),
           f"sliding_window must be None or an int >= 1, got {sliding_window!r}")
    _check(logits_soft_cap is None or (math.isfinite(logits_soft_cap) and logits_soft_cap > 0),
           f"logits_soft_cap must be None or finite and > 0, got {logits_soft_cap!r}")
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        _check(isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0,
               f"{name} must be a finite float > 0, got {scale!r}")
        _check(kv_fp8 or scale == 1.0,
               f"{name}={scale} needs an fp8 kv_cache (float8_e4m3fn or float8_e5m2); with "
               f"kv_cache.dtype {kv_cache.dtype} it must be 1.0")
    _check_head_vector("alibi_slopes", alibi_slopes, num_q_heads, q.device)
    _check_head_vector("sinks", sinks, num_q_heads, q.device)
    if out is None:
        out = torch.empty_like(q)
    else:
        _check(isinstance(out, torch.Tensor) and tuple(out.shape) == tuple(q.shape)
               and out.dtype == q.dtype and out.device == q.device,
               f"out must be a tensor of q's shape {tuple(q.shape)}, dtype {q.dtype} and "
               f"device {q.device}")
    complete = PagedFeatures(sliding_window=sliding_window, logits_soft_cap=logits_soft_cap,
                             alibi_slopes=alibi_slopes, sinks=sinks, k_scale=float(k_scale),
                             v_scale=float(v_scale))
    return PagedArgs(q, kv_cache[:, 0], kv_cache[:, 1], block_tables, kv_lens, out, sm_scale,
                     complete, kv_fp8)


def check_kv_lens_fit(kv_lens: list[int], max_blocks_per_seq: int, block_size: int) -> None:
    """Each length must lie in ``[0, max_blocks_per_seq * block_size]`` (the plans read
    ``kv_lens`` on the host anyway, so they check what a kernel cannot).

    Raises
    ------
    ValueError
        Naming the first sequence out of range.
    """
    limit = max_blocks_per_seq * block_size
    for i, n in enumerate(kv_lens):
        _check(0 <= n <= limit, f"kv_lens[{i}] = {n} is outside [0, {limit}] "
                                f"(max_blocks_per_seq {max_blocks_per_seq} x block_size "
                                f"{block_size})")
