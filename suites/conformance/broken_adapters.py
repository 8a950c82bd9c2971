"""Deliberately broken implementations: proof that the suite can fail.

Each reproduces a fault class from public paged-attention bug reports. They are not in
the built-in registry; tests register them through the ``pagedbench.adapters`` entry-point
group, exactly as an out-of-tree kernel would be.
"""

from __future__ import annotations

import os
import time
from dataclasses import replace

import torch
import torch.nn.functional as F

from pagedbench.adapters.base import Adapter, Availability, Capabilities
from pagedbench.reference import PagedInputs

_CAPS = Capabilities(devices=frozenset({"cpu", "cuda"}),
                     dtypes=frozenset({"float32", "float16", "bfloat16"}))


def _decode_through(inputs: PagedInputs, tables: torch.Tensor, extra_tokens: int) -> torch.Tensor:
    """Decode attention per sequence over ``kv_len + extra_tokens`` keys read through
    ``tables`` (``[batch, max_blocks]``)."""
    case = inputs.case
    bs = case.block_size
    out = torch.empty_like(inputs.q)
    for i, kv_len in enumerate(inputs.kv_lens.tolist()):
        n = kv_len + extra_tokens
        pos = torch.arange(n)
        blocks = tables[i, (pos // bs).clamp(max=tables.shape[1] - 1)].long()  # [n]
        k = inputs.kv_cache[blocks, 0, pos % bs]  # [n, hkv, d]
        v = inputs.kv_cache[blocks, 1, pos % bs]
        q = inputs.q[i : i + 1].transpose(0, 1)  # [hq, 1, d]
        o = F.scaled_dot_product_attention(q, k.transpose(0, 1), v.transpose(0, 1),
                                           scale=case.scale, enable_gqa=True)
        out[i] = o.transpose(0, 1)[0]
    return out


class _Broken(Adapter):
    def capabilities(self, device: str) -> Capabilities:
        return _CAPS

    def available(self, device: str = "cpu") -> Availability:
        return Availability(True, version="broken")

    def prepare(self, inputs: PagedInputs) -> PagedInputs:
        return inputs


class ReadsPastKvLen(_Broken):
    """Off by one: attends to one slot past ``kv_len`` (a classic bounds bug)."""

    name = "broken-reads-past-kv-len"

    def run(self, inputs: PagedInputs) -> torch.Tensor:
        return _decode_through(inputs, inputs.block_tables, extra_tokens=1)


class IgnoresBlockTable(_Broken):
    """Assumes sequence ``i``'s blocks are ``i * max_blocks + j`` (contiguous allocation)."""

    name = "broken-ignores-block-table"

    def run(self, inputs: PagedInputs) -> torch.Tensor:
        batch, max_blocks = inputs.block_tables.shape
        contiguous = torch.arange(batch * max_blocks).view(batch, max_blocks)  # [batch, max_blocks]
        tables = contiguous.clamp(max=inputs.kv_cache.shape[0] - 1)
        return _decode_through(inputs, tables, extra_tokens=0)


class IgnoresSmScale(_Broken):
    """Always scales by ``1 / sqrt(head_dim)``, whatever ``sm_scale`` the case sets."""

    name = "broken-ignores-sm-scale"

    def run(self, inputs: PagedInputs) -> torch.Tensor:
        default = replace(inputs, case=inputs.case.with_(sm_scale=None))
        return _decode_through(default, inputs.block_tables, extra_tokens=0)


class PerturbsLastSequence(_Broken):
    """Correct decode, except that the last sequence's output is scaled by ``1 + 2**-4``
    (8 bfloat16 ulps at each element's magnitude): one wrong sequence in a batch, as a
    kernel that mishandles one split or one block-table row would give."""

    name = "broken-perturbs-last-sequence"

    def run(self, prepared: PagedInputs) -> torch.Tensor:
        out = _decode_through(prepared, prepared.block_tables, 0)
        out[-1] = out[-1] * (1 + 2**-4)
        return out


class Aborts(_Broken):
    """Kills its process, as a kernel hitting an illegal address or an ISA abort does."""

    name = "broken-aborts"

    def run(self, inputs: PagedInputs) -> torch.Tensor:
        os.abort()


class AbortsBeforeCaseNamedAbort(ReadsPastKvLen):
    """Correct until a case named ``"abort"``, where it kills its process at once from
    ``why_unsupported``, milliseconds after the previous case's result was sent."""

    name = "broken-aborts-early"

    def why_unsupported(self, case, device: str) -> list[str]:
        if case.name == "abort":
            os.abort()
        return []

    def run(self, inputs: PagedInputs) -> torch.Tensor:
        return _decode_through(inputs, inputs.block_tables, extra_tokens=0)


class Hangs(_Broken):
    """Never returns (a deadlock)."""

    name = "broken-hangs"

    def run(self, inputs: PagedInputs) -> torch.Tensor:
        while True:
            time.sleep(1)


class ReadsPastKvLenDeclaredNanUnsafe(ReadsPastKvLen):
    """The off-by-one again, declaring ``nan_safe_tail=False``: with the stale V values
    conformance then uses in the tails (K stays NaN) it must still fail (the relaxation
    hides NaN propagation through zero weights, never attention to a slot past
    ``kv_len``)."""

    name = "broken-reads-past-kv-len-nan-unsafe"

    def capabilities(self, device: str) -> Capabilities:
        return replace(_CAPS, nan_safe_tail=False)
