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
(:data:`SPLIT_STEP_BUDGET`, :data:`PREFILL_STEP_BUDGET`).
"""

from __future__ import annotations

import abc
from typing import Any

import torch

from pagedbench.reference import PagedCase, PagedInputs, new_output

from .base import Adapter, Availability, Capabilities

#: Most interpreter steps (:meth:`pagedbench.kernels.paged_split_decode.SplitPlan.steps`:
#: key-loop iterations and programs of both kernels) one interpreted split-decode call
#: may take. Measured with triton 3.9.0 on this project's 2-core CI machine (AMD EPYC,
#: other jobs beside), process CPU time of one call on 6 reduced presets (bf16, head_dim
#: 96-256): 8.2 ms per step (least squares; within 0.7 s of every call). 600 admits
#: every reduced preset of :mod:`pagedbench.harness.cases` (at most 584 steps, about
#: 4 s) except phi3-mini's 32 KV heads (1088 steps, 9.4 s), and no full preset.
SPLIT_STEP_BUDGET = 600
#: The same for the prefill kernel, whose loop iteration over ``block_m`` rows counts
#: ``block_m // 16`` steps (:meth:`pagedbench.kernels.paged_prefill.PrefillPlan.steps`).
#: Measured as above on the reduced presets and four mixed prefill batches: 10 to 19 ms
#: per step. 320 admits every reduced preset (phi3-mini: 320 steps, 5.1 s) and, of the
#: full ones, llama3.1-70b-tp8 (one KV head) and qwen2.5-7b at block_size 16.
PREFILL_STEP_BUDGET = 320

_COMMON = dict(
    devices=frozenset({"cpu", "cuda"}),
    dtypes=frozenset({"float32", "float16", "bfloat16"}),
    head_dims=frozenset({64, 80, 96, 128, 256}),
    features=frozenset({"sliding_window", "logits_soft_cap", "alibi", "sinks"}),
    kv_cache_dtypes=frozenset({"auto", "fp8_e4m3", "fp8_e5m2"}),
    min_compute_capability=(8, 0),
)
SPLIT_CAPABILITIES = Capabilities(modes=frozenset({"decode"}), **_COMMON)
PREFILL_CAPABILITIES = Capabilities(modes=frozenset({"decode", "prefill"}), **_COMMON)
#: Triton converts fp8 E4M3 ("fp8e4nv") only from compute capability 8.9 (its error on
#: sm_80: "type fp8e4nv not supported in this architecture").
FP8_E4M3_MIN_CAPABILITY = (8, 9)


def _feature_kwargs(inputs: PagedInputs) -> dict[str, Any]:
    case = inputs.case
    return dict(out=new_output(inputs), sliding_window=case.sliding_window,
                logits_soft_cap=case.logits_soft_cap, alibi_slopes=inputs.alibi_slopes,
                sinks=inputs.sinks, k_scale=case.k_scale, v_scale=case.v_scale)


class _TritonPaged(Adapter):
    """What both kernels' adapters share: availability, interpretation, limits."""

    _capabilities: Capabilities
    _budget: int

    def capabilities(self) -> Capabilities:
        return self._capabilities

    def available(self, device: str = "cpu") -> Availability:
        """Ready when triton imports, on the CPU under the interpreter, on CUDA with
        compute capability 8.0 or more. ``details`` records ``interpreted``."""
        device_type = torch.device(device).type
        if device_type not in self._capabilities.devices:
            return Availability(False, f"device {device_type!r} not in "
                                       f"{sorted(self._capabilities.devices)}")
        try:
            import triton

            from pagedbench.kernels import paged_features
        except ImportError as exc:
            return Availability(False, f"triton not installed: {exc}")
        interpreted = paged_features.kernels_are_interpreted()
        if device_type == "cpu" and not interpreted:
            if triton.knobs.runtime.interpret:
                reason = ("pagedbench.kernels.paged_features was imported before "
                          "TRITON_INTERPRET=1 was set: set it before starting Python")
            else:
                reason = ("the Triton kernels run on the CPU only under Triton's "
                          "interpreter: set TRITON_INTERPRET=1 before starting Python")
            return Availability(False, reason, triton.__version__)
        if device_type == "cuda":
            if not torch.cuda.is_available():
                return Availability(False, "no CUDA device visible to torch",
                                    triton.__version__)
            capability = torch.cuda.get_device_capability(device)
            if not interpreted and capability < self._capabilities.min_compute_capability:
                need = ".".join(map(str, self._capabilities.min_compute_capability))
                return Availability(False, f"compute capability {capability[0]}."
                                           f"{capability[1]} < {need}", triton.__version__)
        return Availability(True, version=triton.__version__,
                            details={"interpreted": str(interpreted).lower()})

    def is_interpreted(self, device: str) -> bool:
        """True on the CPU; on CUDA when the kernel modules were imported interpreted."""
        if torch.device(device).type == "cpu":
            return True
        try:
            from pagedbench.kernels.paged_features import kernels_are_interpreted
        except ImportError:
            return False
        return kernels_are_interpreted()

    def why_unsupported(self, case: PagedCase, device: str) -> list[str]:
        """Capability reasons; fp8 E4M3 below compute capability 8.9; when interpreted,
        the step budget."""
        reasons = self._capabilities.why_unsupported(case, device)
        if (torch.device(device).type == "cuda" and case.kv_cache_dtype == "fp8_e4m3"
                and torch.cuda.is_available() and not self.is_interpreted(device)):
            capability = torch.cuda.get_device_capability(device)
            if capability < FP8_E4M3_MIN_CAPABILITY:
                reasons.append(f"kv_cache_dtype 'fp8_e4m3' needs compute capability 8.9 "
                               f"(Triton has no E4M3 below), got {capability[0]}."
                               f"{capability[1]}")
        if reasons or not self.is_interpreted(device):
            return reasons
        try:
            steps = self._steps(case)
        except ImportError:
            return reasons  # available() reports the missing triton
        if steps > self._budget:
            reasons.append(f"too large for the Triton interpreter: {steps} steps > "
                           f"budget {self._budget}")
        return reasons

    @abc.abstractmethod
    def _steps(self, case: PagedCase) -> int:
        """Interpreter steps of ``case``'s launch, from its plan."""

    def run(self, prepared: Any) -> torch.Tensor:
        """Launch; returns ``Tensor[total_q, num_q_heads, head_dim]`` in the case dtype."""
        return prepared()


class TritonSplitDecode(_TritonPaged):
    """Split-KV decode: grid (sequence, KV head, split), float32 partials, merge kernel."""

    name = "pagedbench-triton-split"
    description = ("pagedbench's Triton split-KV decode (flash-decoding): splits chosen "
                   "from batch, context and SM count, float32 partials and a merge")
    _capabilities = SPLIT_CAPABILITIES
    _budget = SPLIT_STEP_BUDGET

    def _steps(self, case: PagedCase) -> int:
        from pagedbench.kernels.paged_split_decode import plan_splits

        element_size = torch.empty((), dtype=case.kv_torch_dtype).element_size()
        plan = plan_splits(case.kv_lens, case.num_kv_heads, case.head_dim, element_size,
                           case.sliding_window)
        return plan.steps(case.kv_lens, case.num_kv_heads, case.sliding_window)

    def prepare(self, inputs: PagedInputs):
        """Validate, choose the splits for this device, allocate output and partials."""
        from pagedbench.kernels.paged_split_decode import plan_paged_split_decode

        return plan_paged_split_decode(inputs.q, inputs.kv_cache, inputs.block_tables,
                                       inputs.kv_lens, inputs.sm_scale,
                                       **_feature_kwargs(inputs))

    def describe(self, prepared) -> dict[str, str]:
        """Splits, tile, warps and stages of this launch."""
        plan = prepared.plan
        return {"num_splits": str(plan.num_splits),
                "merge": str(not plan.direct_output).lower(),
                "kv_tile": str(plan.config.kv_tile),
                "num_warps": str(plan.config.num_warps),
                "num_stages": str(plan.config.num_stages)}


class TritonPrefill(_TritonPaged):
    """GQA-packed varlen prefill, chunked prefill, multi-token and mixed decode batches."""

    name = "pagedbench-triton-prefill"
    description = ("pagedbench's Triton paged prefill: varlen queries, causal "
                   "bottom-right, GQA-packed rows, decode and prefill mixed in one launch")
    _capabilities = PREFILL_CAPABILITIES
    _budget = PREFILL_STEP_BUDGET

    def _steps(self, case: PagedCase) -> int:
        from pagedbench.kernels.paged_prefill import plan_prefill

        element_size = torch.empty((), dtype=case.kv_torch_dtype).element_size()
        plan = plan_prefill(case.q_lens_or_decode, case.kv_lens, case.gqa_ratio,
                            case.head_dim, element_size, case.sliding_window)
        return plan.steps(case.num_kv_heads)

    def prepare(self, inputs: PagedInputs):
        """Validate, build the work list, allocate the output."""
        from pagedbench.kernels.paged_prefill import plan_paged_prefill

        return plan_paged_prefill(inputs.q, inputs.kv_cache, inputs.block_tables,
                                  inputs.kv_lens, inputs.cu_seqlens_q, inputs.sm_scale,
                                  **_feature_kwargs(inputs))

    def describe(self, prepared) -> dict[str, str]:
        """Rows per program, programs, tile, warps and stages of this launch."""
        plan = prepared.plan
        return {"block_m": str(plan.block_m), "programs": str(len(plan.work)),
                "kv_tile": str(plan.config.kv_tile),
                "num_warps": str(plan.config.num_warps),
                "num_stages": str(plan.config.num_stages)}
