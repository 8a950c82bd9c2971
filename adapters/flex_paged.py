"""FlexAttention's paged attention ("flex-paged"): PyTorch's own paged helper, compiled.

PyTorch ships paged attention as a layer over FlexAttention
(``torch/nn/attention/experimental/_paged_attention.py``, class ``PagedAttention``): K and
V in one flat pool ``[1, num_kv_heads, n_pages * page_size, head_dim]``, a
``page_table[batch, n_pages]`` (int64, -1 = unused), and ``convert_logical_block_mask``,
which rewrites a block mask over logical positions into one over the pool and masks
everything at or past ``kv_len``. The kernel is ``flex_attention`` under
``torch.compile(dynamic=False)`` (the default ``dynamic=None`` recompiles the second
shape with dynamic sizes, which fails to build on the CPU).

Mapping (all in the untimed ``prepare``): our block ``p`` is Flex's page ``p``
(:func:`to_flex_layout`, NaN kept in unused slots); one logical ``mask_mod`` per case,
bottom-right causal per sequence, padded query rows masked, plus the sliding window;
``BLOCK_SIZE=(128, block_size)`` (the KV block must equal the page size); the soft cap is
a ``score_mod``; ``enable_gqa=True``.

Compilation: each distinct set of static shapes and constants is one shape family and
one compilation; Dynamo keeps them as cache entries of ``flex_attention``'s code object
and past ``recompile_limit`` (8) silently falls back to the eager path. So ``prepare``
compiles with the limits raised to :data:`MAX_SHAPE_FAMILIES`, and ``run`` launches under
``set_stance("fail_on_recompile")`` and refuses a thread count other than ``prepare``'s
(the compiled CPU kernel's per-thread buffers are sized at compile time). On the CPU the
kernel multiplies the zero probabilities of a last block's unused slots by their V rows,
so NaN there reaches the output: ``nan_safe_tail=False``. Measurements behind these
limits: docs/flex-paged.md.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from pagedbench.reference import PagedInputs

from .base import Adapter, Availability, Capabilities, Prepared

#: Query rows per block of the block mask: FlexAttention's default sparse block size
#: (``_DEFAULT_SPARSE_BLOCK_SIZE`` in ``torch/nn/attention/flex_attention.py``). The KV
#: block size is not free: ``convert_logical_block_mask`` requires it to equal the page
#: size, i.e. our ``block_size``.
Q_BLOCK_SIZE = 128
#: Compiled shape families one process may hold (Dynamo's ``recompile_limit`` and
#: ``accumulated_recompile_limit`` while ``prepare`` compiles). At 5-30 s per family on
#: two cores, a run reaches it only after hours; past it ``prepare`` raises.
MAX_SHAPE_FAMILIES = 1024

#: What flex-paged declares: every axis it passed on (docs/flex-paged.md), on the CPU only
#: (its CUDA path, Triton templates with their own block-size rules, is not measured).
CAPABILITIES = Capabilities(
    devices=frozenset({"cpu"}),
    dtypes=frozenset({"float32", "float16", "bfloat16"}),
    modes=frozenset({"decode", "prefill"}),
    features=frozenset({"sliding_window", "logits_soft_cap", "empty_kv", "empty_q",
                        "unseen_rows"}),
    # prepare() permutes the cache into PagedAttention's pool (a copy), so views of
    # larger allocations are taken; it returns its own output (no buffer to stride).
    layouts=frozenset({"contiguous", "fused_qkv", "layer_pool", "every_other_block",
                       "layer_in_block"}),
    nan_safe_tail=False,
)


@dataclass(frozen=True)
class FlexPagedLayout:
    """The canonical cache and block tables in ``PagedAttention``'s layout.

    Attributes
    ----------
    k_cache, v_cache : Tensor[1, num_kv_heads, num_blocks * block_size, head_dim], case dtype
        Flex's pool: token slot ``block * block_size + offset`` of the canonical cache is
        address ``block * block_size + offset`` here. NaN wherever the canonical cache is.
    paged : torch.nn.attention.experimental._paged_attention.PagedAttention
        ``n_pages = num_blocks``, ``page_size = block_size``, ``max_batch_size = batch``;
        ``page_table[batch, num_blocks]`` (int64) holds each sequence's blocks in logical
        order and -1 past them, ``physical_to_logical[batch, num_blocks]`` (int64) the
        inverse (-1 for pages a sequence does not own), ``capacity[batch]`` (int64, tokens)
        the owned pages times ``block_size``, and ``empty_pages`` the blocks no sequence owns.
    """

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    paged: Any


def to_flex_layout(inputs: PagedInputs) -> FlexPagedLayout:
    """Convert the canonical cache and block tables into Flex's pool and page table.

    Parameters
    ----------
    inputs : PagedInputs
        ``kv_cache[num_blocks, 2, block_size, num_kv_heads, head_dim]`` and
        ``block_tables[batch, max_blocks_per_seq]`` (int32) are read; the first
        ``ceil(kv_lens[i] / block_size)`` entries of row ``i`` are its live blocks.

    Returns
    -------
    FlexPagedLayout

    Raises
    ------
    ValueError
        If a sequence's live blocks name one block twice (``physical_to_logical`` holds one
        logical index per page and sequence) or a block outside ``[0, num_blocks)``.
    """
    from torch.nn.attention.experimental._paged_attention import PagedAttention

    case = inputs.case
    num_blocks, _, block_size, num_kv_heads, head_dim = inputs.kv_cache.shape
    device = inputs.device
    pool_shape = (1, num_kv_heads, num_blocks * block_size, head_dim)
    # [num_blocks, block_size, hkv, d] -> [hkv, num_blocks, block_size, d] -> [1, hkv, slots, d]
    k_cache = inputs.k_cache.permute(2, 0, 1, 3).reshape(pool_shape)
    v_cache = inputs.v_cache.permute(2, 0, 1, 3).reshape(pool_shape)

    paged = PagedAttention(num_blocks, block_size, case.batch_size, device=device)
    owned = torch.zeros(num_blocks, dtype=torch.bool, device=device)
    for i, n in enumerate(case.blocks_per_seq):
        if n == 0:  # kv_len 0: no page to map
            continue
        blocks = inputs.block_tables[i, :n].to(torch.int64)  # [n] live blocks, logical order
        if int(blocks.min()) < 0 or int(blocks.max()) >= num_blocks:
            raise ValueError(
                f"block_tables[{i}] names blocks {blocks.tolist()}; allowed: 0..{num_blocks - 1}"
            )
        if blocks.unique().numel() != n:
            raise ValueError(
                f"block_tables[{i}] names a block twice among its {n} live blocks "
                f"({blocks.tolist()}); PagedAttention maps each page to one logical block"
            )
        paged.page_table[i, :n] = blocks
        paged.physical_to_logical[i, blocks] = torch.arange(n, device=device)
        paged.capacity[i] = n * block_size
        owned[blocks] = True
    paged.empty_pages = (~owned).nonzero().flatten().flip(0).tolist()
    return FlexPagedLayout(k_cache, v_cache, paged)


def _attend_rows(attend: Callable[..., torch.Tensor], q: torch.Tensor, padded: torch.Tensor,
                 layout: FlexPagedLayout, q_seq: torch.Tensor, q_pos: torch.Tensor,
                 **options: Any) -> torch.Tensor:
    """The packed queries ``q`` (``[total_q, num_q_heads, head_dim]``, read at each call)
    padded into ``padded`` (``[batch, num_q_heads, max_q_len, head_dim]``, zeros past each
    sequence's ``q_len``, masked), one ``flex_attention`` call on the pool, then the packed
    query rows of its output. ``q_seq`` and ``q_pos`` (``[total_q]``, int64) place each
    packed row; ``options`` are ``flex_attention``'s ``score_mod``, ``block_mask`` and
    ``scale``. Returns ``[total_q, num_q_heads, head_dim]``.
    """
    padded[q_seq, :, q_pos] = q  # [batch, hq, max_q, d] <- [total_q, hq, d]
    out = attend(padded, layout.k_cache, layout.v_cache,
                 enable_gqa=True, **options)  # [batch, hq, max_q, d]
    return out[q_seq, :, q_pos]  # [total_q, hq, d]


class FlexPaged(Adapter):
    """``flex_attention`` over ``PagedAttention``'s pool and page table, compiled per shape.

    ``prepare`` converts the layout (:func:`to_flex_layout`), builds and converts the block
    mask, and compiles (one warm-up call, timed into ``facts["first_call_ms"]``); ``run``
    pads the queries to the longest ``q_len``, launches the compiled kernel and picks the
    packed query rows out of its output.
    """

    name = "flex-paged"
    description = ("PyTorch FlexAttention over its PagedAttention page table and converted "
                   "block mask, torch.compile'd")

    compiles_per_shape = True

    def __init__(self) -> None:
        self._attend: Callable[..., torch.Tensor] | None = None

    def capabilities(self, device: str) -> Capabilities:
        return CAPABILITIES

    def available(self, device: str = "cpu") -> Availability:
        version = torch.__version__
        if torch.device(device).type != "cpu":
            return Availability(False, "flex-paged is measured and declared on the CPU only",
                                version)
        try:
            from torch._inductor.cpp_builder import get_cpp_compiler
            from torch.nn.attention.experimental._paged_attention import (  # noqa: F401
                PagedAttention,
            )
            from torch.nn.attention.flex_attention import flex_attention  # noqa: F401
        except ImportError as err:
            return Availability(
                False, f"FlexAttention paged helper not in torch {version}: {err}", version)
        isa = torch.backends.cpu.get_cpu_capability()
        if isa not in ("AVX2", "AVX512"):
            return Availability(
                False, f"compiled FlexAttention on the CPU needs AVX2 or AVX512; this CPU: {isa}",
                version)
        try:
            compiler = get_cpp_compiler()
        except RuntimeError as err:
            return Availability(False, f"inductor finds no C++ compiler: {err}", version)
        return Availability(True, version=version,
                            details={"cpu_isa": isa, "cxx": compiler,
                                     "num_threads": torch.get_num_threads()})

    def prepare(self, inputs: PagedInputs) -> Prepared:
        """Convert, build the block mask, compile and warm up (untimed).

        Raises
        ------
        ValueError
            If the case is unsupported (the reasons name the axis and the allowed values).
        torch._dynamo.exc.FailOnRecompileLimitHit
            If the process already holds :data:`MAX_SHAPE_FAMILIES` compiled families.
        """
        import torch._dynamo
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        case = inputs.case
        reasons = self.why_unsupported(case, str(inputs.device))
        if reasons:
            raise ValueError(f"flex-paged cannot run {case.case_id}: {'; '.join(reasons)}")
        device = inputs.device
        layout = to_flex_layout(inputs)

        q_lens = torch.tensor(case.q_lens_or_decode, dtype=torch.int64, device=device)
        kv_lens = inputs.kv_lens.to(torch.int64)
        first_pos = kv_lens - q_lens  # [batch] position of each sequence's first query
        window = case.sliding_window

        def logical_mask(b, h, q_idx, kv_idx):
            pos = first_pos[b] + q_idx
            visible = (q_idx < q_lens[b]) & (kv_idx <= pos)
            if window is not None:
                visible = visible & (kv_idx > pos - window)
            return visible

        # The dense query batch has at least one row: a batch whose every q_len is 0 would
        # give create_block_mask a Q_LEN of 0, which it cannot index (IndexError, found by
        # the search: kv_lens (1,), q_lens (0,)). The padded row is masked out
        # (q_idx < q_lens[b]) and never read back.
        max_q = max(1, *case.q_lens_or_decode)
        logical = create_block_mask(
            logical_mask, case.batch_size, None, max_q,
            case.max_blocks_per_seq * case.block_size, device=device,
            BLOCK_SIZE=(Q_BLOCK_SIZE, case.block_size),
        )
        block_mask = layout.paged.convert_logical_block_mask(logical, kv_len=kv_lens)

        score_mod = None
        if case.logits_soft_cap is not None:
            cap = case.logits_soft_cap

            def score_mod(score, b, h, q_idx, kv_idx):
                return cap * torch.tanh(score / cap)

        seq = torch.repeat_interleave(torch.arange(case.batch_size, device=device), q_lens)
        local = torch.arange(case.total_q, device=device) - inputs.cu_seqlens_q[seq]  # [total_q]
        padded = inputs.q.new_zeros(case.batch_size, case.num_q_heads, max_q, case.head_dim)

        if self._attend is None:
            self._attend = torch.compile(flex_attention, dynamic=False)
        call = functools.partial(_attend_rows, self._attend, inputs.q, padded, layout, seq, local,
                                 score_mod=score_mod, block_mask=block_mask, scale=inputs.scale)
        limits = torch._dynamo.config.patch(
            recompile_limit=MAX_SHAPE_FAMILIES,
            accumulated_recompile_limit=MAX_SHAPE_FAMILIES,
            fail_on_recompile_limit_hit=True,
        )
        with limits:
            start = time.perf_counter()
            call()
            first_call_ms = (time.perf_counter() - start) * 1e3
        return Prepared(call, facts={"num_threads": torch.get_num_threads(),
                                     "first_call_ms": first_call_ms})

    def run(self, prepared: Prepared) -> torch.Tensor:
        """Launch the compiled kernel; ``Tensor[total_q, num_q_heads, head_dim]``, case dtype.

        Raises
        ------
        RuntimeError
            If the thread count changed since ``prepare``, or the call would compile.
        """
        compiled_for = prepared.facts["num_threads"]
        if torch.get_num_threads() != compiled_for:
            raise RuntimeError(
                f"torch.get_num_threads() is {torch.get_num_threads()} but the kernel was "
                f"compiled for {compiled_for}; call prepare() again"
            )
        with torch.compiler.set_stance("fail_on_recompile"):
            return prepared.launch()
