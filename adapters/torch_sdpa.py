"""PyTorch SDPA baselines: ``torch-gather`` (paged) and ``sdpa-contiguous`` (not paged).

``torch-gather`` is the simplest correct paged attention: gather every sequence's tokens
through its block table, then call ``torch.nn.functional.scaled_dot_product_attention``
with GQA, one call per sequence (a padded, masked batch was 4x slower on the CPU).
``sdpa-contiguous`` runs the same SDPA call on K/V that are already contiguous (gathered in the untimed
``prepare``): the no-paging baseline, so the difference between the two columns is the
cost of the gather, i.e. the paging overhead (the vLLM paper, s. 7.1, reports 20-26% for
its kernel against FasterTransformer's).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from pagedbench.reference import PagedInputs
from pagedbench.reference.axes import LAYOUTS

from .base import Adapter, Availability, Capabilities, Prepared

#: Degenerate rows hold because SDPA returns 0 for a query row whose boolean mask is all
#: False (torch 2.5 and later; measured on 2.13.0, pinned by
#: suites/conformance/test_edges.py); a sequence with no key gets its zeros without SDPA,
#: whose float16 CPU kernel returns NaN over zero keys for queries near 3e3 (torch 2.13.0). One SDPA call per sequence: nothing a sequence
#: computes depends on the others, so its output is bitwise batch invariant. It reads q
#: and the cache through their strides; it returns its own output (no buffer to stride).
CAPABILITIES = Capabilities(
    devices=frozenset({"cpu", "cuda"}),
    dtypes=frozenset({"float32", "float16", "bfloat16"}),
    modes=frozenset({"decode", "prefill"}),
    features=frozenset({"sliding_window", "head_dim_v", "empty_kv", "empty_q",
                        "unseen_rows"}),
    layouts=frozenset(LAYOUTS) - {"strided_out"},
    batch_invariant=True,
    notes={"layouts": "returns its own output tensor"},
)


@dataclass(frozen=True)
class _SdpaSequence:
    """One sequence as SDPA takes it: its queries, mask and where its tokens live."""

    q: torch.Tensor  # [1, num_q_heads, q_len, head_dim]
    mask: torch.Tensor | None  # [q_len, kv_len] bool, True = attend; None for decode
    blocks: torch.Tensor  # [kv_len] int64, physical block of each token (via the table)
    offsets: torch.Tensor  # [kv_len] int64, slot of each token inside its block


def _sequences(inputs: PagedInputs) -> list[_SdpaSequence]:
    """Per-sequence queries and masks, plus each token's (block, offset) read from the
    block table. A decode query sees every key of its sequence, so it needs no mask
    (SDPA then takes its fastest path); prefill rows get the bottom-right causal mask."""
    case = inputs.case
    cu = inputs.cu_seqlens_q.tolist()
    out = []
    for i, kv_len in enumerate(case.kv_lens):
        q_len = cu[i + 1] - cu[i]
        pos_k = torch.arange(kv_len, device=inputs.device)
        pos_q = kv_len - q_len + torch.arange(q_len, device=inputs.device)
        mask = None
        if q_len > 1 or case.sliding_window is not None:
            mask = pos_k[None, :] <= pos_q[:, None]  # [q_len, kv_len], bottom-right causal
            if case.sliding_window is not None:
                mask &= pos_k[None, :] > pos_q[:, None] - case.sliding_window
        table = inputs.block_tables[i].long()
        out.append(_SdpaSequence(
            q=inputs.q[cu[i] : cu[i + 1]].transpose(0, 1)[None],  # [1, hq, q_len, d]
            mask=mask,
            blocks=table[pos_k // case.block_size],
            offsets=pos_k % case.block_size,
        ))
    return out


def _sdpa(seq: _SdpaSequence, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """SDPA of one sequence over ``k, v: [1, num_kv_heads, kv_len, head_dim]`` ->
    ``[q_len, num_q_heads, head_dim]``; zeros when there is no key."""
    if k.shape[2] == 0:
        return seq.q.new_zeros(seq.q.shape[2], seq.q.shape[1], v.shape[-1])
    out = F.scaled_dot_product_attention(seq.q, k, v, attn_mask=seq.mask, scale=scale,
                                         enable_gqa=True)  # [1, hq, q_len, d]
    return out[0].transpose(0, 1)


def _gather(inputs: PagedInputs, seq: _SdpaSequence) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of one sequence read through its block table, ``[1, hkv, kv_len, d]`` and
    ``[1, hkv, kv_len, v_head_dim]`` (only its live tokens: no slot past ``kv_len`` is
    touched)."""
    k = inputs.k_cache[seq.blocks, seq.offsets]  # [kv_len, hkv, d]
    v = inputs.v_cache[seq.blocks, seq.offsets]  # [kv_len, hkv, dv]
    return k.transpose(0, 1)[None], v.transpose(0, 1)[None]


def _gather_attend(inputs: PagedInputs, sequences: list[_SdpaSequence]) -> torch.Tensor:
    """Gather, then SDPA, sequence by sequence: ``[total_q, num_q_heads, head_dim]``."""
    return torch.cat([_sdpa(seq, *_gather(inputs, seq), inputs.scale) for seq in sequences])


def _attend(contiguous: list[tuple[_SdpaSequence, torch.Tensor, torch.Tensor]],
            scale: float) -> torch.Tensor:
    """SDPA over each sequence's contiguous ``(seq, k, v)``: ``[total_q, num_q_heads,
    head_dim]``."""
    return torch.cat([_sdpa(seq, k, v, scale) for seq, k, v in contiguous])


class _TorchAdapter(Adapter):
    def capabilities(self, device: str) -> Capabilities:
        return CAPABILITIES

    def available(self, device: str = "cpu") -> Availability:
        if torch.device(device).type == "cuda" and not torch.cuda.is_available():
            return Availability(False, "no CUDA device visible to torch", torch.__version__)
        return Availability(True, version=torch.__version__)


class TorchGather(_TorchAdapter):
    """Gather each sequence's tokens through the block table, then SDPA (both timed)."""

    name = "torch-gather"
    description = "gather pages through the block table, then torch SDPA with GQA"

    def capabilities(self, device: str) -> Capabilities:
        """:data:`CAPABILITIES`; it reads the cache in place (the gather is timed)."""
        return replace(CAPABILITIES, kv_cache_in_place=True)

    def prepare(self, inputs: PagedInputs) -> Prepared:
        """Per-sequence queries, masks and token addresses; the gather itself is timed."""
        return Prepared(functools.partial(_gather_attend, inputs, _sequences(inputs)))


class SdpaContiguous(_TorchAdapter):
    """Dense SDPA on K/V made contiguous in ``prepare``: the no-paging baseline."""

    name = "sdpa-contiguous"
    description = "torch SDPA on contiguous K/V (no paging): the paging-overhead baseline"

    def prepare(self, inputs: PagedInputs) -> Prepared:
        """Gather every sequence's K and V into contiguous tensors (untimed)."""
        contiguous = [(seq, *(t.contiguous() for t in _gather(inputs, seq)))
                      for seq in _sequences(inputs)]
        return Prepared(functools.partial(_attend, contiguous, inputs.scale))
