"""The adapter contract: how pagedbench drives any paged-attention implementation.

An adapter turns the canonical :class:`~pagedbench.reference.PagedInputs` into its
implementation's layout and call. It declares what it supports on a device
(:class:`Capabilities`), whether it can run here (:class:`Availability`), does all
conversion and planning in ``prepare()`` (untimed, returning a :class:`Prepared`) and
only launches in ``run()`` (timed). Modelled on vLLM v1's attention-backend contract
(``supports_head_size``, ``get_supported_kernel_block_sizes`` with ``MultipleOf``) and
TRT-LLM's capability matrix with explicit skip reasons.

Triton implementations subclass :class:`~.interpreted.TritonAdapter` (``interpreted.py``):
on the CPU their kernels run under Triton's interpreter, within a budget.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, Union

import torch

from pagedbench.reference import PagedCase, PagedInputs
from pagedbench.reference.axes import KV_CACHE_DTYPES, LAYOUTS
from pagedbench.reference.yardstick import LOGITS_PRECISIONS

#: Optional features a case may use, as :attr:`PagedCase.features` names them: the
#: attention features, a V head dim other than the Q/K one (``"head_dim_v"``, MLA), and
#: the degenerate entries serving engines pad batches with: a sequence with ``kv_len`` 0
#: (``"empty_kv"``), one with ``q_len`` 0 (``"empty_q"``), and query rows that see no key
#: because ``q_len > kv_len > 0`` (``"unseen_rows"``). Rows that see no key output 0.
FEATURES = frozenset({"sliding_window", "logits_soft_cap", "alibi", "sinks", "head_dim_v",
                      "empty_kv", "empty_q", "unseen_rows"})
MODES = frozenset({"decode", "prefill"})

#: What :attr:`Availability.details` and :attr:`Prepared.facts` may hold: JSON scalars.
Fact = Union[str, int, float, bool]


@dataclass(frozen=True)
class MultipleOf:
    """Any positive multiple of ``n`` (vLLM's ``MultipleOf`` for kernel block sizes)."""

    n: int

    def __contains__(self, value: object) -> bool:
        return isinstance(value, int) and value > 0 and value % self.n == 0

    def __str__(self) -> str:
        return f"multiples of {self.n}"


@dataclass(frozen=True)
class AtLeast:
    """Any integer ``>= n`` (e.g. vLLM's Triton backend: ``head_size >= 32``)."""

    n: int

    def __contains__(self, value: object) -> bool:
        return isinstance(value, int) and value >= self.n

    def __str__(self) -> str:
        return f">= {self.n}"


_RULES = (MultipleOf, AtLeast)
Allowed = Union[int, MultipleOf, AtLeast]


def allows(allowed: Iterable[Allowed] | None, value: int) -> bool:
    """Whether ``value`` is in ``allowed`` (ints and :class:`MultipleOf` / :class:`AtLeast`
    rules; ``None`` allows everything)."""
    if allowed is None:
        return True
    return any(value in a if isinstance(a, _RULES) else value == a for a in allowed)


def _sorted_allowed(allowed: Iterable[Allowed]) -> list[Allowed]:
    """Plain values in ascending order, then the rules."""
    plain = sorted(a for a in allowed if not isinstance(a, _RULES))
    rules = sorted((a for a in allowed if isinstance(a, _RULES)), key=lambda a: (str(type(a)), a.n))
    return [*plain, *rules]


def _format_allowed(allowed: Iterable[Allowed]) -> str:
    return ", ".join(map(str, _sorted_allowed(allowed)))


def _version(capability: tuple[int, int]) -> str:
    return f"{capability[0]}.{capability[1]}"


def _version_range(low: tuple[int, int] | None, high: tuple[int, int] | None) -> str:
    """``">= 8.0"``, ``"<= 9.0"``, ``"9.0"`` or ``"8.0 to 9.0"``; one bound is given."""
    if high is None:
        return f">= {_version(low)}"
    if low is None:
        return f"<= {_version(high)}"
    return _version(low) if low == high else f"{_version(low)} to {_version(high)}"


@dataclass(frozen=True)
class Capabilities:
    """What an implementation supports on one device; ``None`` for an axis means "any".

    Attributes
    ----------
    devices : frozenset[str]
        Device types, ``"cpu"`` and/or ``"cuda"``.
    dtypes : frozenset[str]
        Q/K/V/O dtypes by :data:`~pagedbench.reference.DTYPES` names.
    head_dims, block_sizes, gqa_ratios : frozenset[int | MultipleOf | AtLeast] or None
        Allowed values; ``MultipleOf(16)`` admits 16, 32, 48, ..., ``AtLeast(32)`` 32,
        33, ...
    v_head_dims : frozenset[int | MultipleOf | AtLeast] or None
        Allowed V (and output) head dims; ``None``: ``head_dims``'. A V head dim other than
        the Q/K one (``head_dim_v``) also needs the feature ``"head_dim_v"``; an MLA kernel
        declares ``head_dims={576}``, ``v_head_dims={512}``.
    modes : frozenset[str]
        ``"decode"`` (one query token per sequence) and/or ``"prefill"`` (several,
        causal bottom-right, also mixed with decodes).
    features : frozenset[str]
        Optional features from :data:`FEATURES` the implementation handles (the
        degenerate rows among them).
    kv_cache_dtypes : frozenset[str]
        KV-cache storage types from :data:`~pagedbench.reference.axes.KV_CACHE_DTYPES`;
        ``"auto"`` means the KV cache has the case dtype.
    min_compute_capability : tuple[int, int] or None
        Lowest CUDA compute capability; :meth:`why_unsupported` reads the device's.
    max_compute_capability : tuple[int, int] or None
        Highest CUDA compute capability, for kernels built for one architecture only
        (FlashMLA's dense decoding: SM90a); ``None``: no bound.
    layouts : frozenset[str]
        Memory layouts of the inputs (:data:`~pagedbench.reference.axes.LAYOUTS`) the
        adapter takes as they are: strided ``q``, a cache that is a view into a larger
        allocation, a strided output buffer. ``{"contiguous"}`` by default.
    max_num_blocks : int or None
        Largest pool (``num_blocks``, so block ids below it) the implementation takes;
        ``None``: any.
    batch_invariant : bool
        True when a sequence's output is bitwise the same whatever other sequences share
        its batch (one program per sequence, or a fixed split size: FlashInfer's
        ``fixed_split_size``, vLLM's ``VLLM_BATCH_INVARIANT``); the metamorphic suite
        then checks equality bit for bit, otherwise within the tolerance.
    nan_safe_tail : bool
        True (the default, and what pagedbench's own kernels guarantee) when the result
        cannot depend on the unused slots at the end of a sequence's partly filled last
        block, even if they hold NaN. False declares that the kernel reads those slots and
        multiplies them by zero probabilities (``0 * NaN = NaN``): conformance then puts
        finite stale V values there instead (``materialize(..., tail_poison="stale")``; K
        there and every other unused slot stay NaN, so a logit computed for a key past
        ``kv_len`` still fails), records ``tail_poison: "stale"``, marks the passes, and
        checks that the declaration is still true. vLLM fixed this class of fault in its
        CUDA kernel (vllm-project/vllm#641).
    shared_blocks : bool
        True (the default) when block tables may point to the same physical block, as
        prefix caching and beam-search forks make them (``PagedCase.shared_blocks``).
        False declares that the implementation keys some state by physical block id
        (scratch, a cache, a scale table) and so cannot take shared blocks: such cases
        are then ``unsupported`` with that reason.
    logits_precision : str
        ``"float32"`` (the default: the logits and softmax are computed in float32, as a
        tensor-core Q.K^T accumulates) or ``"case"``: the implementation computes them in
        the case dtype (e.g. multiplies q and k elementwise in fp16), the shortcut
        FlashAttention's same-precision reference takes. Conformance then judges it
        against a yardstick that does the same, marks its passes, and a test checks that
        the declaration is still needed.
    needs_latent_cache : bool
        True when the implementation reads V from K's storage of one latent KV head (MLA
        kernels): it takes only cases with ``PagedCase.latent_cache`` and one KV head. Any
        other implementation takes latent cases too.
    returns_lse : bool
        True when :meth:`Adapter.lse` gives, after ``run``, each query row's log-sum-exp
        (``Tensor[total_q, num_q_heads]``, float32, natural log, the sink included),
        as split-KV merges, FlashAttention and FlashInfer return it: it is then judged
        against the float64 truth (``reference/lse.py``, ``harness/verdict/tolerance.py``).
    kv_cache_in_place : bool
        True when ``run`` reads ``inputs.kv_cache`` where it lies (``prepare`` copies no
        K or V), so values written into it between calls are what the next call reads, as
        an engine's cache write is. The timed calls are then checked on new K and V as
        well as new Q written into the same tensors; otherwise on new Q only
        (``prepare`` may lay the cache out for the library, untimed).
    plan_reuse : bool
        True when a plan made by ``prepare`` serves later steps of the same batch shape
        once their metadata is written into the same tensors and :meth:`Adapter.refresh`
        has seen them, as FlashInfer's ``plan``/``run`` and a CUDA graph captured once and
        replayed are used: the serving loop then prepares once per batch shape (batch
        size, query rows) and refreshes at every later step of it.
    notes : Mapping[str, str]
        Why an axis is narrower than the library's own, keyed by the attribute name
        (``{"dtypes": "..."}``); appended to that axis's unsupported reason.

    Raises
    ------
    ValueError
        If ``features`` names something outside :data:`FEATURES`, ``kv_cache_dtypes``
        something outside ``KV_CACHE_DTYPES``, ``layouts`` something outside ``LAYOUTS``,
        or ``notes`` an unknown attribute.
    """

    devices: frozenset[str]
    dtypes: frozenset[str]
    head_dims: frozenset[Allowed] | None = None
    v_head_dims: frozenset[Allowed] | None = None
    block_sizes: frozenset[Allowed] | None = None
    gqa_ratios: frozenset[Allowed] | None = None
    modes: frozenset[str] = frozenset({"decode"})
    features: frozenset[str] = frozenset()
    kv_cache_dtypes: frozenset[str] = frozenset({"auto"})
    min_compute_capability: tuple[int, int] | None = None
    max_compute_capability: tuple[int, int] | None = None
    nan_safe_tail: bool = True
    logits_precision: str = "float32"
    layouts: frozenset[str] = frozenset({"contiguous"})
    max_num_blocks: int | None = None
    batch_invariant: bool = False
    shared_blocks: bool = True
    needs_latent_cache: bool = False
    returns_lse: bool = False
    kv_cache_in_place: bool = False
    plan_reuse: bool = False
    notes: Mapping[str, str] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        unknown = sorted(self.features - FEATURES)
        if unknown:
            raise ValueError(f"features {unknown} unknown; choose from {sorted(FEATURES)}")
        unknown = sorted(self.kv_cache_dtypes - KV_CACHE_DTYPES.keys())
        if unknown:
            raise ValueError(
                f"kv_cache_dtypes {unknown} unknown; choose from {sorted(KV_CACHE_DTYPES)}"
            )
        if self.logits_precision not in LOGITS_PRECISIONS:
            raise ValueError(f"logits_precision must be one of {LOGITS_PRECISIONS}, got "
                             f"{self.logits_precision!r}")
        unknown = sorted(self.layouts - set(LAYOUTS))
        if unknown:
            raise ValueError(f"layouts {unknown} unknown; choose from {list(LAYOUTS)}")
        axes = {f.name for f in fields(self)} - {"notes"}
        unknown = sorted(set(self.notes) - axes)
        if unknown:
            raise ValueError(f"notes name unknown attributes {unknown}; choose from {sorted(axes)}")

    def _noted(self, attribute: str, reason: str) -> str:
        note = self.notes.get(attribute)
        return f"{reason} ({note})" if note else reason

    def why_unsupported(self, case: PagedCase, device: str) -> list[str]:
        """Reasons this implementation cannot run ``case`` on ``device``; empty if it can.

        Each reason names the axis, the case's value and the supported values, and is
        recorded verbatim as the ``unsupported`` reason. On a visible CUDA device, its
        compute capability is checked against :attr:`min_compute_capability` and
        :attr:`max_compute_capability`.
        """
        reasons = []
        device_type = torch.device(device).type
        if device_type not in self.devices:
            reasons.append(self._noted(
                "devices", f"device {device_type!r} not in {sorted(self.devices)}"))
        if case.dtype not in self.dtypes:
            reasons.append(self._noted(
                "dtypes", f"dtype {case.dtype} not in {sorted(self.dtypes)}"))
        checks = [
            ("head_dims", "head_dim", case.head_dim),
            ("block_sizes", "block_size", case.block_size),
            ("gqa_ratios", "gqa ratio", case.gqa_ratio),
        ]
        if self.v_head_dims is not None:
            checks.insert(1, ("v_head_dims", "head_dim_v", case.v_head_dim))
        elif case.head_dim_v is not None:
            checks.insert(1, ("head_dims", "head_dim_v", case.head_dim_v))
        for attribute, axis, value in checks:
            allowed = getattr(self, attribute)
            if not allows(allowed, value):
                reasons.append(self._noted(attribute, f"{axis} {value} not supported "
                                                      f"(supported: {_format_allowed(allowed)})"))
        if case.mode not in self.modes:
            reasons.append(self._noted("modes", f"mode {case.mode!r} not in {sorted(self.modes)}"))
        for feature in sorted(case.features - self.features):
            reasons.append(self._noted("features", f"feature {feature!r} not supported"))
        if case.kv_cache_dtype not in self.kv_cache_dtypes:
            reasons.append(self._noted(
                "kv_cache_dtypes",
                f"kv_cache_dtype {case.kv_cache_dtype!r} not in {sorted(self.kv_cache_dtypes)}"))
        if case.layout not in self.layouts:
            reasons.append(self._noted(
                "layouts", f"layout {case.layout!r} not in {sorted(self.layouts)}"))
        if self.max_num_blocks is not None and case.pool_blocks > self.max_num_blocks:
            reasons.append(self._noted(
                "max_num_blocks", f"num_blocks {case.pool_blocks} not supported "
                                  f"(supported: <= {self.max_num_blocks})"))
        if self.needs_latent_cache and not case.latent_cache:
            reasons.append(self._noted(
                "needs_latent_cache", "a separate V not supported: reads V as the first "
                                      "head_dim_v channels of K (needs latent_cache)"))
        if self.needs_latent_cache and case.num_kv_heads != 1:
            reasons.append(self._noted(
                "needs_latent_cache", f"num_kv_heads {case.num_kv_heads} not supported "
                                      "(supported: 1, MLA's one latent KV head)"))
        if case.shared_blocks is not None and not self.shared_blocks:
            reasons.append(self._noted(
                "shared_blocks", f"shared blocks {list(case.shared_blocks)} not supported "
                                 "(block tables that point to the same physical block)"))
        if device_type == "cuda" and (self.min_compute_capability is not None
                                      or self.max_compute_capability is not None):
            reasons += self._compute_capability_reasons(torch.device(device).index)
        return reasons

    def _compute_capability_reasons(self, index: int | None) -> list[str]:
        """Empty when the device's compute capability is within the bounds, or when torch
        sees no such device (``available()`` says so)."""
        if not torch.cuda.is_available() or (index or 0) >= torch.cuda.device_count():
            return []
        have = torch.cuda.get_device_capability(index)
        low, high = self.min_compute_capability, self.max_compute_capability
        if (low is None or have >= low) and (high is None or have <= high):
            return []
        axis = "min_compute_capability" if low is not None and have < low else \
            "max_compute_capability"
        return [self._noted(axis, f"compute capability {_version(have)} of "
                                  f"{torch.cuda.get_device_name(index)} not supported "
                                  f"(supported: {_version_range(low, high)})")]

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form, for ``pagedbench list --json``."""

        def axis(values: frozenset | None) -> list[Any] | None:
            if values is None:
                return None
            return [str(v) if isinstance(v, _RULES) else v for v in _sorted_allowed(values)]

        return {
            "devices": sorted(self.devices),
            "dtypes": sorted(self.dtypes),
            "head_dims": axis(self.head_dims),
            "v_head_dims": axis(self.v_head_dims),
            "block_sizes": axis(self.block_sizes),
            "gqa_ratios": axis(self.gqa_ratios),
            "modes": sorted(self.modes),
            "features": sorted(self.features),
            "kv_cache_dtypes": sorted(self.kv_cache_dtypes),
            "min_compute_capability": self.min_compute_capability,
            "max_compute_capability": self.max_compute_capability,
            "nan_safe_tail": self.nan_safe_tail,
            "logits_precision": self.logits_precision,
            "layouts": [layout for layout in LAYOUTS if layout in self.layouts],
            "max_num_blocks": self.max_num_blocks,
            "batch_invariant": self.batch_invariant,
            "shared_blocks": self.shared_blocks,
            "needs_latent_cache": self.needs_latent_cache,
            "returns_lse": self.returns_lse,
            "kv_cache_in_place": self.kv_cache_in_place,
            "plan_reuse": self.plan_reuse,
            "notes": dict(self.notes),
        }


@dataclass(frozen=True)
class Availability:
    """Whether an implementation can run here.

    Attributes
    ----------
    ok : bool
        True when it can run on the device asked about.
    reason : str
        Why not, when ``ok`` is False (e.g. "vllm not installed: No module named 'vllm'").
    version : str
        The library's version, or ``""`` when unknown.
    details : dict[str, str | int | float | bool]
        Extra facts to record with each result (ISA, whether interpreted, ...); booleans
        and numbers as such, never as strings.
    """

    ok: bool
    reason: str = ""
    version: str = ""
    details: dict[str, Fact] = field(default_factory=dict)


@dataclass(frozen=True)
class Prepared:
    """What ``prepare()`` returns: one bound call and where its output lands.

    Attributes
    ----------
    call : Callable[[], Tensor | None]
        The launch with every argument bound (usually a ``functools.partial`` of the
        library function, whose ``keywords`` tests may read); calling it does only the
        work that is timed.
    out : Tensor[total_q, num_q_heads, head_dim] or None
        The buffer ``call`` writes (``new_output``: NaN until then); None when ``call``
        returns a new tensor.
    out_shape : tuple[int, int, int] or None
        When ``out`` is None, ``(total_q, num_q_heads, head_dim)``: the view of the returned
        tensor :meth:`launch` gives (for libraries returning ``[batch, 1, ...]`` or
        ``[1, total_q, ...]``); None returns it as it is.
    facts : dict[str, str | int | float | bool]
        What the library resolved for this case (sub-kernel, split count, ISA): the
        default :meth:`Adapter.describe`.
    lse : Tensor[total_q, num_q_heads], float32, or None
        The buffer ``call`` writes each row's log-sum-exp into, for an implementation
        declaring ``Capabilities.returns_lse``: the default :meth:`Adapter.lse`.
    """

    call: Callable[[], torch.Tensor | None]
    out: torch.Tensor | None = None
    out_shape: tuple[int, int, int] | None = None
    facts: dict[str, Fact] = field(default_factory=dict)
    lse: torch.Tensor | None = None

    def launch(self) -> torch.Tensor:
        """Call; return ``out``, or the call's result (viewed as ``out_shape`` if set)."""
        result = self.call()
        if self.out is not None:
            return self.out
        return result if self.out_shape is None else result.view(self.out_shape)


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
    def capabilities(self, device: str) -> Capabilities:
        """What runs on ``device`` (``"cpu"``, ``"cuda"``, ``"cuda:N"``)."""

    @abc.abstractmethod
    def available(self, device: str = "cpu") -> Availability: ...

    #: True when ``prepare`` compiles for each new shape (seconds per case: FlexAttention
    #: under ``torch.compile``); the ``ci`` profile then runs only the core edge probes.
    compiles_per_shape: ClassVar[bool] = False

    def is_interpreted(self, device: str) -> bool:
        """True when ``run`` on ``device`` executes under an interpreter (Triton's on the
        CPU): its timing is then recorded as "interpreted" and never ranked."""
        return False

    def why_unsupported(self, case: PagedCase, device: str) -> list[str]:
        """Reasons from :meth:`capabilities`; adapters may add their own limits."""
        return self.capabilities(device).why_unsupported(case, device)

    @abc.abstractmethod
    def prepare(self, inputs: PagedInputs) -> Prepared: ...

    def describe(self, prepared: Prepared) -> dict[str, Fact]:
        """Facts about the call ``prepared`` will make that the library resolved per case
        (sub-kernel, ISA, split count), recorded in the result's ``impl_details`` beside
        :attr:`Availability.details`: :attr:`Prepared.facts`."""
        return dict(prepared.facts) if isinstance(prepared, Prepared) else {}

    def run(self, prepared: Prepared) -> torch.Tensor:
        """Launch: :meth:`Prepared.launch`."""
        return prepared.launch()

    def refresh(self, prepared: Prepared, inputs: PagedInputs) -> Prepared:
        """Serving loop, for an implementation declaring ``plan_reuse``: the plan of a
        later step of the batch shape ``prepared`` was made for. ``inputs`` holds the same
        ``q``, ``kv_cache``, ``block_tables``, ``kv_lens`` and ``cu_seqlens_q`` tensors as
        the inputs ``prepared`` came from, their values updated in place (a new case and
        ``slot_mapping``). Return what to run; by default ``prepared`` itself, for a call
        that reads its metadata when launched (a replayed graph)."""
        return prepared

    def write_kv(self, kv_cache: torch.Tensor, slot_mapping: torch.Tensor, key: torch.Tensor,
                 value: torch.Tensor, case: PagedCase) -> bool:
        """Serving loop: write new tokens' K and V into the pool with the implementation's
        own cache-write op (vLLM's ``reshape_and_cache``, SGLang's buffer setter); False
        when it has none for ``case`` (pagedbench's writer then stores them).

        Parameters
        ----------
        kv_cache : Tensor[num_blocks, 2, block_size, num_kv_heads, cache_head_dim]
            The loop's pool, ``case.kv_cache_dtype``.
        slot_mapping : Tensor[n], int64
            Physical slot of each new token.
        key : Tensor[n, num_kv_heads, head_dim], float32
        value : Tensor[n, num_kv_heads, v_head_dim], float32
            Before storing: an fp8 cache holds ``key / case.k_scale`` and ``value /
            case.v_scale``, saturated.
        """
        return False

    def lse(self, prepared: Prepared) -> torch.Tensor | None:
        """After :meth:`run`, each query row's log-sum-exp, ``Tensor[total_q,
        num_q_heads]`` float32 natural log (only asked of an implementation declaring
        ``Capabilities.returns_lse``): :attr:`Prepared.lse`."""
        return prepared.lse if isinstance(prepared, Prepared) else None
