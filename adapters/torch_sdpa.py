"""PyTorch SDPA baselines: ``torch-gather`` (paged) and ``sdpa-contiguous`` (not paged).

``torch-gather`` is the simplest correct paged attention: gather every sequence's blocks
through its block table into a padded dense batch, then call
``torch.nn.functional.scaled_dot_product_attention`` with GQA. ``sdpa-contiguous`` runs
the same SDPA call on K/V that are already contiguous (gathered in the untimed
``prepare``): the no-paging baseline, so the difference between the two columns is the
cost of the gather, i.e. the paging overhead (the vLLM paper, s. 7.1, reports 20-26% for
its kernel against FasterTransformer's).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagedbench.reference import PagedInputs

from .base import Adapter, Availability, Capabilities

_CAPABILITIES = Capabilities(
    devices=frozenset({"cpu", "cuda"}),
    dtypes=frozenset({"float32", "float16", "bfloat16"}),
    modes=frozenset({"decode", "prefill"}),
    features=frozenset({"sliding_window"}),
)


@dataclass(frozen=True)
class _Batch:
    """Padded, batched view of a case: what both SDPA variants feed to SDPA."""

    q: torch.Tensor  # [batch, num_q_heads, max_q, head_dim]
    mask: torch.Tensor  # [batch, 1, max_q, max_kv] bool, True = attend
    key_valid: torch.Tensor  # [batch, max_kv, 1, 1] bool, True = a live token
    q_rows: torch.Tensor  # [total_q] int64, flat index of each real query in [batch*max_q]
    scale: float


def _batch(inputs: PagedInputs) -> _Batch:
    case = inputs.case
    q_lens = torch.tensor(case.q_lens_or_decode, device=inputs.device)
    max_q = int(q_lens.max())
    max_kv = case.max_blocks_per_seq * case.block_size
    kv_lens = inputs.kv_lens.to(torch.int64)
    seq = torch.repeat_interleave(torch.arange(case.batch_size, device=inputs.device), q_lens)
    local = torch.arange(case.total_q, device=inputs.device) - inputs.cu_seqlens_q[seq]
    q_rows = seq * max_q + local  # [total_q]
    q = inputs.q.new_zeros(case.batch_size * max_q, case.num_q_heads, case.head_dim)
    q[q_rows] = inputs.q
    q = q.view(case.batch_size, max_q, case.num_q_heads, case.head_dim).transpose(1, 2)

    # Bottom-right causal: query j of sequence i sits at kv_len - q_len + j.
    pos_q = (kv_lens - q_lens)[:, None] + torch.arange(max_q, device=inputs.device)  # [b, max_q]
    pos_k = torch.arange(max_kv, device=inputs.device)  # [max_kv]
    mask = pos_k[None, None, :] <= pos_q[:, :, None]  # [b, max_q, max_kv]
    if case.sliding_window is not None:
        mask &= pos_k[None, None, :] > pos_q[:, :, None] - case.sliding_window
    key_valid = pos_k[None, :] < kv_lens[:, None]  # [b, max_kv]
    return _Batch(q, mask[:, None], key_valid[:, :, None, None], q_rows, case.scale)


def _sdpa(batch: _Batch, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """SDPA over ``k, v: [batch, max_kv, num_kv_heads, head_dim]`` -> ``[total_q, hq, d]``."""
    out = F.scaled_dot_product_attention(
        batch.q, k.transpose(1, 2), v.transpose(1, 2),
        attn_mask=batch.mask, scale=batch.scale, enable_gqa=True,
    )  # [b, hq, max_q, d]
    return out.transpose(1, 2).flatten(0, 1)[batch.q_rows]  # [total_q, hq, d]


def _gather(inputs: PagedInputs, key_valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of every sequence through the block table, ``[batch, max_kv, hkv, d]`` each.

    Slots past ``kv_len`` hold NaN poison; they are replaced by zeros with a select (they
    are masked out of the softmax, but ``0 * NaN`` would still poison the output).
    """
    pages = inputs.kv_cache[inputs.block_tables.long()]  # [b, max_blocks, 2, bs, hkv, d]
    k = pages[:, :, 0].flatten(1, 2)  # [b, max_kv, hkv, d]
    v = pages[:, :, 1].flatten(1, 2)
    zero = k.new_zeros(())
    return torch.where(key_valid, k, zero), torch.where(key_valid, v, zero)


class _TorchAdapter(Adapter):
    def capabilities(self) -> Capabilities:
        return _CAPABILITIES

    def available(self, device: str = "cpu") -> Availability:
        if torch.device(device).type == "cuda" and not torch.cuda.is_available():
            return Availability(False, "no CUDA device visible to torch", torch.__version__)
        return Availability(True, version=torch.__version__)


class TorchGather(_TorchAdapter):
    """Gather the pages through the block table, then one batched SDPA call (timed)."""

    name = "torch-gather"
    description = "gather pages through the block table, then torch SDPA with GQA"

    def prepare(self, inputs: PagedInputs) -> tuple[PagedInputs, _Batch]:
        return inputs, _batch(inputs)

    def run(self, prepared: tuple[PagedInputs, _Batch]) -> torch.Tensor:
        inputs, batch = prepared
        k, v = _gather(inputs, batch.key_valid)
        return _sdpa(batch, k, v)


class SdpaContiguous(_TorchAdapter):
    """Dense SDPA on K/V made contiguous in ``prepare``: the no-paging baseline."""

    name = "sdpa-contiguous"
    description = "torch SDPA on contiguous K/V (no paging): the paging-overhead baseline"

    def prepare(self, inputs: PagedInputs) -> tuple[_Batch, torch.Tensor, torch.Tensor]:
        batch = _batch(inputs)
        k, v = _gather(inputs, batch.key_valid)
        return batch, k.contiguous(), v.contiguous()

    def run(self, prepared: tuple[_Batch, torch.Tensor, torch.Tensor]) -> torch.Tensor:
        batch, k, v = prepared
        return _sdpa(batch, k, v)
