"""SGLang's Triton attention kernels as peers (sglang 0.5.23's
``sglang/kernels/ops/attention/``, the ``triton`` attention backend's; in older releases
``srt/layers/attention/triton_ops/``): ``sglang-decode`` (``decode_attention.py``) and
``sglang-extend`` (``extend_attention.py``: prefill and chunked prefill over a cached
prefix, decode rows too).

Decode is two-stage flash decoding: stage 1 runs one program per (sequence, query head or head
tile of 16, KV split) over its split's keys, stage 2 merges the splits' partial outputs
by their log-sum-exp and adds the attention sink. SGLang addresses the cache per token
(RadixAttention's token pool, page size 1): K and V are separate pools
``[num_tokens, num_kv_heads, head_dim]``, and each sequence's tokens are listed in
``kv_indices`` between ``kv_indptr`` offsets. ``prepare`` (untimed) copies the canonical
cache into those pools (a block of ``block_size`` slots is ``block_size`` consecutive
tokens) and lists each sequence's token slots: ``block_size`` only changes where the
tokens lie. A sliding window is what SGLang's backend passes for a sliding-window layer
(``update_sliding_window_buffer`` in ``srt/layers/attention/triton_backend.py``): only the
last ``W`` tokens of each sequence in the index list. Extend takes the new tokens' Q, K
and V densely (``qo_indptr`` = ``cu_seqlens_q``) and the cached prefix (each sequence's
first ``kv_len - q_len`` tokens) through the same index list; one program per (sequence,
query head, tile of query rows) runs over the prefix, then causally over the new tokens.

The files are loaded without importing SGLang (:mod:`.sglang_triton_load`); on the CPU
the kernel runs under Triton's interpreter (``TRITON_INTERPRET=1`` before Python starts):
float32 and float16 only, as for vLLM's Triton kernels (triton-lang/triton#11584), and
within :data:`INTERPRETER_BUDGET`.
"""

from __future__ import annotations

import functools
from dataclasses import replace
from itertools import accumulate

import torch

from pagedbench.reference import PagedCase, PagedInputs, new_output
from pagedbench.reference.axes import LAYOUTS

from .base import AtLeast, Capabilities, Prepared
from .interpreted import InterpretedWork, InterpreterBudget, cdiv
from .sglang_triton_load import SglangFilesInvalid, SglangTritonKernels, load_kernels
from .triton_peer import PeerTritonAdapter, cached_load, triton_capabilities, window_of_one

#: vLLM's decode fit (adapters/vllm_triton.py): the same two-stage kernel lineage, the
#: same tiles but for the MHA path's 64 keys per step. Extend's steps are weighted by
#: their tile (BLOCK_M x BLOCK_N against decode's 16 x 32) and head dims, so it is
#: assumed for extend too until measured.
INTERPRETER_BUDGET = InterpreterBudget(s_per_program=0.005, s_per_step=0.006, max_s=10.0)
#: SGLang's ``--triton-attention-num-kv-splits`` default (``srt/arg_groups/fields/
#: exec_.py``): the most splits per sequence, and every sequence's count where no device
#: core count is known (``TritonAttnBackend.get_num_kv_splits`` fills it).
MAX_KV_SPLITS = 8
#: ``decode_attention.py``: keys per stage-1 step of the MHA (GQA ratio 1) and grouped
#: kernels, heads per grouped tile, and the granule a split's length is rounded up to.
MHA_KV_TILE, GROUPED_KV_TILE, GROUPED_HEAD_TILE, MIN_BLOCK_KV = 64, 32, 16, 32
#: Sequences the backend's split heuristic schedules at least (``get_num_kv_splits``).
SCHEDULE_SEQ_MIN = 256


#: The kernels (loaded once per process), or None and why they cannot be loaded.
_loaded = cached_load(load_kernels, ((ImportError, "triton not importable"),
                                     (SglangFilesInvalid, "SGLang's kernel files not usable")))


def grouped_head_tile_straddles(case: PagedCase) -> list[str]:
    """The unsupported reason of the grouped decode kernel's head tiling, where it applies.

    Above a GQA ratio of 16 the grouped stage 1 (``_fwd_grouped_kernel_stage1`` in SGLang's
    ``decode_attention.py`` and vLLM's copy) takes tiles of 16 query heads and reads KV
    head ``tile // cdiv(ratio, 16)``: unless the ratio is a multiple of 16, a tile holds
    heads of two KV groups and the second group's are computed against the first's K and
    V (measured: 40 query heads over 2 KV heads, heads 20-31 off by up to 2.47, float32).
    One KV head has one group, and nothing straddles.
    """
    ratio = case.gqa_ratio
    if ratio > GROUPED_HEAD_TILE and ratio % GROUPED_HEAD_TILE and case.num_kv_heads > 1:
        return [f"gqa ratio {ratio} with {case.num_kv_heads} KV heads not supported: the "
                f"grouped decode kernel's tiles of {GROUPED_HEAD_TILE} query heads straddle "
                "two KV groups and read the first group's K and V for both"]
    return []


def attended_lens(case: PagedCase) -> tuple[int, ...]:
    """Keys each sequence's query attends: ``kv_len``, or the last ``W`` of them."""
    if case.sliding_window is None:
        return case.kv_lens
    return tuple(min(n, case.sliding_window) for n in case.kv_lens)


def token_indices(inputs: PagedInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """SGLang's per-token addressing of the case's cache.

    Returns
    -------
    kv_indptr : Tensor[batch + 1], int32
        Offsets into ``kv_indices``: sequence ``b`` owns ``kv_indptr[b] : kv_indptr[b+1]``.
    kv_indices : Tensor[sum(attended_lens)], int64
        Token slot (``block * block_size + offset``, :attr:`PagedInputs.slot_mapping`) of
        each key a query attends, in position order: all ``kv_len`` keys, or the last
        ``W`` with a sliding window.
    """
    case = inputs.case
    lens = attended_lens(case)
    ends = list(accumulate(case.kv_lens))
    kv_indices = torch.cat([inputs.slot_mapping[end - n:end] for n, end in zip(lens, ends)])
    kv_indptr = torch.tensor([0, *accumulate(lens)], dtype=torch.int32, device=inputs.device)
    return kv_indptr, kv_indices


def new_token_slots(inputs: PagedInputs) -> torch.Tensor:
    """Token slot of each query row's own key, ``Tensor[total_q]`` int64: each sequence's
    last ``q_len`` positions (:attr:`PagedInputs.slot_mapping`), sequences in order; an
    extend kernel takes their K and V densely."""
    case = inputs.case
    starts = accumulate(case.kv_lens, initial=0)
    return torch.cat([inputs.slot_mapping[s + kv - q:s + kv] for s, q, kv in
                      zip(starts, case.q_lens_or_decode, case.kv_lens)])


def token_pools(inputs: PagedInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """The canonical cache as SGLang's K and V token pools (copies; poison kept).

    Returns
    -------
    k_buffer : Tensor[num_blocks * block_size, num_kv_heads, head_dim]
    v_buffer : Tensor[num_blocks * block_size, num_kv_heads, v_head_dim]
        Token slot ``block * block_size + offset`` holds ``kv_cache[block, :, offset]``;
        contiguous, in the cache's dtype.
    """
    case = inputs.case
    k = inputs.k_cache.reshape(-1, case.num_kv_heads, case.head_dim)  # [nb * bs, hkv, d]
    v = inputs.v_cache.reshape(-1, case.num_kv_heads, case.v_head_dim)  # [nb * bs, hkv, dv]
    return k.contiguous(), v.contiguous()


#: Soft caps above this on float32 logits are declared unsupported (:func:`soft_cap_cancels`).
FP32_SOFT_CAP_LIMIT = 100.0


def soft_cap_cancels(case: PagedCase) -> list[str]:
    """Why SGLang's kernels cannot take ``case``'s soft cap: their tanh is
    ``2 * sigmoid(2x) - 1``, which cancels for ``x = logit / cap`` near 0. The conformance
    search's cases, float32, cap 1e4: decode (d64, bs16, 1/1 heads, kv_len 15) 10021
    ulps, extend (d64, 2/1 heads, kv_len 1, sinks) 14756 ulps, against 256."""
    if (case.dtype == "float32" and case.logits_soft_cap is not None
            and case.logits_soft_cap > FP32_SOFT_CAP_LIMIT):
        return [f"logits_soft_cap {case.logits_soft_cap:g} above {FP32_SOFT_CAP_LIMIT:g} on "
                "float32 logits: SGLang's tanh, 2 * sigmoid(2x) - 1, cancels there"]
    return []


class _SglangTritonAdapter(PeerTritonAdapter):
    """What the two kernels share: SGLang's files, loaded without importing SGLang."""

    rocm_reason = "the stand-ins answer SGLang's ROCm questions with no"
    interpreter_budget = INTERPRETER_BUDGET

    load = staticmethod(_loaded)

    def jit_function(self, kernels: SglangTritonKernels) -> object:
        return kernels.decode._fwd_kernel_stage1


class SglangDecode(_SglangTritonAdapter):
    """SGLang's ``decode_attention_fwd`` on its token pool (page size 1)."""

    name = "sglang-decode"
    description = ("SGLang decode_attention_fwd (Triton two-stage split-KV decode on a "
                   "token pool, page size 1); interpreted on the CPU")
    # From decode_attention.py: any block size (per-token indices); Lk != Lv (V is read
    # from its own pool with BLOCK_DV channels); the grouped kernel's tl.dot needs 16
    # channels when compiled, and pads head_dim and head_dim_v to powers of two, so
    # anything from 9 up. Soft cap (logit_cap), sinks (stage 2), and a window through
    # the index list (module docstring); no ALiBi. Not empty_kv: a sequence with no key
    # merges no split and comes out 0/0 = NaN. Layouts: the pools and index list are
    # built in prepare from any cache layout; q and out are addressed by their row and
    # head strides.
    CAPABILITIES = triton_capabilities(
        head_dims=frozenset({AtLeast(9)}),
        modes=frozenset({"decode"}),
        features=frozenset({"logits_soft_cap", "sinks", "sliding_window", "head_dim_v"}),
        layouts=frozenset(LAYOUTS),
    )

    def capabilities(self, device: str) -> Capabilities:
        """Interpreted: also batch-invariant (without a device core count every sequence
        takes :data:`MAX_KV_SPLITS` splits, whatever its batch mates)."""
        caps = super().capabilities(device)
        return replace(caps, batch_invariant=True) if self.is_interpreted(device) else caps

    def why_unsupported(self, case: PagedCase, device: str) -> list[str]:
        return (super().why_unsupported(case, device) + grouped_head_tile_straddles(case)
                + soft_cap_cancels(case))

    def interpreter_work(self, case: PagedCase) -> InterpretedWork:
        """Stage 1: ``batch * head programs * MAX_KV_SPLITS`` programs, each over its split
        (``cdiv(cdiv(n, splits), 32) * 32`` keys) in tiles of 64 (MHA) or 32 keys; stage
        2: one program per sequence and query head."""
        if case.gqa_ratio == 1:
            head_programs, tile = case.num_q_heads, MHA_KV_TILE
        else:
            head_programs = cdiv(case.num_q_heads, min(GROUPED_HEAD_TILE, case.gqa_ratio))
            tile = GROUPED_KV_TILE
        splits = MAX_KV_SPLITS
        steps = 0
        for n in attended_lens(case):
            per_split = cdiv(cdiv(n, splits), MIN_BLOCK_KV) * MIN_BLOCK_KV
            steps += sum(cdiv(max(0, min(per_split, n - s * per_split)), tile)
                         for s in range(splits))
        programs = case.batch_size * (head_programs * splits + case.num_q_heads)
        return InterpretedWork(programs, head_programs * steps,
                               (case.head_dim + case.v_head_dim) / 128)

    def num_kv_splits(self, kv_lens: torch.Tensor, case: PagedCase) -> torch.Tensor:
        """Splits per sequence, ``Tensor[batch]`` int32, as SGLang's backend chooses
        (``TritonAttnBackend.get_num_kv_splits``): :data:`MAX_KV_SPLITS` each without a
        device core count (the CPU), else its ``get_num_kv_splits_triton`` heuristic from
        the lengths, the head counts and the multiprocessor count."""
        splits = torch.full((case.batch_size,), MAX_KV_SPLITS, dtype=torch.int32,
                            device=kv_lens.device)
        if kv_lens.device.type != "cuda":
            return splits
        kernels = self.kernels()
        cores = torch.cuda.get_device_properties(kv_lens.device).multi_processor_count
        schedule = max(SCHEDULE_SEQ_MIN, 1 << (case.batch_size - 1).bit_length())
        kernels.metadata.get_num_kv_splits_triton[(1,)](
            splits, kv_lens, case.batch_size, 1, case.num_q_heads, case.num_kv_heads,
            MAX_KV_SPLITS, cores, MAX_NUM_SEQ=schedule)
        return splits

    def prepare(self, inputs: PagedInputs) -> Prepared:
        """Copy the cache into the token pools (:func:`token_pools`), list the attended
        tokens (:func:`token_indices`), choose the splits (:meth:`num_kv_splits`);
        allocates ``out`` (NaN), ``attn_logits [batch, num_q_heads, MAX_KV_SPLITS,
        v_head_dim]`` and ``attn_lse [batch, num_q_heads, MAX_KV_SPLITS]`` (float32).
        ``facts``: ``max_kv_splits`` and the stage-1 ``kernel`` (``"mha"`` at GQA ratio 1,
        else ``"grouped"``).

        Raises
        ------
        ValueError
            If some ``q_lens`` > 1: ``decode_attention_fwd`` takes one query token per sequence
            (:meth:`decode_case`).
        """
        case = self.decode_case(inputs)
        kernels = self.kernels()
        k_buffer, v_buffer = token_pools(inputs)
        kv_indptr, kv_indices = token_indices(inputs)
        attended = kv_indptr.diff()  # [batch], int32
        scratch = (case.batch_size, case.num_q_heads, MAX_KV_SPLITS)
        out = new_output(inputs)
        call = functools.partial(
            kernels.decode.decode_attention_fwd,
            q=inputs.q,  # [batch, num_q_heads, head_dim]: one token per sequence
            k_buffer=k_buffer,
            v_buffer=v_buffer,
            o=out,
            kv_indptr=kv_indptr,
            kv_indices=kv_indices,
            attn_logits=torch.empty(*scratch, case.v_head_dim, dtype=torch.float32,
                                    device=inputs.device),
            attn_lse=torch.empty(scratch, dtype=torch.float32, device=inputs.device),
            num_kv_splits=self.num_kv_splits(attended, case),
            max_kv_splits=MAX_KV_SPLITS,
            sm_scale=inputs.scale,
            k_scale=1.0,
            v_scale=1.0,
            logit_cap=case.logits_soft_cap or 0.0,
            sinks=inputs.sinks,
            page_size=1,
        )
        return Prepared(call, out, facts={
            "max_kv_splits": MAX_KV_SPLITS,
            "kernel": "mha" if case.gqa_ratio == 1 else "grouped",
        })


class SglangExtend(_SglangTritonAdapter):
    """SGLang's ``extend_attention_fwd``: new tokens over a cached prefix (page size 1)."""

    name = "sglang-extend"
    description = ("SGLang extend_attention_fwd (Triton prefill / chunked prefill over a "
                   "token-pool prefix, page size 1); interpreted on the CPU")
    # From extend_attention.py: decode's declaration and prefill rows (decode rows are
    # extend rows of length 1); the prefix loop and the causal loop mask with
    # SLIDING_WINDOW_SIZE = W - 1 (q <= k + S), which 0 switches off, so W = 1 is refused
    # (why_unsupported); a row whose prefix and new keys are all masked is written as 0
    # (deno 0), so q_len 0 entries are fine, but kv_len < q_len is no prefix at all (not
    # unseen_rows, not empty_kv). head_dim 576 and 288 split into a 512 / 256 dot plus a
    # rope part; otherwise padded to a power of two, so 9 and up as for decode (tl.dot's
    # 16). One program per row tile whatever the batch: batch-invariant.
    CAPABILITIES = replace(
        SglangDecode.CAPABILITIES,
        modes=frozenset({"decode", "prefill"}),
        features=SglangDecode.CAPABILITIES.features | {"empty_q"},
        batch_invariant=True,
    )

    def why_unsupported(self, case: PagedCase, device: str) -> list[str]:
        return (super().why_unsupported(case, device) + soft_cap_cancels(case)
                + window_of_one(case, "extend_attention_fwd"))

    def tiles(self, case: PagedCase) -> tuple[int, int]:
        """``(BLOCK_M, BLOCK_N)``: query rows and keys per tile, SGLang's choice for this
        device and head dims (``_get_block_sizes_for_extend_attention``)."""
        kernels = self.kernels()
        *_, block_m, block_n, _ = kernels.extend._get_block_sizes_for_extend_attention(
            case.head_dim, case.v_head_dim)
        return block_m, block_n

    def interpreter_work(self, case: PagedCase) -> InterpretedWork:
        """``batch * num_q_heads * cdiv(max q_len, BLOCK_M)`` programs; each live one
        steps over its prefix and, causally, the new keys up to its last row, BLOCK_N
        keys a step (the window's skipped tiles counted too: a bound)."""
        block_m, block_n = self.tiles(case)
        max_q = max(case.q_lens_or_decode)
        steps = 0
        for q_len, kv_len in zip(case.q_lens_or_decode, case.kv_lens):
            for m in range(cdiv(q_len, block_m)):
                steps += (cdiv(kv_len - q_len, block_n)
                          + cdiv(min(q_len, (m + 1) * block_m), block_n))
        programs = case.batch_size * case.num_q_heads * max(1, cdiv(max_q, block_m))
        weight = (case.head_dim + case.v_head_dim) / 128 * block_m * block_n / (16 * 32)
        return InterpretedWork(programs, case.num_q_heads * steps, weight)

    def prepare(self, inputs: PagedInputs) -> Prepared:
        """Copy the cache into the token pools (:func:`token_pools`), list each
        sequence's prefix tokens (its first ``kv_len - q_len``), gather the new tokens'
        K and V densely ``[total_q, num_kv_heads, head_dim]`` through the slot mapping;
        allocates ``out`` (NaN). ``facts``: the tiles ``block_m`` and ``block_n``.

        Raises
        ------
        ValueError
            If a sequence has ``q_len > kv_len`` (no prefix to take).
        """
        case = inputs.case
        kernels = self.kernels()
        q_lens = case.q_lens_or_decode
        if any(q > kv for q, kv in zip(q_lens, case.kv_lens)):
            raise ValueError("sglang-extend needs q_len <= kv_len for every sequence, got "
                             f"q_lens={q_lens}, kv_lens={case.kv_lens}")
        k_buffer, v_buffer = token_pools(inputs)
        starts = [0, *accumulate(case.kv_lens)][:-1]
        prefix = [inputs.slot_mapping[s:s + kv - q] for s, q, kv in
                  zip(starts, q_lens, case.kv_lens)]
        new = new_token_slots(inputs)  # [total_q]
        kv_indptr = torch.tensor([0, *accumulate(kv - q for q, kv in zip(q_lens, case.kv_lens))],
                                 dtype=torch.int32, device=inputs.device)
        block_m, block_n = self.tiles(case)
        out = new_output(inputs)
        call = functools.partial(
            kernels.extend.extend_attention_fwd,
            q_extend=inputs.q,
            k_extend=k_buffer[new],  # [total_q, num_kv_heads, head_dim]
            v_extend=v_buffer[new],  # [total_q, num_kv_heads, v_head_dim]
            o_extend=out,
            k_buffer=k_buffer,
            v_buffer=v_buffer,
            qo_indptr=inputs.cu_seqlens_q,
            kv_indptr=kv_indptr,
            kv_indices=torch.cat(prefix),
            custom_mask=None,
            is_causal=True,
            mask_indptr=None,
            max_len_extend=max(q_lens),
            k_scale=1.0,
            v_scale=1.0,
            sm_scale=inputs.scale,
            logit_cap=case.logits_soft_cap or 0.0,
            sliding_window_size=-1 if case.sliding_window is None else case.sliding_window - 1,
            sinks=inputs.sinks,
            page_size=1,
        )
        return Prepared(call, out, facts={"block_m": block_m, "block_n": block_n})
