"""FlexAttention's paged attention ("flex-paged"): PyTorch's own paged helper, compiled.

PyTorch ships paged attention as a layer over FlexAttention
(``torch/nn/attention/experimental/_paged_attention.py``, class ``PagedAttention``):
K and V live in one flat pool ``[1, num_kv_heads, n_pages * page_size, head_dim]``, a
``page_table[batch, n_pages]`` (int64, -1 = unused) maps each sequence's logical pages
to physical ones, and ``convert_logical_block_mask`` rewrites a block mask written in
logical positions into one over the pool, wrapping its ``mask_mod`` so that it sees
logical KV indices again and masks everything at or past ``kv_len``. The kernel is
``flex_attention`` under ``torch.compile``. Shared semantics and the anchors:
shared/research/anchors.md s. 5 and s. 9; the CPU measurements that this adapter's
limits rest on: shared/research/cpu_peers.md s. 5 and the figures below.

How the canonical inputs map onto it (all in the untimed ``prepare``):

- pool: our physical block ``p`` is Flex's page ``p`` (``page_size = block_size``,
  ``n_pages = num_blocks``), so a token's slot ``block * block_size + offset`` is also
  its address in Flex's pool. The NaN in every slot without a live token is kept: if the
  kernel reads such a slot into the output, the output turns NaN and the case fails.
- page table: written from our block tables into ``PagedAttention``'s own bookkeeping
  (``page_table``, ``physical_to_logical``, ``capacity``, ``empty_pages``), the state its
  ``reserve`` would leave had it chosen our blocks; padding entries stay -1.
- masks: one logical ``mask_mod`` per case, bottom-right causal per sequence (query ``i``
  of a sequence with ``q_len`` queries and ``kv_len`` keys sits at ``kv_len - q_len + i``),
  query rows past a sequence's ``q_len`` (padding to the longest) masked, and the sliding
  window; ``create_block_mask`` with ``BLOCK_SIZE=(128, block_size)`` (the KV block must
  equal the page size), then ``convert_logical_block_mask(..., kv_len=kv_lens)``.
- soft cap: a ``score_mod`` ``c * tanh(s / c)``; Flex applies it to the scaled scores.
- GQA: ``enable_gqa=True`` on the pool's ``num_kv_heads``.

Compilation: ``torch.compile(flex_attention, dynamic=False)``; the default
(``dynamic=None``) recompiles the second shape it meets with dynamic sizes, and that
build fails on the CPU (``CppCompileError: 'cur_kvSplitSize2' was not declared``,
cpu_peers.md s. 5). Every distinct set of static shapes and constants (batch, heads,
head_dim, padded q_len, num_blocks, block_size, dtype, sm_scale, sliding_window, soft
cap) is one *shape family* and costs one compilation. TorchDynamo keeps the compiled
families as cache entries of ``flex_attention``'s code object, shared by every
``torch.compile`` wrapper of it in the process (measured: a second wrapper reuses the
first one's entry), and after ``torch._dynamo.config.recompile_limit`` (8) entries it
silently falls back to the unfused eager path, which materialises scores over the whole
pool. So ``prepare`` compiles (its warm-up call) with the limits raised to
:data:`MAX_SHAPE_FAMILIES` and ``fail_on_recompile_limit_hit``, and ``run`` launches
under ``torch.compiler.set_stance("fail_on_recompile")``: a call that would compile or
fall back raises instead of being timed. Compiled CPU kernels size per-thread buffers
for the thread count at compile time (``cpp_flex_attention_template.py``: ``num_thread``
is a constant of the generated code, not guarded by Dynamo), so ``run`` refuses to
launch under a thread count other than ``prepare``'s.

Measured (torch 2.13.0+cpu, 2-core AMD EPYC with AVX-512, gcc; kv_lens multiples of
block_size; max abs error against the float64 truth, and its ratio to the naive
same-dtype error that the tolerance policy allows twice of):

- passes everywhere tried: float32 <= 9.3e-7 (ratio <= 1.8), float16 <= 9.5e-4
  (<= 0.61), bfloat16 <= 8.1e-3 (<= 1.0); block_size 1, 4, 8, 12, 15, 16, 32, 48, 64,
  128, 256; head_dim 8, 16, 32, 64, 65, 72, 80, 96, 100, 128, 256, 512; GQA ratios 1, 4,
  7, 8 (MQA); decode on both CPU templates, prefill mixed with decode, sliding window,
  soft cap, sm_scale. So no axis but the device is restricted in :data:`CAPABILITIES`.
- compilation, per shape family, with a cold inductor cache: 5 s on an idle machine
  (the first in a process 17 s), up to 30 s on a loaded one; 0.05-2.5 s from a warm
  cache. Every case of the default job is its own family but two (22 compilations,
  277 s in all on a loaded machine).
- a sequence whose last block is partly filled fails: the CPU kernel multiplies the
  masked slots' zero probabilities by their V rows (``0 * NaN = NaN``), so the NaN
  poison reaches the output (the class of pytorch/pytorch#101967 for SDPA; vLLM zeroes
  such V rows explicitly, vllm-project/vllm#641). :data:`CAPABILITIES` therefore
  declares ``nan_safe_tail=False``: conformance checks flex-paged with finite stale V
  values in those slots, and ``suites/adapters/test_flex_paged_poison.py`` pins the
  behaviour, so it shows when PyTorch changes it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from pagedbench.reference import PagedInputs

from .base import Adapter, Availability, Capabilities

#: Query rows per block of the block mask: FlexAttention's default sparse block size
#: (``_DEFAULT_SPARSE_BLOCK_SIZE`` in ``torch/nn/attention/flex_attention.py``). The KV
#: block size is not free: ``convert_logical_block_mask`` requires it to equal the page
#: size, i.e. our ``block_size``.
Q_BLOCK_SIZE = 128
#: Compiled shape families one process may hold (Dynamo's ``recompile_limit`` and
#: ``accumulated_recompile_limit`` while ``prepare`` compiles). At 5-30 s per family on
#: two cores, a run reaches it only after hours; past it ``prepare`` raises.
MAX_SHAPE_FAMILIES = 1024

#: What flex-paged declares: every axis it passed on (module docstring), on the CPU only
#: (its CUDA path, Triton templates with their own block-size rules, is not measured).
CAPABILITIES = Capabilities(
    devices=frozenset({"cpu"}),
    dtypes=frozenset({"float32", "float16", "bfloat16"}),
    modes=frozenset({"decode", "prefill"}),
    features=frozenset({"sliding_window", "logits_soft_cap"}),
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


@dataclass(frozen=True)
class _Prepared:
    """Everything ``run`` passes to the compiled kernel.

    ``q`` is ``[batch, num_q_heads, max_q_len, head_dim]`` (rows past a sequence's
    ``q_len`` are zeros and masked); ``q_seq`` and ``q_pos`` (``[total_q]``, int64) pick
    each packed query row back out of Flex's ``[batch, num_q_heads, max_q_len, head_dim]``
    output.
    """

    attend: Callable[..., torch.Tensor]
    q: torch.Tensor
    layout: FlexPagedLayout
    block_mask: Any
    score_mod: Callable[..., torch.Tensor] | None
    sm_scale: float
    q_seq: torch.Tensor
    q_pos: torch.Tensor
    num_threads: int
    first_call_ms: float


class FlexPaged(Adapter):
    """``flex_attention`` over ``PagedAttention``'s pool and page table, compiled per shape.

    ``prepare`` converts the layout (:func:`to_flex_layout`), pads the queries to the
    longest ``q_len``, builds and converts the block mask, and compiles (one warm-up call,
    timed into ``first_call_ms``); ``run`` launches the compiled kernel and picks the
    packed query rows out of its output.
    """

    name = "flex-paged"
    description = ("PyTorch FlexAttention over its PagedAttention page table and converted "
                   "block mask, torch.compile'd")

    def __init__(self) -> None:
        self._attend: Callable[..., torch.Tensor] | None = None

    def capabilities(self) -> Capabilities:
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
                                     "num_threads": str(torch.get_num_threads())})

    def prepare(self, inputs: PagedInputs) -> _Prepared:
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

        max_q = max(case.q_lens_or_decode)
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
        q = inputs.q.new_zeros(case.batch_size, max_q, case.num_q_heads, case.head_dim)
        q[seq, local] = inputs.q  # [batch, max_q, hq, d] <- [total_q, hq, d]
        q = q.transpose(1, 2).contiguous()  # [batch, hq, max_q, d]

        if self._attend is None:
            self._attend = torch.compile(flex_attention, dynamic=False)
        prepared = _Prepared(self._attend, q, layout, block_mask, score_mod, case.scale,
                             seq, local, torch.get_num_threads(), 0.0)
        limits = torch._dynamo.config.patch(
            recompile_limit=MAX_SHAPE_FAMILIES,
            accumulated_recompile_limit=MAX_SHAPE_FAMILIES,
            fail_on_recompile_limit_hit=True,
        )
        with limits:
            start = time.perf_counter()
            self._launch(prepared)
            first_call_ms = (time.perf_counter() - start) * 1e3
        return replace(prepared, first_call_ms=first_call_ms)

    @staticmethod
    def _launch(prepared: _Prepared) -> torch.Tensor:
        layout = prepared.layout
        return prepared.attend(
            prepared.q, layout.k_cache, layout.v_cache, score_mod=prepared.score_mod,
            block_mask=prepared.block_mask, scale=prepared.sm_scale, enable_gqa=True,
        )  # [batch, hq, max_q, d]

    def run(self, prepared: _Prepared) -> torch.Tensor:
        """Launch the compiled kernel; ``Tensor[total_q, num_q_heads, head_dim]``, case dtype.

        Raises
        ------
        RuntimeError
            If the thread count changed since ``prepare``, or the call would compile.
        """
        if torch.get_num_threads() != prepared.num_threads:
            raise RuntimeError(
                f"torch.get_num_threads() is {torch.get_num_threads()} but the kernel was "
                f"compiled for {prepared.num_threads}; call prepare() again"
            )
        with torch.compiler.set_stance("fail_on_recompile"):
            out = self._launch(prepared)
        return out[prepared.q_seq, :, prepared.q_pos]  # [total_q, hq, d]
