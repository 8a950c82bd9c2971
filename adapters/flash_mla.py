"""FlashMLA, DeepSeek's MLA decoding kernel (CUDA, SM90 only): ``flash-mla``.

``flash_mla.flash_mla_with_kvcache`` (dense decoding) reads a latent cache (:mod:`.latent`)
``[num_blocks, 64, 1, 576]`` through the canonical int32 block table and ``cache_seqlens``,
with the queries as ``[batch, seq_len_q, num_q_heads, 576]``; it returns the output
``[batch, seq_len_q, num_q_heads, 512]`` and the log-sum-exp. ``get_mla_metadata(
cache_seqlens, seq_len_q * num_q_heads // num_kv_heads, num_kv_heads)`` is called in
``prepare``: the interface until 2026-01 (FlashMLA 082094b) plans there and returns
tensors; the current one returns an empty ``FlashMLASchedMeta`` that the first call fills
(inside the timer's warm-up calls), and ignores its arguments. Sources: deepseek-ai/FlashMLA
at commit 9241ae3, ``flash_mla/flash_mla_interface.py``, ``csrc/api/dense_decode.h``,
``tests/test_flash_mla_dense_decoding.py``.

Limits, from ``dense_decode.h`` and the test: SM90a only ("Dense decode MLA is only
supported on SM90a architecture"); bfloat16 or float16; head_dim 576 (or 512) and
head_dim_v 512; page_block_size 64; every sequence the same number of queries (the query
is ``[batch, seq_len_q, ...]``; the test runs 1, 2 and 4, causal bottom-right aligned);
``cache_seqlens`` 0 gives zero rows (the test's ``have_zero_seqlen_k``). The kernel's mask
holds for any ``seq_len_q``; the test runs 1, 2 and 4, so longer equal ``q_lens`` are for
the conformance suite to judge. FlashMLA is not on PyPI: it is built from its repository
on a Hopper machine.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from pagedbench.reference import PagedCase, PagedInputs

from .base import Prepared
from .cuda_probe import CudaPeerAdapter, cuda_capabilities
from .latent import latent_cache

INSTALL = ("build it from github.com/deepseek-ai/FlashMLA (`pip install -v .` in its "
           "checkout; SM90, CUDA 12.8 or newer)")
#: ``dense_decode.h``: "Currently page_block_size must be 64".
PAGE_BLOCK_SIZE = 64

CAPABILITIES = cuda_capabilities(
    head_dims=frozenset({576}),
    v_head_dims=frozenset({512}),
    block_sizes=frozenset({PAGE_BLOCK_SIZE}),
    modes=frozenset({"decode", "prefill"}),
    features=frozenset({"head_dim_v", "empty_kv"}),
    needs_latent_cache=True,
    min_compute_capability=(9, 0),
    max_compute_capability=(9, 0),
    notes={"max_compute_capability": "dense decoding is built for SM90a only"},
)


@dataclass(frozen=True)
class FlashMlaArguments:
    """A latent case's arguments to ``flash_mla_with_kvcache``.

    Attributes
    ----------
    q : Tensor[batch, seq_len_q, num_q_heads, head_dim], case dtype
        A view of the packed queries (sequence ``i``'s ``seq_len_q`` rows in order).
    k_cache : Tensor[num_blocks, block_size, 1, head_dim], case dtype
        The latent cache (:func:`~.latent.latent_cache`); V is its first ``head_dim_v``
        channels.
    block_table : Tensor[batch, max_blocks_per_seq], int32
    cache_seqlens : Tensor[batch], int32
        ``kv_lens``.
    head_dim_v : int
    """

    q: torch.Tensor
    k_cache: torch.Tensor
    block_table: torch.Tensor
    cache_seqlens: torch.Tensor
    head_dim_v: int


def uneven_q_lens(case: PagedCase) -> str | None:
    """Why FlashMLA cannot take ``case``'s queries (they are not ``[batch, seq_len_q]``),
    or None when every sequence has the same ``q_len``."""
    q_lens = case.q_lens_or_decode
    if len(set(q_lens)) == 1:
        return None
    return (f"q_lens {list(q_lens)} not supported (supported: the same q_len for every "
            "sequence: FlashMLA's query is [batch, seq_len_q, num_q_heads, head_dim])")


def flash_mla_arguments(inputs: PagedInputs) -> FlashMlaArguments:
    """Convert a latent case's canonical inputs to FlashMLA's (plain torch, no copy of q).

    Raises
    ------
    ValueError
        If the case has no latent cache, or its ``q_lens`` differ (:func:`uneven_q_lens`).
    """
    case = inputs.case
    if not case.latent_cache:
        raise ValueError("FlashMLA takes a latent_cache case (V is K's first channels)")
    if (reason := uneven_q_lens(case)) is not None:
        raise ValueError(reason)
    seq_len_q = case.q_lens_or_decode[0]
    return FlashMlaArguments(
        q=inputs.q.view(case.batch_size, seq_len_q, case.num_q_heads, case.head_dim),
        k_cache=latent_cache(inputs),
        block_table=inputs.block_tables.to(torch.int32).contiguous(),
        cache_seqlens=inputs.kv_lens.to(torch.int32).contiguous(),
        head_dim_v=case.v_head_dim,
    )


def _output(call: functools.partial) -> torch.Tensor:
    """The output of ``flash_mla_with_kvcache``'s ``(out, softmax_lse)``."""
    return call()[0]


class FlashMla(CudaPeerAdapter):
    """FlashMLA's dense decoding (``flash_mla_with_kvcache``) on the latent cache."""

    name = "flash-mla"
    description = "FlashMLA dense decoding, latent cache 576/512, block size 64 (CUDA, SM90)"
    CAPABILITIES = CAPABILITIES
    peer_module = "flash_mla"
    install = INSTALL

    def import_peer(self, device: str) -> dict[str, str]:
        from flash_mla import flash_mla_with_kvcache, get_mla_metadata  # noqa: F401

        return {"kernel": "flash_mla_with_kvcache (dense decoding)"}

    def why_unsupported(self, case: PagedCase, device: str) -> list[str]:
        """Capability reasons (SM90 among them), and uneven ``q_lens``."""
        reasons = super().why_unsupported(case, device)
        if (reason := uneven_q_lens(case)) is not None:
            reasons.append(reason)
        return reasons

    def prepare(self, inputs: PagedInputs) -> Prepared:
        """:func:`flash_mla_arguments` and ``get_mla_metadata``; the bound call returns
        ``flash_mla_with_kvcache(..., softmax_scale=sm_scale, causal=True)``'s output."""
        from flash_mla import flash_mla_with_kvcache, get_mla_metadata

        case = inputs.case
        args = flash_mla_arguments(inputs)
        seq_len_q = args.q.shape[1]
        metadata, num_splits = get_mla_metadata(
            args.cache_seqlens, seq_len_q * case.num_q_heads // case.num_kv_heads,
            case.num_kv_heads)
        call = functools.partial(
            flash_mla_with_kvcache, args.q, args.k_cache, args.block_table,
            args.cache_seqlens, args.head_dim_v, metadata, num_splits,
            softmax_scale=inputs.scale, causal=True)
        return Prepared(functools.partial(_output, call),
                        out_shape=(case.total_q, case.num_q_heads, case.v_head_dim))
