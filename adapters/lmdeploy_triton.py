"""LMDeploy's Triton paged-attention kernels as peers (lmdeploy 0.18.0's
``lmdeploy/pytorch/kernels/cuda/``, what its ``TritonAttentionImpl`` runs,
``pytorch/backends/cuda/attention/default.py``): ``lmdeploy-decode``
(``flash_attn_with_kvcache`` in ``pagedattention.py``) and ``lmdeploy-prefill``
(``flatten_kv_cache``, then ``flash_attn_varlen_func`` in ``flashattention.py``).

Decode is split-K flash decoding: one program per (KV head's tile of query heads,
split, sequence) over ``cdiv(kv_len, block_size)`` blocks cut into ``SPLIT_K`` parts,
then a reduce kernel merging the splits by their log-sum-exp (and adding the attention
sink). The cache is ``[num_blocks, block_size, num_kv_heads, head_dim]`` per K and V
(``bshd``), read through its strides, with the block table as ``page_table``: the
canonical cache's K and V views as they are. The window is flash-attn's left window
(keys ``>= position - window_size``), so a window of ``W`` keys is passed as ``W - 1``;
ALiBi's bias is ``-slope * (kv_len - j)``, one more than the query's distance for every
key of a row, which softmax cancels. Prefill copies each sequence's keys out of the
paged cache into a contiguous ``[num_kv_heads, tokens, head_dim]`` one (``flatten``,
part of the timed call, as in LMDeploy's ``_forward_prefill``), then runs its varlen
causal kernel; that kernel builds block pointers (``tl.make_block_ptr``), which Triton
3.9 removed (lmdeploy 0.18.0 requires ``triton<=3.7.1``): :meth:`LmdeployPrefill.available`
probes it once and says so.

The files are loaded without importing LMDeploy (:mod:`.lmdeploy_triton_load`); on the
CPU they run under Triton's interpreter (``TRITON_INTERPRET=1`` before Python starts):
float32 and float16 only (triton-lang/triton#11584), no soft cap (its ``tanh`` is
``libdevice``'s, which the interpreter lacks), within :data:`INTERPRETER_BUDGET`.
"""

from __future__ import annotations

import functools
from dataclasses import replace
from itertools import accumulate

import torch

from pagedbench.reference import PagedCase, PagedInputs
from pagedbench.reference.axes import LAYOUTS

from .base import AtLeast, Availability, Capabilities, Prepared
from .interpreted import InterpretedWork, InterpreterBudget, cdiv
from .lmdeploy_triton_load import CPU_SPLIT_K, LmdeployTritonKernels, load_kernels
from .pinned_files import PinnedFilesInvalid
from .triton_peer import PeerTritonAdapter, cached_load, triton_capabilities, window_of_one

#: Fitted on the 2-core CI host (``python docs/interpreter_cost.py lmdeploy``, 14 reduced
#: float16 presets, docs/interpreter-budget.md): 12.0 ms per program, the key steps
#: nearly free beside them (0.02 ms per weighted step); 10 s admits every reduced preset.
INTERPRETER_BUDGET = InterpreterBudget(s_per_program=0.012, s_per_step=0.00002, max_s=10.0)
#: ``flash_attn_with_kvcache`` asserts ``BLOCK >= 16`` and tiles a block with
#: ``tl.arange(0, BLOCK_N)``, so block sizes are powers of two from 16.
DECODE_BLOCK_SIZES = frozenset({16, 32, 64, 128, 256, 512})
#: ``BLOCK_H``, the query heads of one tile, is at least this (``max(16, ...)``).
MIN_HEAD_TILE = 16
#: Why the soft cap is not taken when interpreted.
SOFT_CAP_INTERPRETED = ("its tanh is tl.extra.cuda.libdevice.tanh, which Triton's "
                        "interpreter does not implement")


#: The kernels (loaded once per process), or None and why they cannot be loaded.
_loaded = cached_load(load_kernels, ((ImportError, "triton not importable"),
                                     (PinnedFilesInvalid, "LMDeploy's kernel files not usable")))


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def window_size(case: PagedCase) -> int:
    """LMDeploy's ``window_size`` for ``case``: ``W - 1`` (its window is flash-attn's left
    one, keys ``>= position - window_size``), or -1 for none."""
    return -1 if case.sliding_window is None else case.sliding_window - 1


def alibi_with_sinks(case: PagedCase) -> list[str]:
    """Why ALiBi and sinks together are not taken: LMDeploy's bias, ``-slope * (kv_len -
    j)``, is one ``slope`` lower than the query's distance for every key; softmax cancels
    that over the keys, but not against the sink's logit, which then weighs ``e^slope``
    times too much (docs/findings.md)."""
    if case.alibi and case.sinks:
        return ["alibi with sinks not supported: LMDeploy's ALiBi bias is one slope below "
                "the distance for every key, which the sink's logit does not share"]
    return []


class _LmdeployTritonAdapter(PeerTritonAdapter):
    """What the two kernels share: LMDeploy's files, loaded without importing LMDeploy."""

    rocm_reason = "the host answers cover CUDA and the CPU only"
    interpreter_budget = INTERPRETER_BUDGET

    load = staticmethod(_loaded)

    def why_unsupported(self, case: PagedCase, device: str) -> list[str]:
        return super().why_unsupported(case, device) + window_of_one(case, "LMDeploy")


class LmdeployDecode(_LmdeployTritonAdapter):
    """LMDeploy's ``flash_attn_with_kvcache``: split-K paged decode."""

    name = "lmdeploy-decode"
    description = ("LMDeploy flash_attn_with_kvcache (Triton split-K paged decode, "
                   "lmdeploy 0.18 wheel files); interpreted on the CPU")
    # From pagedattention.py: one query token per sequence (num_tokens = batch; several
    # per sequence would all see every key, no causal mask among them); head_dim split
    # into a power-of-two dot plus a rest of at least 16 channels (tl.dot's K >= 16);
    # Lk != Lv (V read with its own BLOCK_DV); window, soft cap, ALiBi, sinks (the reduce
    # kernel). Not empty_kv: a sequence with kv_len 0 returns before writing its split
    # scratch, which the reduce then reads uninitialized. nan_safe_tail False: every
    # block is loaded whole and P.V multiplies the masked keys' zero weights by the tail
    # slots' V. Layouts: q and the cache through their strides; the output is a new
    # tensor, so no strided_out.
    CAPABILITIES = triton_capabilities(
        head_dims=frozenset({AtLeast(16)}),
        block_sizes=DECODE_BLOCK_SIZES,
        modes=frozenset({"decode"}),
        features=frozenset({"sliding_window", "logits_soft_cap", "alibi", "sinks",
                            "head_dim_v"}),
        layouts=frozenset(LAYOUTS) - {"strided_out"},
        nan_safe_tail=False,
    )

    def jit_function(self, kernels: LmdeployTritonKernels) -> object:
        return kernels.decode._fwd_grouped_split_kernel

    def capabilities(self, device: str) -> Capabilities:
        """On a CPU tensor also batch-invariant (every sequence takes :data:`CPU_SPLIT_K`
        splits); interpreted, :meth:`why_unsupported` refuses the soft cap
        (:data:`SOFT_CAP_INTERPRETED`)."""
        caps = super().capabilities(device)
        if not self.is_interpreted(device):
            return caps
        return replace(caps, batch_invariant=torch.device(device).type == "cpu")

    def why_unsupported(self, case: PagedCase, device: str) -> list[str]:
        reasons = super().why_unsupported(case, device) + alibi_with_sinks(case)
        if case.logits_soft_cap is not None and self.is_interpreted(device):
            reasons.append(f"logits_soft_cap not supported interpreted: {SOFT_CAP_INTERPRETED}")
        return reasons

    def interpreter_work(self, case: PagedCase) -> InterpretedWork:
        """Stage 1: ``tiles * num_kv_heads * SPLIT_K * batch`` programs (a tile: up to
        ``BLOCK_H`` query heads of one KV head), each over its split's blocks (from the
        window's first); the reduce: one program per query head and sequence."""
        heads = case.gqa_ratio
        block_h = max(MIN_HEAD_TILE, min(case.block_size, _pow2(heads)))
        tiles = cdiv(heads, block_h) * case.num_kv_heads
        steps = 0
        for kv_len in case.kv_lens:
            blocks = cdiv(kv_len, case.block_size)
            per_split = cdiv(blocks, CPU_SPLIT_K)
            first = 0
            if case.sliding_window is not None:
                first = max(0, kv_len - case.sliding_window) // case.block_size
            for split in range(CPU_SPLIT_K):
                steps += max(0, min(blocks, (split + 1) * per_split) - max(first, split * per_split))
        programs = case.batch_size * (tiles * CPU_SPLIT_K + case.num_q_heads)
        weight = (case.head_dim + case.v_head_dim) / 128 * block_h * case.block_size / (16 * 32)
        return InterpretedWork(programs, tiles * steps, weight)

    def prepare(self, inputs: PagedInputs) -> Prepared:
        """Bind ``flash_attn_with_kvcache`` to the canonical cache's K and V views, the
        block table, ``kv_lens`` and the case's scale, window, soft cap, ALiBi slopes
        and sinks; it returns a new ``[batch, num_q_heads, v_head_dim]`` output. ``facts``:
        ``split_k`` on a CPU tensor (LMDeploy's heuristic on CUDA).

        Raises
        ------
        ValueError
            If some ``q_lens`` > 1: ``flash_attn_with_kvcache`` with ``max_seqlen_q=1`` takes one query token per sequence
            (:meth:`decode_case`).
        """
        case = self.decode_case(inputs)
        kernels = self.kernels()
        call = functools.partial(
            kernels.decode.flash_attn_with_kvcache,
            inputs.q,  # [batch, num_q_heads, head_dim]: one token per sequence
            inputs.k_cache,  # [num_blocks, block_size, num_kv_heads, head_dim]
            inputs.v_cache,
            cache_seqlens=inputs.kv_lens,
            page_table=inputs.block_tables,
            max_seqlen_q=1,
            softmax_scale=inputs.scale,
            window_size=window_size(case),
            softcap=case.logits_soft_cap,
            alibi_slopes=inputs.alibi_slopes,
            sinks=inputs.sinks,
        )
        facts = {"split_k": CPU_SPLIT_K} if inputs.device.type == "cpu" else {}
        return Prepared(call, out_shape=(case.total_q, case.num_q_heads, case.v_head_dim),
                        facts=facts)


@functools.cache
def block_pointer_failure(device: str) -> str:
    """Why ``flash_attn_varlen_func`` cannot run with the installed Triton on ``device``
    ("" when it runs): one call on a single token, once per process and device."""
    kernels, reason = _loaded()
    if kernels is None:
        return reason
    one = torch.ones(1, 1, 16, device=device)  # [tokens, heads, head_dim]
    lens = torch.tensor([0, 1], dtype=torch.int32, device=device)
    try:
        kernels.prefill.flash_attn_varlen_func(
            one, one.transpose(0, 1), one.transpose(0, 1), cu_seqlens_q=lens,
            cu_seqlens_k=lens, max_seqlen_q=1, causal=True, kv_layout="hsd")
    except Exception as exc:  # noqa: BLE001  (the interpreter wraps what the kernel raised)
        if "block pointer" not in str(exc).lower():
            raise
        import triton

        return (f"flash_attn_varlen_func builds block pointers (tl.make_block_ptr), which "
                f"triton {triton.__version__} removed; lmdeploy {kernels.version} requires "
                "triton<=3.7.1")
    return ""


class LmdeployPrefill(_LmdeployTritonAdapter):
    """LMDeploy's prefill: ``flatten_kv_cache`` then ``flash_attn_varlen_func``."""

    name = "lmdeploy-prefill"
    description = ("LMDeploy flatten_kv_cache + flash_attn_varlen_func (Triton varlen "
                   "prefill over a paged cache, lmdeploy 0.18 wheel files)")
    # From flatten_kv_cache.py and flashattention.py: decode's declaration, but any
    # power-of-two block size (the flatten tiles a block with tl.arange); prefill and
    # decode rows, causal bottom-right (the varlen kernel's history is kv_len - q_len);
    # nan_safe_tail, since the flatten copies only each sequence's kv_len keys (its
    # stores are masked by the sequence length).
    CAPABILITIES = replace(
        LmdeployDecode.CAPABILITIES,
        block_sizes=frozenset({1, 2, 4, 8} | DECODE_BLOCK_SIZES),
        modes=frozenset({"decode", "prefill"}),
        nan_safe_tail=True,
    )

    def jit_function(self, kernels: LmdeployTritonKernels) -> object:
        return kernels.prefill._flash_prefill_fwd_kernel

    def available(self, device: str = "cpu") -> Availability:
        availability = super().available(device)
        if availability.ok and (failure := block_pointer_failure(device)):
            return Availability(False, failure, availability.version)
        return availability

    def interpreter_work(self, case: PagedCase) -> InterpretedWork:
        """Flatten: one program per (block, sequence, KV head); the varlen kernel: one per
        (tile of 64 query rows, query head, sequence) over its causal keys in tiles of 32."""
        blocks = sum(cdiv(n, case.block_size) for n in case.kv_lens)
        steps = sum(cdiv(q, 64) * cdiv(kv, 32)
                    for q, kv in zip(case.q_lens_or_decode, case.kv_lens))
        programs = (blocks * case.num_kv_heads
                    + case.batch_size * case.num_q_heads * cdiv(max(case.q_lens_or_decode), 64))
        return InterpretedWork(programs, case.num_q_heads * steps,
                               (case.head_dim + case.v_head_dim) / 128 * 4)

    def prepare(self, inputs: PagedInputs) -> Prepared:
        """Bind the flatten of the canonical cache (``hsd``, one block of padding past the
        last sequence as LMDeploy pads) and the varlen kernel over it, with
        ``cu_seqlens_q`` and the prefix sums of ``kv_lens``."""
        case = inputs.case
        kernels = self.kernels()
        device = inputs.device
        starts = torch.tensor([0, *accumulate(case.kv_lens)], dtype=torch.int32, device=device)
        out_size = cdiv(sum(case.kv_lens), case.block_size) * case.block_size + case.block_size
        flatten = functools.partial(
            kernels.flatten.flatten_kv_cache, inputs.k_cache, inputs.v_cache, inputs.kv_lens,
            inputs.block_tables, start_loc=starts[:-1], out_size=out_size,
            out_dtype=inputs.q.dtype, flatten_kv_layout="hsd")
        attend = functools.partial(
            kernels.prefill.flash_attn_varlen_func, inputs.q, cu_seqlens_q=inputs.cu_seqlens_q,
            cu_seqlens_k=starts, max_seqlen_q=max(case.q_lens_or_decode),
            max_seqlen_k=max(case.kv_lens), softmax_scale=inputs.scale, causal=True,
            window_size=window_size(case), softcap=case.logits_soft_cap,
            alibi_slopes=inputs.alibi_slopes, sinks=inputs.sinks, kv_layout="hsd")

        def call() -> torch.Tensor:
            return attend(*flatten())

        return Prepared(call, out_shape=(case.total_q, case.num_q_heads, case.v_head_dim))
