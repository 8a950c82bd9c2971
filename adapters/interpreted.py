"""Implementations whose kernels may run under Triton's interpreter: :class:`TritonAdapter`.

On the CPU (and on CUDA when imported under ``TRITON_INTERPRET=1``) a Triton kernel runs
under Triton's interpreter; the one budget mechanism for that (:class:`InterpreterBudget`,
a linear cost model of the launch, :class:`InterpretedWork`) makes too large a case
``unsupported``.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import ClassVar

import torch

from pagedbench.reference import PagedCase

from .base import Adapter


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for integers (``b > 0``), as ``triton.cdiv``: the programs or key
    steps of a launch grid, without importing Triton."""
    return -(-a // b)


@dataclass(frozen=True)
class InterpretedWork:
    """What one call launches, as an interpreter cost model counts it.

    Attributes
    ----------
    programs : int
        Programs in the launch grid(s).
    steps : int
        Iterations of the kernels' key loop, summed over all programs.
    step_weight : float
        Cost of one step relative to the model's reference step (e.g. ``head_dim / 64``).
    """

    programs: int
    steps: int
    step_weight: float = 1.0


@dataclass(frozen=True)
class InterpreterBudget:
    """The largest call an interpreted implementation takes: one call is estimated at
    ``programs * s_per_program + steps * step_weight * s_per_step`` seconds (coefficients
    fitted to process CPU time; ``docs/interpreter-budget.md`` has the fits and the
    command that measures them), and a case above ``max_s`` is unsupported."""

    s_per_program: float
    s_per_step: float
    max_s: float

    def seconds(self, work: InterpretedWork) -> float:
        return (work.programs * self.s_per_program
                + work.steps * work.step_weight * self.s_per_step)

    def why_over(self, work: InterpretedWork) -> list[str]:
        """The unsupported reason when ``work`` exceeds the budget; empty otherwise."""
        seconds = self.seconds(work)
        if seconds <= self.max_s:
            return []
        return [f"too large for Triton's interpreter: about {seconds:.1f} s per call "
                f"({work.programs} programs, {work.steps} key-loop steps) against a budget "
                f"of {self.max_s:g} s"]


class TritonAdapter(Adapter):
    """An implementation whose kernels are Triton's. On the CPU, and on CUDA when imported
    under ``TRITON_INTERPRET=1``, they run under Triton's interpreter: timings are then
    "interpreted", and a case whose call exceeds :attr:`interpreter_budget` is unsupported.
    """

    interpreter_budget: ClassVar[InterpreterBudget]

    @abc.abstractmethod
    def kernel_interpreted(self) -> bool | None:
        """Whether the imported kernel is Triton's ``InterpretedFunction`` (Triton decides
        at ``@triton.jit``, i.e. import, time, from ``TRITON_INTERPRET``); None when the
        kernel cannot be imported (``available()`` gives the reason)."""

    @abc.abstractmethod
    def interpreter_work(self, case: PagedCase) -> InterpretedWork:
        """Programs and key-loop steps of one call on ``case``, following the kernel's
        launch grid and tiling."""

    def is_interpreted(self, device: str) -> bool:
        """True on the CPU; on a visible CUDA device, :meth:`kernel_interpreted`."""
        if torch.device(device).type == "cpu":
            return True
        return torch.cuda.is_available() and bool(self.kernel_interpreted())

    def interpreter_missing(self) -> str:
        """Why the kernel cannot run on the CPU ("" when it can): it was not imported
        under Triton's interpreter. Call only once the kernel imports."""
        if self.kernel_interpreted():
            return ""
        import triton

        if triton.knobs.runtime.interpret:
            return (f"{self.name}'s kernel module was imported before TRITON_INTERPRET=1 "
                    "was set: set it before starting Python")
        return ("Triton kernels run on the CPU only under Triton's interpreter: set "
                "TRITON_INTERPRET=1 before starting Python")

    def why_unsupported(self, case: PagedCase, device: str) -> list[str]:
        """Capability reasons or, when there are none and the kernel runs interpreted, the
        :attr:`interpreter_budget`'s (the work of a case outside the capabilities, a
        degenerate one say, is not estimated)."""
        reasons = super().why_unsupported(case, device)
        if not reasons and self.is_interpreted(device) and self.kernel_interpreted() is not None:
            reasons += self.interpreter_budget.why_over(self.interpreter_work(case))
        return reasons
