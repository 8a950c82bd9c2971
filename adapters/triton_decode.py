"""``pagedbench-triton``: this project's Triton paged-decode kernel.

The kernel (:mod:`pagedbench.kernels.paged_decode`) reads the canonical inputs as they
are: ``kv_cache[num_blocks, 2, block_size, num_kv_heads, head_dim]`` through its
strides, ``block_tables`` and ``kv_lens`` int32. So ``prepare`` converts nothing; it
validates and plans the launch and allocates the NaN-filled output buffer
(:func:`~pagedbench.reference.new_output`), and ``run`` only launches.

Decode only (one query token per sequence); any block_size and GQA ratio; sliding
window and logits soft cap. On the CPU the kernel runs under Triton's interpreter
(``TRITON_INTERPRET=1`` must be set before the kernel module is imported, i.e. before
starting Python), with a cost budget per call (:data:`INTERPRETER_STEP_BUDGET`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from pagedbench.reference import PagedCase, PagedInputs, new_output

from .base import Adapter, Availability, Capabilities

if TYPE_CHECKING:
    from pagedbench.kernels.paged_decode import DecodeLaunch

#: Most key-loop steps (:func:`pagedbench.kernels.paged_decode.program_steps`: KV tiles
#: summed over sequences, times num_kv_heads) one interpreted call may take.
#:
#: Cost measured with triton 3.9.0 on this project's 2-core CI machine (AMD EPYC, other
#: jobs running beside), one call of each of the 14 model-preset cases this budget
#: admits, process CPU time, least-squares fit: about 3.8 ms per step plus about 6 ms
#: per program (sequence x KV head), within 0.06 s of every call. The tile size hardly
#: changes the cost of a step (16, 32 and 64 keys measured), so it is counted in steps.
#: (shared/research/cpu_peers.md found 3.5 ms per step for a similar kernel.)
#:
#: 320 admits every reduced model preset of :mod:`pagedbench.harness.cases` (batch 4,
#: contexts up to 160; the largest, phi3-mini with 32 KV heads, takes 288 steps and
#: 1.8 s) and rejects every full preset (batch 8, contexts up to 2048: 424 to 4576
#: steps) except llama3.1-70b-tp8, whose single KV head keeps it at 74 (block_size 32)
#: and 107 (block_size 16) steps, 0.3 and 0.5 s: no step budget can admit the reduced
#: phi3-mini and refuse those two.
INTERPRETER_STEP_BUDGET = 320

_CAPABILITIES = Capabilities(
    devices=frozenset({"cpu", "cuda"}),
    dtypes=frozenset({"float32", "float16", "bfloat16"}),
    head_dims=frozenset({64, 80, 96, 128, 256}),
    modes=frozenset({"decode"}),
    features=frozenset({"sliding_window", "logits_soft_cap"}),
)


class TritonPagedDecode(Adapter):
    """This project's Triton kernel: one program per (sequence, KV head), whole GQA group."""

    name = "pagedbench-triton"
    description = ("pagedbench's Triton paged decode: one program per sequence x KV head, "
                   "block table read per key tile, online softmax in float32")

    def capabilities(self) -> Capabilities:
        return _CAPABILITIES

    def available(self, device: str = "cpu") -> Availability:
        """Ready when triton imports and, on the CPU, the kernel runs interpreted.

        ``Availability.details`` records ``interpreted`` and ``kv_tile``.
        """
        device_type = torch.device(device).type
        if device_type not in _CAPABILITIES.devices:
            return Availability(False, f"device {device_type!r} not in "
                                       f"{sorted(_CAPABILITIES.devices)}")
        try:
            import triton

            from pagedbench.kernels import paged_decode
        except ImportError as exc:
            return Availability(False, f"triton not installed: {exc}")
        interpreted = paged_decode.kernel_is_interpreted()
        if device_type == "cpu" and not interpreted:
            if triton.knobs.runtime.interpret:
                reason = ("pagedbench.kernels.paged_decode was imported before "
                          "TRITON_INTERPRET=1 was set: set it before starting Python")
            else:
                reason = ("the Triton kernel runs on the CPU only under Triton's "
                          "interpreter: set TRITON_INTERPRET=1 before starting Python")
            return Availability(False, reason, triton.__version__)
        if device_type == "cuda" and not torch.cuda.is_available():
            return Availability(False, "no CUDA device visible to torch", triton.__version__)
        details = {"interpreted": str(interpreted).lower(),
                   "kv_tile": str(paged_decode.KV_TILE)}
        return Availability(True, version=triton.__version__, details=details)

    def is_interpreted(self, device: str) -> bool:
        """True on the CPU; on CUDA when the kernel module was imported interpreted."""
        if torch.device(device).type == "cpu":
            return True
        try:
            from pagedbench.kernels import paged_decode
        except ImportError:
            return False
        return paged_decode.kernel_is_interpreted()

    def why_unsupported(self, case: PagedCase, device: str) -> list[str]:
        """Capability reasons plus, when interpreted, the :data:`INTERPRETER_STEP_BUDGET`."""
        reasons = self.capabilities().why_unsupported(case, device)
        if not self.is_interpreted(device):
            return reasons
        try:
            from pagedbench.kernels.paged_decode import program_steps
        except ImportError:
            return reasons  # available() reports the missing triton
        steps = program_steps(case.kv_lens, case.num_kv_heads, case.sliding_window)
        if steps > INTERPRETER_STEP_BUDGET:
            reasons.append(f"too large for the Triton interpreter: {steps} steps > "
                           f"budget {INTERPRETER_STEP_BUDGET}")
        return reasons

    def prepare(self, inputs: PagedInputs) -> DecodeLaunch:
        """Validate and plan the launch; the output buffer is NaN until the kernel runs."""
        from pagedbench.kernels.paged_decode import plan_paged_decode

        case = inputs.case
        return plan_paged_decode(
            inputs.q, inputs.kv_cache, inputs.block_tables, inputs.kv_lens, inputs.sm_scale,
            out=new_output(inputs),
            sliding_window=case.sliding_window,
            logits_soft_cap=case.logits_soft_cap,
        )

    def run(self, prepared: DecodeLaunch) -> torch.Tensor:
        """Launch; returns ``Tensor[batch, num_q_heads, head_dim]`` in the case dtype."""
        return prepared()
