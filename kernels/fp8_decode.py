"""How Triton decodes fp8, code by code: a tiny kernel that loads every one of the 256
codes of an fp8 type and converts it with ``.to()``, as the paged kernels convert an fp8
KV tile (``_load_kv_tile`` in :mod:`~pagedbench.kernels.paged_features`), against torch's
``.to()`` of the same bytes.

Under Triton's interpreter (``TRITON_INTERPRET=1`` when this module is imported) the
conversion is numpy arithmetic on the bits (``_convert_float`` in
``triton/runtime/interpreter.py``), which has no case for the NaN and Inf encodings; on a
GPU it is the hardware's. ``python -m pagedbench.harness.verdict.fp8_interpreter`` writes the
table (``results/fp8-interpreter/``); :mod:`pagedbench.harness.verdict.fp8_interpreter` holds
what follows for the verdicts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

#: The fp8 types a KV cache may hold, by ``PagedCase.kv_cache_dtype``.
FP8_TYPES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
#: What a paged kernel converts an fp8 tile to: its compute types.
TARGETS = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
CODES = 256


@triton.jit
def _convert(src_ptr, dst_ptr, N: tl.constexpr):
    """``dst[i] = src[i].to(dst's type)`` for ``i < N`` (one program, ``N`` a power of 2)."""
    offsets = tl.arange(0, N)
    tl.store(dst_ptr + offsets, tl.load(src_ptr + offsets).to(dst_ptr.dtype.element_ty))


def is_interpreted() -> bool:
    """Whether :func:`triton_decode` runs under Triton's interpreter (decided at import)."""
    return isinstance(_convert, InterpretedFunction)


def torch_decode(fp8: torch.dtype, target: torch.dtype) -> torch.Tensor:
    """``Tensor[256]`` of ``target``: code ``i`` of ``fp8`` converted by torch on the CPU."""
    return torch.arange(CODES, dtype=torch.uint8).view(fp8).to(target)


def triton_decode(fp8: torch.dtype, target: torch.dtype, device: str = "cpu") -> torch.Tensor:
    """``Tensor[256]`` of ``target`` on the CPU: code ``i`` of ``fp8`` converted by Triton's
    ``.to()`` on ``device`` (``"cpu"``: the interpreter, which must be on at import)."""
    src = torch.arange(CODES, dtype=torch.uint8, device=device).view(fp8)
    dst = torch.empty(CODES, dtype=target, device=device)
    _convert[(1,)](src, dst, N=CODES)
    return dst.cpu()


def kind(value: float) -> str:
    """``"nan"``, ``"inf"``, ``"-inf"``, ``"zero"`` or ``"finite"``."""
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return "zero" if value == 0 else "finite"


@dataclass(frozen=True)
class Code:
    """One code's two decodings (float values; NaN as ``nan``)."""

    code: int
    torch_value: float
    triton_value: float

    @property
    def agrees(self) -> bool:
        """Same value and sign (``-0.0`` is not ``0.0``), or NaN in both."""
        a, b = self.torch_value, self.triton_value
        if math.isnan(a) or math.isnan(b):
            return math.isnan(a) and math.isnan(b)
        return a == b and math.copysign(1.0, a) == math.copysign(1.0, b)


def decode_table(fp8: torch.dtype, target: torch.dtype, device: str = "cpu") -> list[Code]:
    """The 256 codes of ``fp8`` decoded to ``target`` by torch and by Triton on
    ``device``."""
    ours = triton_decode(fp8, target, device).double().tolist()
    theirs = torch_decode(fp8, target).double().tolist()
    return [Code(i, t, o) for i, (t, o) in enumerate(zip(theirs, ours))]


__all__ = ["CODES", "Code", "FP8_TYPES", "TARGETS", "decode_table", "is_interpreted", "kind",
           "torch_decode", "triton_decode"]
