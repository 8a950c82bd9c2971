"""What the Triton peers share: kernels of another project (vLLM's, SGLang's), loaded once
per process from that project's files (:mod:`.vllm_triton_import`,
:mod:`.vllm_triton_carry`, :mod:`.sglang_triton_load`), never from our package.

:class:`PeerTritonAdapter` answers ``available``, ``capabilities`` and
``kernel_interpreted`` from the loaded kernels; a subclass says how they load
(:meth:`~PeerTritonAdapter.load`) and which ``@triton.jit`` function it launches
(:meth:`~PeerTritonAdapter.jit_function`). :func:`window_of_one` is the reason shared by
the kernels that take a window as ``W - 1``.
"""

from __future__ import annotations

import abc
import functools
from collections.abc import Callable
from dataclasses import replace
from typing import Any, ClassVar

import torch

from pagedbench.reference import PagedCase, PagedInputs

from .base import Availability, Capabilities
from .interpreted import TritonAdapter

#: Why an interpreted peer takes no bfloat16 case.
BF16_INTERPRETED = ("Triton's interpreter computes bfloat16 tl.dot wrongly: "
                    "triton-lang/triton#11584")


def triton_capabilities(**axes: Any) -> Capabilities:
    """A Triton peer's compiled declaration: on the CPU (interpreted) and CUDA, in float32,
    float16 and bfloat16 (:meth:`PeerTritonAdapter.capabilities` narrows the dtypes when
    interpreted), and the other ``axes`` of :class:`~.base.Capabilities` as given."""
    return Capabilities(devices=frozenset({"cpu", "cuda"}),
                        dtypes=frozenset({"float32", "float16", "bfloat16"}), **axes)


def window_of_one(case: PagedCase, kernel: str) -> list[str]:
    """Why ``case``'s window of one key is refused by ``kernel``, which takes a window of
    ``W`` keys as ``W - 1`` and 0 as no window (LMDeploy's kernels, SGLang's extend)."""
    if case.sliding_window == 1:
        return [f"sliding_window 1 not supported: {kernel} takes W - 1, and 0 there means "
                "no window"]
    return []


#: Exception types (one, or a tuple as ``except`` takes them) and the reason they mean.
LoadFailures = tuple[tuple[type[BaseException] | tuple[type[BaseException], ...], str], ...]


def cached_load(load_kernels: Callable[[], Any],
                reasons: LoadFailures) -> Callable[[], tuple[Any | None, str]]:
    """``load_kernels`` called once per process, as ``(kernels, "")``, or as ``(None,
    "<reason>: <error>")`` for the first of ``reasons`` whose exception types it raised
    (any other exception propagates)."""
    caught = tuple(kind for kinds, _ in reasons
                   for kind in (kinds if isinstance(kinds, tuple) else (kinds,)))

    @functools.cache
    def loaded() -> tuple[Any | None, str]:
        try:
            return load_kernels(), ""
        except caught as exc:
            reason = next(text for kind, text in reasons if isinstance(exc, kind))
            return None, f"{reason}: {exc}"

    return loaded


class PeerTritonAdapter(TritonAdapter):
    """A peer's Triton kernels behind the contract (module docstring)."""

    #: What the kernel takes when compiled; :meth:`capabilities` narrows it when interpreted.
    CAPABILITIES: ClassVar[Capabilities]
    #: Why a ROCm build of torch is refused (the loading answers the peer's platform
    #: questions for CUDA and the CPU only).
    rocm_reason: ClassVar[str]

    @staticmethod
    @abc.abstractmethod
    def load() -> tuple[Any | None, str]:
        """The peer's kernels (loaded once per process), or ``None`` and why they cannot
        be loaded. The kernels object has ``version`` and ``source`` (where the files came
        from)."""

    @abc.abstractmethod
    def jit_function(self, kernels: Any) -> object:
        """One ``@triton.jit`` function of ``kernels`` that this adapter launches."""

    def load_details(self, kernels: Any) -> dict[str, object]:
        """``impl_details`` of the loaded kernels: their ``source``."""
        return {"source": kernels.source}

    def kernels(self) -> Any:
        """The loaded kernels.

        Raises
        ------
        RuntimeError
            With :meth:`load`'s reason, when they cannot be loaded.
        """
        kernels, reason = self.load()
        if kernels is None:
            raise RuntimeError(reason)
        return kernels

    def decode_case(self, inputs: PagedInputs) -> PagedCase:
        """``inputs.case``, for a kernel that takes one query token per sequence.

        Raises
        ------
        ValueError
            If the case is not a decode case (some ``q_lens`` > 1).
        """
        case = inputs.case
        if case.mode != "decode":
            raise ValueError(f"{self.name} runs decode cases only: q_lens must be None or "
                             f"all 1, got q_lens={case.q_lens}")
        return case

    def capabilities(self, device: str) -> Capabilities:
        """:attr:`CAPABILITIES`, without bfloat16 where the kernels run interpreted."""
        caps = self.CAPABILITIES
        if not self.is_interpreted(device):
            return caps
        return replace(caps, dtypes=caps.dtypes - {"bfloat16"},
                       notes={**caps.notes, "dtypes": BF16_INTERPRETED})

    def kernel_interpreted(self) -> bool | None:
        kernels, _ = self.load()
        if kernels is None:
            return None
        from triton.runtime.interpreter import InterpretedFunction

        return isinstance(self.jit_function(kernels), InterpretedFunction)

    def available(self, device: str = "cpu") -> Availability:
        device_type = torch.device(device).type
        if device_type not in self.CAPABILITIES.devices:
            return Availability(False, f"device {device_type!r} not in "
                                       f"{sorted(self.CAPABILITIES.devices)}")
        if torch.version.hip is not None:
            return Availability(False, f"ROCm builds of torch are not supported: {self.rocm_reason}")
        if device_type == "cuda" and not torch.cuda.is_available():
            return Availability(False, "no CUDA device visible to torch")
        kernels, reason = self.load()
        if kernels is None:
            return Availability(False, reason)
        if device_type == "cpu" and self.interpreter_missing():
            return Availability(False, self.interpreter_missing(), kernels.version)
        return Availability(True, version=kernels.version, details={
            **self.load_details(kernels), "interpreted": self.is_interpreted(device)})


__all__ = ["BF16_INTERPRETED", "PeerTritonAdapter", "cached_load", "triton_capabilities",
           "window_of_one"]
