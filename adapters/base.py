"""The adapter contract: how pagedbench drives any paged-attention implementation.

An adapter turns the canonical :class:`~pagedbench.reference.PagedInputs` into its
implementation's layout and call. It declares what it supports (:class:`Capabilities`),
whether it can run here (:class:`Availability`), does all conversion and planning in
``prepare()`` (untimed) and only launches in ``run()`` (timed). Modelled on vLLM v1's
attention-backend contract (``supports_head_size``, ``get_supported_kernel_block_sizes``
with ``MultipleOf``) and TRT-LLM's capability matrix with explicit skip reasons.
"""

from __future__ import annotations

import abc
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from pagedbench.reference import PagedCase, PagedInputs
from pagedbench.reference.case import KV_CACHE_DTYPES

#: Optional features a case may use, as :attr:`PagedCase.features` names them.
FEATURES = frozenset({"sliding_window", "logits_soft_cap", "alibi", "sinks"})
MODES = frozenset({"decode", "prefill"})


@dataclass(frozen=True)
class MultipleOf:
    """Any positive multiple of ``n`` (vLLM's ``MultipleOf`` for kernel block sizes)."""

    n: int

    def __contains__(self, value: object) -> bool:
        return isinstance(value, int) and value > 0 and value % self.n == 0

    def __str__(self) -> str:
        return f"multiples of {self.n}"


def allows(allowed: Iterable[int | MultipleOf] | None, value: int) -> bool:
    """Whether ``value`` is in ``allowed`` (ints and :class:`MultipleOf` rules; ``None``
    allows everything)."""
    if allowed is None:
        return True
    return any(value in a if isinstance(a, MultipleOf) else value == a for a in allowed)


def _describe(allowed: Iterable[int | MultipleOf]) -> str:
    plain = sorted(a for a in allowed if not isinstance(a, MultipleOf))
    rules = [str(a) for a in allowed if isinstance(a, MultipleOf)]
    return ", ".join([*map(str, plain), *rules])


@dataclass(frozen=True)
class Capabilities:
    """What an implementation supports; ``None`` for an axis means "any value".

    Attributes
    ----------
    devices : frozenset[str]
        Device types, ``"cpu"`` and/or ``"cuda"``.
    dtypes : frozenset[str]
        Q/K/V/O dtypes by :data:`~pagedbench.reference.DTYPES` names.
    head_dims, block_sizes, gqa_ratios : frozenset[int | MultipleOf] or None
        Allowed values; ``MultipleOf(16)`` admits 16, 32, 48, ...
    modes : frozenset[str]
        ``"decode"`` (one query token per sequence) and/or ``"prefill"`` (several,
        causal bottom-right, also mixed with decodes).
    features : frozenset[str]
        Optional features from :data:`FEATURES` the implementation handles.
    kv_cache_dtypes : frozenset[str]
        KV-cache storage types from :data:`~pagedbench.reference.case.KV_CACHE_DTYPES`;
        ``"auto"`` means the KV cache has the case dtype.
    min_compute_capability : tuple[int, int] or None
        Lowest CUDA compute capability, for ``cuda`` runs.
    nan_safe_tail : bool
        True (the default, and what pagedbench's own kernels guarantee) when the result
        cannot depend on the unused slots at the end of a sequence's partly filled last
        block, even if they hold NaN. False declares that the kernel reads those slots and
        multiplies them by zero probabilities (``0 * NaN = NaN``): a NaN or Inf left in a
        reused block by an earlier request then corrupts the output. Conformance judges
        such an implementation with finite stale V values in those slots instead of NaN
        (``materialize(..., tail_poison="stale")``; K there and every other unused slot
        stay NaN, so a logit computed for a key past ``kv_len`` still fails),
        records ``tail_poison: "stale"`` and marks its passes, and checks that the
        declaration is still true. Found in vLLM's CPU op and compiled FlexAttention on
        the CPU; vLLM fixed the same class in its CUDA kernel (vllm-project/vllm#641).

    Raises
    ------
    ValueError
        If ``features`` names something outside :data:`FEATURES`, or
        ``kv_cache_dtypes`` something outside ``KV_CACHE_DTYPES``.
    """

    devices: frozenset[str]
    dtypes: frozenset[str]
    head_dims: frozenset[int | MultipleOf] | None = None
    block_sizes: frozenset[int | MultipleOf] | None = None
    gqa_ratios: frozenset[int | MultipleOf] | None = None
    modes: frozenset[str] = frozenset({"decode"})
    features: frozenset[str] = frozenset()
    kv_cache_dtypes: frozenset[str] = frozenset({"auto"})
    min_compute_capability: tuple[int, int] | None = None
    nan_safe_tail: bool = True

    @property
    def tail_poison(self) -> str:
        """What conformance puts in the tail of each last block: ``"nan"`` or ``"stale"``."""
        return "nan" if self.nan_safe_tail else "stale"

    def __post_init__(self) -> None:
        unknown = sorted(self.features - FEATURES)
        if unknown:
            raise ValueError(f"features {unknown} unknown; choose from {sorted(FEATURES)}")
        unknown = sorted(self.kv_cache_dtypes - KV_CACHE_DTYPES.keys())
        if unknown:
            raise ValueError(
                f"kv_cache_dtypes {unknown} unknown; choose from {sorted(KV_CACHE_DTYPES)}"
            )

    def why_unsupported(self, case: PagedCase, device: str) -> list[str]:
        """Reasons this implementation cannot run ``case`` on ``device``; empty if it can.

        Each reason names the axis, the case's value and the supported values, and is
        recorded verbatim as the ``unsupported`` reason.
        """
        reasons = []
        device_type = torch.device(device).type
        if device_type not in self.devices:
            reasons.append(f"device {device_type!r} not in {sorted(self.devices)}")
        if case.dtype not in self.dtypes:
            reasons.append(f"dtype {case.dtype} not in {sorted(self.dtypes)}")
        checks = [
            ("head_dim", case.head_dim, self.head_dims),
            ("block_size", case.block_size, self.block_sizes),
            ("gqa ratio", case.gqa_ratio, self.gqa_ratios),
        ]
        for axis, value, allowed in checks:
            if not allows(allowed, value):
                reasons.append(f"{axis} {value} not supported (supported: {_describe(allowed)})")
        if case.mode not in self.modes:
            reasons.append(f"mode {case.mode!r} not in {sorted(self.modes)}")
        for feature in sorted(case.features - self.features):
            reasons.append(f"feature {feature!r} not supported")
        if case.kv_cache_dtype not in self.kv_cache_dtypes:
            reasons.append(
                f"kv_cache_dtype {case.kv_cache_dtype!r} not in {sorted(self.kv_cache_dtypes)}"
            )
        return reasons

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form, for ``pagedbench list --json``."""

        def axis(values: frozenset | None) -> list[Any] | None:
            if values is None:
                return None
            return [str(v) if isinstance(v, MultipleOf) else v
                    for v in sorted(values, key=lambda v: (isinstance(v, MultipleOf),
                                                           v.n if isinstance(v, MultipleOf) else v))]

        return {
            "devices": sorted(self.devices),
            "dtypes": sorted(self.dtypes),
            "head_dims": axis(self.head_dims),
            "block_sizes": axis(self.block_sizes),
            "gqa_ratios": axis(self.gqa_ratios),
            "modes": sorted(self.modes),
            "features": sorted(self.features),
            "kv_cache_dtypes": sorted(self.kv_cache_dtypes),
            "min_compute_capability": self.min_compute_capability,
            "nan_safe_tail": self.nan_safe_tail,
        }


@dataclass(frozen=True)
class Availability:
    """Whether an implementation can run here.

    Attributes
    ----------
    ok : bool
    reason : str
        Why not, when ``ok`` is False (e.g. "vllm not installed: No module named 'vllm'").
    version : str
        The library's version, or ``""`` when unknown.
    details : dict
        Extra facts to record with each result (resolved sub-kernel, ISA, ...).
    """

    ok: bool
    reason: str = ""
    version: str = ""
    details: dict[str, str] = field(default_factory=dict)


class Adapter(abc.ABC):
    """One implementation behind the contract. Subclasses set :attr:`name`.

    Lifecycle per case: ``available(device)`` -> ``why_unsupported(case, device)`` ->
    ``prepare(inputs)`` (untimed: layout conversion, planning, output allocation) ->
    ``run(prepared)`` (timed; may be called many times on one ``prepared``).
    ``run`` returns ``Tensor[total_q, num_q_heads, head_dim]`` in the case dtype.
    """

    name: ClassVar[str]
    #: One line for ``pagedbench list``.
    description: ClassVar[str] = ""

    @abc.abstractmethod
    def capabilities(self) -> Capabilities: ...

    @abc.abstractmethod
    def available(self, device: str = "cpu") -> Availability: ...

    def is_interpreted(self, device: str) -> bool:
        """True when ``run`` on ``device`` executes under an interpreter (Triton's on the
        CPU): its timing is then recorded as "interpreted" and never ranked."""
        return False

    def why_unsupported(self, case: PagedCase, device: str) -> list[str]:
        """Reasons from :meth:`capabilities`; adapters may add their own limits."""
        return self.capabilities().why_unsupported(case, device)

    @abc.abstractmethod
    def prepare(self, inputs: PagedInputs) -> Any: ...

    def describe(self, prepared: Any) -> dict[str, str]:
        """Facts about the call ``prepared`` will make that the library resolved per case
        (sub-kernel, ISA, split count), recorded in the result's ``impl_details`` beside
        :attr:`Availability.details`. Default: none."""
        return {}

    @abc.abstractmethod
    def run(self, prepared: Any) -> torch.Tensor: ...
