"""``pagedbench-triton-split`` and ``pagedbench-triton-prefill``: this project's split-KV
decode and GQA-packed prefill kernels.

Both kernels read the canonical inputs as they are (``kv_cache[num_blocks, 2,
block_size, num_kv_heads, head_dim]`` through its strides, fp8 values with
``k_scale``/``v_scale``, int32 tables and lengths), so ``prepare`` converts nothing: it
validates, plans the launch (split count or work list, from the lengths and the device's
SM count) and allocates the NaN-filled output (:func:`~pagedbench.reference.new_output`)
and the float32 partials; ``run`` only launches. Any block size and GQA ratio; sliding
window, soft cap, ALiBi, sinks; fp8 E4M3 (compute capability 8.9 and up on a GPU: Triton
has no E4M3 on sm_80) and E5M2 caches. On the CPU the kernels run under Triton's
interpreter (``TRITON_INTERPRET=1`` before Python starts), within a cost budget per call
(:data:`SPLIT_BUDGET`, :data:`PREFILL_BUDGET`).
"""

from __future__ import annotations

from dataclasses import replace
from types import ModuleType
from typing import Any, ClassVar

import torch

from pagedbench.reference import PagedCase, PagedInputs, new_output

from .base import Capabilities, Fact, Prepared
from .interpreted import InterpretedWork, InterpreterBudget
from .triton_decode import PagedbenchTritonAdapter

#: Most interpreter steps (:meth:`pagedbench.kernels.paged_split_plan.SplitPlan.steps`:
#: key-loop iterations of both kernels plus one per program, so programs are not charged
#: again) one interpreted split-decode call may take, and the process CPU seconds charged
#: per step: a least-squares fit over the reduced presets, every reduced preset admitted
#: but phi3-mini's 32 KV heads (the fit and what each budget admits:
#: docs/interpreter-budget.md; ``docs/interpreter_cost.py paged`` measures them again).
SPLIT_STEP_BUDGET = 600
SPLIT_S_PER_STEP = 0.0082
SPLIT_BUDGET = InterpreterBudget(s_per_program=0.0, s_per_step=SPLIT_S_PER_STEP,
                                 max_s=SPLIT_STEP_BUDGET * SPLIT_S_PER_STEP)
#: The same for the prefill kernel, whose loop iteration over ``block_m`` rows counts
#: ``block_m // 16`` steps (:meth:`pagedbench.kernels.paged_prefill.PrefillPlan.steps`,
#: one more per program); charged at the upper part of the measured per-step range, so
#: every reduced preset is admitted (docs/interpreter-budget.md).
PREFILL_STEP_BUDGET = 320
PREFILL_S_PER_STEP = 0.016
PREFILL_BUDGET = InterpreterBudget(s_per_program=0.0, s_per_step=PREFILL_S_PER_STEP,
                                   max_s=PREFILL_STEP_BUDGET * PREFILL_S_PER_STEP)

_COMMON = dict(
    devices=frozenset({"cpu", "cuda"}),
    dtypes=frozenset({"float32", "float16", "bfloat16"}),
    head_dims=frozenset({64, 80, 96, 128, 256}),
    features=frozenset({"sliding_window", "logits_soft_cap", "alibi", "sinks"}),
    kv_cache_dtypes=frozenset({"auto", "fp8_e4m3", "fp8_e5m2"}),
    min_compute_capability=(8, 0),
    kv_cache_in_place=True,
)
# No plan_reuse: the split count and the prefill work list follow the lengths, so the
# serving loop prepares both at every step (on the same tensors).
SPLIT_CAPABILITIES = Capabilities(
    modes=frozenset({"decode"}), returns_lse=True,
    **_COMMON | {"features": _COMMON["features"] | {"empty_kv"}})
# Not empty_kv, unseen_rows: the prefill planner refuses q_len > kv_len.
PREFILL_CAPABILITIES = Capabilities(
    modes=frozenset({"decode", "prefill"}),
    **_COMMON | {"features": _COMMON["features"] | {"empty_q"}})
#: Triton converts fp8 E4M3 ("fp8e4nv") only from compute capability 8.9 (its error on
#: sm_80: "type fp8e4nv not supported in this architecture").
FP8_E4M3_MIN_CAPABILITY = (8, 9)


def _feature_kwargs(inputs: PagedInputs) -> dict[str, Any]:
    case = inputs.case
    return dict(out=new_output(inputs), sliding_window=case.sliding_window,
                logits_soft_cap=case.logits_soft_cap, alibi_slopes=inputs.alibi_slopes,
                sinks=inputs.sinks, k_scale=case.k_scale, v_scale=case.v_scale)


def _cache_element_size(case: PagedCase) -> int:
    return torch.empty((), dtype=case.kv_torch_dtype).element_size()


class _TritonPaged(PagedbenchTritonAdapter):
    """What both kernels' adapters share: capabilities per device, interpretation."""

    #: What the kernel takes; :meth:`capabilities` narrows it on an older GPU.
    CAPABILITIES: ClassVar[Capabilities]

    def capabilities(self, device: str) -> Capabilities:
        """:attr:`CAPABILITIES`, without ``fp8_e4m3`` where the kernels are compiled for a
        GPU below :data:`FP8_E4M3_MIN_CAPABILITY`."""
        caps = self.CAPABILITIES
        parsed = torch.device(device)
        if (parsed.type != "cuda" or not torch.cuda.is_available()
                or (parsed.index or 0) >= torch.cuda.device_count()
                or self.is_interpreted(device)):
            return caps
        have = torch.cuda.get_device_capability(parsed.index)
        if have >= FP8_E4M3_MIN_CAPABILITY:
            return caps
        return replace(caps, kv_cache_dtypes=caps.kv_cache_dtypes - {"fp8_e4m3"},
                       notes={**caps.notes, "kv_cache_dtypes": (
                           f"fp8_e4m3 needs compute capability 8.9 (Triton has no E4M3 "
                           f"below), this GPU has {have[0]}.{have[1]}")})

    def kernel_interpreted(self) -> bool | None:
        try:
            from pagedbench.kernels.paged_features import kernels_are_interpreted
        except ImportError:
            return None
        return kernels_are_interpreted()

    def why_unsupported(self, case: PagedCase, device: str) -> list[str]:
        """Capability reasons; the interpreter budget only for a case the kernel takes
        (a launch outside the capabilities, e.g. head_dim 512, has no plan to cost)."""
        return (self.capabilities(device).why_unsupported(case, device)
                or super().why_unsupported(case, device))


class TritonSplitDecode(_TritonPaged):
    """Split-KV decode: grid (sequence, KV head, split), float32 partials, merge kernel."""

    name = "pagedbench-triton-split"
    description = ("pagedbench's Triton split-KV decode (flash-decoding): splits chosen "
                   "from batch, context and SM count, float32 partials and a merge")
    CAPABILITIES = SPLIT_CAPABILITIES
    interpreter_budget = SPLIT_BUDGET
    kernel_module = "pagedbench.kernels.paged_split_decode"

    def kernel_facts(self, kernel: ModuleType, device: str) -> dict[str, Fact]:
        """``num_sms`` (int): the SM count the split count plans for (on the CPU, the
        stand-in :data:`~pagedbench.kernels.paged_split_plan.CPU_STAND_IN_SM_COUNT`)."""
        from pagedbench.kernels.paged_split_plan import device_sm_count

        return {"num_sms": device_sm_count(torch.device(device))}

    def interpreter_work(self, case: PagedCase) -> InterpretedWork:
        """The split and merge programs of the plan for ``case``;
        :meth:`~pagedbench.kernels.paged_split_plan.SplitPlan.steps` steps."""
        from pagedbench.kernels.paged_split_plan import plan_splits

        plan = plan_splits(case.kv_lens, case.num_kv_heads, case.head_dim,
                           _cache_element_size(case), case.sliding_window)
        grids = plan.num_splits + (0 if plan.direct_output else 1)
        return InterpretedWork(case.batch_size * case.num_kv_heads * grids,
                               plan.steps(case.kv_lens, case.num_kv_heads, case.sliding_window))

    def prepare(self, inputs: PagedInputs) -> Prepared:
        """Validate, choose the splits for this device, allocate output and partials.
        ``facts``: ``num_splits``, ``merge`` (bool), ``kv_tile``, ``num_warps``,
        ``num_stages``."""
        from pagedbench.kernels.paged_split_decode import plan_paged_split_decode

        launch = plan_paged_split_decode(inputs.q, inputs.kv_cache, inputs.block_tables,
                                         inputs.kv_lens, inputs.scale,
                                         **_feature_kwargs(inputs))
        plan = launch.plan
        return Prepared(launch, launch.out, lse=launch.lse, facts={
            "num_splits": plan.num_splits, "merge": not plan.direct_output,
            "kv_tile": plan.config.kv_tile, "num_warps": plan.config.num_warps,
            "num_stages": plan.config.num_stages})


class TritonPrefill(_TritonPaged):
    """GQA-packed varlen prefill, chunked prefill, multi-token and mixed decode batches."""

    name = "pagedbench-triton-prefill"
    description = ("pagedbench's Triton paged prefill: varlen queries, causal "
                   "bottom-right, GQA-packed rows, decode and prefill mixed in one launch")
    CAPABILITIES = PREFILL_CAPABILITIES
    interpreter_budget = PREFILL_BUDGET
    kernel_module = "pagedbench.kernels.paged_prefill"

    def interpreter_work(self, case: PagedCase) -> InterpretedWork:
        """The work list's programs times num_kv_heads;
        :meth:`~pagedbench.kernels.paged_prefill.PrefillPlan.steps` steps."""
        from pagedbench.kernels.paged_prefill import plan_prefill

        plan = plan_prefill(case.q_lens_or_decode, case.kv_lens, case.gqa_ratio,
                            case.head_dim, _cache_element_size(case), case.sliding_window)
        return InterpretedWork(len(plan.work) * case.num_kv_heads,
                               plan.steps(case.num_kv_heads))

    def prepare(self, inputs: PagedInputs) -> Prepared:
        """Validate, build the work list, allocate the output. ``facts``: ``block_m``
        (rows per program), ``programs`` (work items), ``kv_tile``, ``num_warps``,
        ``num_stages``."""
        from pagedbench.kernels.paged_prefill import plan_paged_prefill

        launch = plan_paged_prefill(inputs.q, inputs.kv_cache, inputs.block_tables,
                                    inputs.kv_lens, inputs.cu_seqlens_q, inputs.scale,
                                    **_feature_kwargs(inputs))
        plan = launch.plan
        return Prepared(launch, launch.out, facts={
            "block_m": plan.block_m, "programs": len(plan.work),
            "kv_tile": plan.config.kv_tile, "num_warps": plan.config.num_warps,
            "num_stages": plan.config.num_stages})
