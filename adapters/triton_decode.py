"""``pagedbench-triton``: this project's Triton paged-decode kernel.

The kernel (:mod:`pagedbench.kernels.paged_decode`) reads the canonical inputs as they
are: ``kv_cache[num_blocks, 2, block_size, num_kv_heads, head_dim]`` through its
strides, ``block_tables`` and ``kv_lens`` int32. So ``prepare`` converts nothing; it
validates and plans the launch and allocates the NaN-filled output buffer
(:func:`~pagedbench.reference.new_output`), and ``run`` only launches.

Decode only (one query token per sequence); any block_size and GQA ratio; sliding
window and logits soft cap. On the CPU the kernel runs under Triton's interpreter
(``TRITON_INTERPRET=1`` must be set before the kernel module is imported, i.e. before
starting Python), within :data:`INTERPRETER_BUDGET`.

:class:`PagedbenchTritonAdapter` is what the adapters of all of pagedbench's Triton
kernels share (:mod:`.triton_paged` holds the other two): their ``available()``.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import ClassVar

import torch

from pagedbench.reference import PagedCase, PagedInputs, new_output

from .base import Availability, Capabilities, Fact, Prepared
from .interpreted import InterpretedWork, InterpreterBudget, TritonAdapter

#: Most key-loop steps one interpreted call may take: 320 at 3.8 ms each (the fitted cost
#: on the 2-core CI machine: ``python docs/interpreter_cost.py triton``,
#: docs/interpreter-budget.md). It admits every reduced model preset (the largest,
#: phi3-mini, 288 steps) and refuses every full one (424 steps and more) but
#: llama3.1-70b-tp8 (107). Programs are not charged: at their fitted 6 ms the reduced
#: phi3-mini (128 programs) would cost more than full qwen2.5-7b at block_size 16.
INTERPRETER_STEP_BUDGET = 320
INTERPRETER_S_PER_STEP = 0.0038
INTERPRETER_BUDGET = InterpreterBudget(
    s_per_program=0.0, s_per_step=INTERPRETER_S_PER_STEP,
    max_s=INTERPRETER_STEP_BUDGET * INTERPRETER_S_PER_STEP,
)

CAPABILITIES = Capabilities(
    devices=frozenset({"cpu", "cuda"}),
    dtypes=frozenset({"float32", "float16", "bfloat16"}),
    head_dims=frozenset({64, 80, 96, 128, 256}),
    modes=frozenset({"decode"}),
    features=frozenset({"sliding_window", "logits_soft_cap", "empty_kv"}),
    kv_cache_in_place=True,
    # The launch reads kv_lens and block_tables when it runs: a plan made once per batch
    # shape serves every later step of it (a captured graph's replay).
    plan_reuse=True,
)


class PagedbenchTritonAdapter(TritonAdapter):
    """What the adapters of pagedbench's own Triton kernels (``kernels/``) share: when
    they are available, and what that records. Subclasses name their kernel module."""

    #: The module holding the kernel and its launcher (importing it imports triton).
    kernel_module: ClassVar[str]

    def kernel_facts(self, kernel: ModuleType, device: str) -> dict[str, Fact]:
        """What :meth:`available` records about the imported ``kernel`` module on
        ``device`` beside ``interpreted``; nothing by default."""
        return {}

    def write_kv(self, kv_cache: torch.Tensor, slot_mapping: torch.Tensor, key: torch.Tensor,
                 value: torch.Tensor, case: PagedCase) -> bool:
        """Serving loop: new tokens' K and V written by our Triton cache-write op
        (:mod:`pagedbench.kernels.cache_write`). Under Triton's interpreter a float32 value
        is converted to bfloat16 and fp8 by truncation, not rounded to nearest as the
        hardware and torch convert it (docs/KERNELS.md): there the op writes float32 and
        float16 caches only, and pagedbench's writer stores the others."""
        from pagedbench.kernels import cache_write

        if self.kernel_interpreted() and kv_cache.dtype not in (torch.float32, torch.float16):
            return False
        cache_write.write_kv(kv_cache, slot_mapping, key, value, case.k_scale, case.v_scale)
        return True

    def available(self, device: str = "cpu") -> Availability:
        """Ready when triton and :attr:`kernel_module` import and, on the CPU, the kernel
        runs interpreted; on CUDA, when torch sees a device.

        ``Availability.details`` records ``interpreted`` (bool) and :meth:`kernel_facts`.
        """
        device_type = torch.device(device).type
        devices = self.capabilities(device).devices
        if device_type not in devices:
            return Availability(False, f"device {device_type!r} not in {sorted(devices)}")
        try:
            import triton

            kernel = importlib.import_module(self.kernel_module)
        except ImportError as exc:
            return Availability(False, f"triton not installed: {exc}")
        if device_type == "cpu" and self.interpreter_missing():
            return Availability(False, self.interpreter_missing(), triton.__version__)
        if device_type == "cuda" and not torch.cuda.is_available():
            return Availability(False, "no CUDA device visible to torch", triton.__version__)
        details = {"interpreted": self.is_interpreted(device),
                   **self.kernel_facts(kernel, device)}
        return Availability(True, version=triton.__version__, details=details)


class TritonPagedDecode(PagedbenchTritonAdapter):
    """This project's Triton kernel: one program per (sequence, KV head), whole GQA group."""

    name = "pagedbench-triton"
    description = ("pagedbench's Triton paged decode: one program per sequence x KV head, "
                   "block table read per key tile, online softmax in float32")
    interpreter_budget = INTERPRETER_BUDGET
    kernel_module = "pagedbench.kernels.paged_decode"

    def capabilities(self, device: str) -> Capabilities:
        """The same on every device (bfloat16 under the interpreter goes through float32:
        :func:`~pagedbench.kernels.paged_features.bf16_via_fp32`)."""
        return CAPABILITIES

    def kernel_interpreted(self) -> bool | None:
        try:
            from pagedbench.kernels import paged_decode
        except ImportError:
            return None
        return paged_decode.kernel_is_interpreted()

    def interpreter_work(self, case: PagedCase) -> InterpretedWork:
        """``batch * num_kv_heads`` programs;
        :func:`~pagedbench.kernels.paged_decode.program_steps` steps."""
        from pagedbench.kernels.paged_decode import program_steps

        steps = program_steps(case.kv_lens, case.num_kv_heads, case.sliding_window)
        return InterpretedWork(case.batch_size * case.num_kv_heads, steps)

    def kernel_facts(self, kernel: ModuleType, device: str) -> dict[str, Fact]:
        """``kv_tile`` (int): keys per step of the key loop."""
        return {"kv_tile": kernel.KV_TILE}

    def prepare(self, inputs: PagedInputs) -> Prepared:
        """Validate and plan the launch; ``out`` is NaN until the kernel runs."""
        from pagedbench.kernels.paged_decode import plan_paged_decode

        case = inputs.case
        launch = plan_paged_decode(
            inputs.q, inputs.kv_cache, inputs.block_tables, inputs.kv_lens, inputs.scale,
            out=new_output(inputs),
            sliding_window=case.sliding_window,
            logits_soft_cap=case.logits_soft_cap,
        )
        return Prepared(launch, launch.out)
