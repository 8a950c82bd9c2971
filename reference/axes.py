"""The values each axis of a :class:`~.case.PagedCase` may take, and the checks of one
field's type and range (every refusal a :class:`~.errors.PagedInputError` naming the field).
Names only, no torch: a case is described and checked without it (the CLI's options too);
:attr:`~.case.PagedCase.torch_dtype` turns a name into torch's dtype.
"""

from __future__ import annotations

import math

from typing import TYPE_CHECKING

from .errors import PagedTypeError, PagedValueError

if TYPE_CHECKING:
    import torch

#: Data types a case may use, by the names results and case ids carry (torch's own names:
#: ``torch.float32``, ...).
DTYPES: tuple[str, ...] = ("float32", "float16", "bfloat16")

#: KV-cache storage types, by vLLM's ``kv_cache_dtype`` names, each with the name of the
#: torch dtype it stores: ``"auto"`` stores K and V in the case dtype (``None``: "the case
#: dtype"); the fp8 types store ``x / k_scale`` (``x / v_scale``) rounded to OCP FP8
#: (E4M3 "fn": no infinities, max 448; E5M2: max 57344), as vLLM's and FlashInfer's fp8 KV
#: caches do.
KV_CACHE_DTYPES: dict[str, str | None] = {
    "auto": None,
    "fp8_e4m3": "float8_e4m3fn",
    "fp8_e5m2": "float8_e5m2",
}
#: fp8 caches' ``(k_scale, v_scale)`` the suites use: unequal, neither 1 nor each other's
#: reciprocal, so that a kernel that drops a scale, swaps the two or divides by one is off
#: by a factor of 1.6 or more, which no tolerance hides. The first pair is the serving
#: loop's. A latent cache stores V as K's first channels under one scale (``v_scale`` is
#: ``k_scale`` there).
FP8_SCALES: tuple[tuple[float, float], ...] = ((0.37, 1.6), (0.5, 0.25), (2.0, 0.75))
#: Largest ``sm_scale``, ``logits_soft_cap``, ``k_scale``, ``v_scale``, ``qk_magnitude``
#: and ``v_magnitude`` accepted: past it the logits of unit-normal inputs can overflow even
#: the float64 truth (a scale of 1e308 gives inf - inf = NaN in its softmax), so the case
#: would have no truth to judge by.
MAX_SCALE = 1e6
#: Largest ``|logit_offset|``: past the finite mask values kernels use instead of
#: ``-inf`` (-1e4, -3e4, fp16's -65504). Past about 1e4 the float32 logits every kernel
#: forms lose so much (an ulp of 3e4 is 0.002) that a correct kernel's error depends on
#: its summation order more than the tolerance allows (docs/edges.md, "The edges of the input
#: space"): such cases show a kernel's behaviour, not a verdict.
MAX_LOGIT_OFFSET = 1e5
#: How :func:`~pagedbench.reference.inputs.materialize` lays the tensors out in memory
#: (the values are the same in every layout): ``"contiguous"``; ``"fused_qkv"``: ``q`` is
#: a strided slice of a fused ``[total_q, (num_q_heads + 2 * num_kv_heads) * head_dim]``
#: QKV projection; ``"layer_pool"``: ``kv_cache`` is one layer of a ``[num_layers,
#: num_blocks, 2, ...]`` pool (a storage offset); ``"every_other_block"``: every other
#: block of a pool twice the size (block stride doubled); ``"layer_in_block"``: one layer
#: of ``[num_blocks, 2, num_layers, num_kv_heads, block_size, head_dim]`` (vLLM's
#: cross-layer layout: HND inside the block, seen through NHD strides); ``"strided_out"``:
#: the output buffer (:func:`~pagedbench.reference.inputs.new_output`) is a strided view.
LAYOUTS = ("contiguous", "fused_qkv", "layer_pool", "every_other_block", "layer_in_block",
           "strided_out")
#: What fills every slot that holds no live token (:attr:`~.case.PagedCase.poison`): NaN, +Inf,
#: -Inf, or ``"huge"``, the element type's largest finite value (a kernel that tests for
#: NaN, or clamps infinities, still reads it). fp8 E4M3 "fn" has no infinity: ``"inf"``
#: and ``"-inf"`` store its largest magnitude (448) there.
POISONS = ("nan", "inf", "-inf", "huge")


def torch_dtype(name: str) -> torch.dtype:
    """torch's dtype of a name of :data:`DTYPES` or a value of :data:`KV_CACHE_DTYPES` (torch
    is imported here alone: a case is built, checked and stored without it)."""
    import torch

    return getattr(torch, name)


def as_int(name: str, value: object) -> int:
    """``value`` as a Python int (numpy ints accepted; bools, floats and strings not).

    Raises
    ------
    PagedTypeError
        Naming ``name``, if ``value`` is not an int.
    """
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise PagedTypeError(name, value, "an int")
    return int(value.__index__())


def int_tuple(name: str, values: object) -> tuple[int, ...]:
    """``values`` (a list or tuple of ints) as a tuple of Python ints.

    Raises
    ------
    PagedTypeError
        Naming ``name``, if ``values`` is not a list or tuple, or an entry not an int.
    """
    if not isinstance(values, (list, tuple)):
        raise PagedTypeError(name, values, "a list or tuple of ints")
    return tuple(as_int(name, value) for value in values)


def positive_finite(name: str, value: object, allowed: str) -> None:
    """Refuse anything but a real number in ``(0, MAX_SCALE]`` (bools and strings
    included); ``allowed`` says what is, in the message.

    Raises
    ------
    PagedTypeError
        If ``value`` is not an int or float (a bool included).
    PagedValueError
        If it is not finite, or not in ``(0, MAX_SCALE]``.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise PagedTypeError(name, value, allowed)
    if not (math.isfinite(value) and 0 < value <= MAX_SCALE):
        raise PagedValueError(name, value, f"{allowed}, at most {MAX_SCALE:g}")


def check_one_of(name: str, value: object, allowed: list[str]) -> None:
    """Refuse anything but a str among ``allowed`` (the message lists ``allowed``).

    Raises
    ------
    PagedTypeError
        If ``value`` is not a str.
    PagedValueError
        If it is a str not among ``allowed``.
    """
    if not isinstance(value, str) or value not in allowed:
        error = PagedValueError if isinstance(value, str) else PagedTypeError
        raise error(name, value, f"one of {allowed}")


__all__ = ["DTYPES", "KV_CACHE_DTYPES", "LAYOUTS", "MAX_LOGIT_OFFSET", "MAX_SCALE", "POISONS",
           "as_int", "check_one_of", "int_tuple", "positive_finite"]
