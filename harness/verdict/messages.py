"""What crosses between the two sides of a check: the steps, declared once, the typed
messages of the implementation's side and the judge's replies, and the values they carry
(an output as a :class:`Descriptor` and its float32 bytes, :func:`encode` and
:func:`decode`; what an adapter reports about itself as JSON data, :func:`to_json_data`).
Imports nothing heavy at import time (a worker reads its job before it imports torch).

A check has two sides (:mod:`.conformance`): the implementation's, which runs the adapter
and sends messages, and the judge's, which draws its own inputs, computes the truth and
answers. pytest drives both in one process; the runner puts the implementation's side in
a worker process and carries each message over a pipe as one JSON line (``model_dump``),
followed by the raw bytes of its ``payload`` when it has one (``nbytes`` on the line).
:func:`parse_message` is the one place a line becomes a message: anything that is not one
of :data:`Message`'s kinds, with its fields of their types, is refused.

:data:`JOB_STEPS` names the steps of each kind of job in the order a worker may enter them
within one item, and :func:`party_of` the party each is charged to; a worker announces a
step by name (:class:`Entered`) and its party comes from here, never from the worker.
"""

from __future__ import annotations

import enum
import json
import math
import sys
from pathlib import PurePath
from typing import TYPE_CHECKING, Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, JsonValue, TypeAdapter, ValidationError

from pagedbench.reference.errors import PagedInputError, PagedTypeError, PagedValueError

if TYPE_CHECKING:
    from pagedbench.reference import PagedCase

#: Parties a step is charged to: the implementation (its worker) or pagedbench (the judge).
IMPL, HARNESS = "impl", "harness"
Party = Literal["impl", "harness"]

#: The steps of each kind of job, in the order a worker may enter them within one item
#: (loading, ``import`` and ``available``, once per worker before its first item).
JOB_STEPS: dict[str, tuple[str, ...]] = {
    "evaluate": ("import", "available", "case", "why_unsupported", "inputs", "prepare", "run",
                 "describe", "nan-tail probe", "output", "timing"),
    "loop": ("import", "available", "step", "write", "why_unsupported", "prepare", "run",
             "output"),
    "list": ("import", "available"),
    "peaks": ("device peaks",),
}
#: Steps that are pagedbench's own work in the worker; every other step is the
#: implementation's.
HARNESS_STEPS = frozenset({"device peaks"})


def party_of(step: str) -> str:
    """The party ``step`` is charged to: :data:`HARNESS` or :data:`IMPL`."""
    return HARNESS if step in HARNESS_STEPS else IMPL


#: Longest type name of a non-tensor output kept in its descriptor.
TYPE_NAME_CHARS = 100
#: Largest number of dimensions of an output descriptor.
MAX_DIMS = 8


class _Message(BaseModel):
    """A message: frozen, no field beyond its own; ``payload`` (raw bytes after the line)
    and ``exception`` (what the adapter raised, for pytest's traceback) never travel in
    JSON."""

    model_config = ConfigDict(extra="forbid", frozen=True, arbitrary_types_allowed=True)

    payload: bytes = Field(default=b"", exclude=True)
    exception: Optional[BaseException] = Field(default=None, exclude=True, repr=False)

    def to_line(self) -> bytes:
        """One JSON line, with ``nbytes`` when a payload follows it."""
        data = self.model_dump(mode="json")
        if self.payload:
            data["nbytes"] = len(self.payload)
        return _OBJECT.dump_json(data) + b"\n"


class Entered(_Message):
    """The worker enters ``step`` of ``item`` (``None``: loading, before the first item)."""

    kind: Literal["step"] = "step"
    item: Optional[int] = None
    step: str


class Loaded(_Message):
    """The adapter imported and answered ``available``: its listing row (data for
    :class:`~pagedbench.harness.results.record.ListingRow`)."""

    kind: Literal["loaded"] = "loaded"
    row: dict[str, JsonValue]


class Fatal(_Message):
    """Loading failed (the implementation's fault): every remaining item gets ``status``."""

    kind: Literal["fatal"] = "fatal"
    status: str
    step: str
    reason: str


class Concluded(_Message):
    """The implementation's side ended ``item`` itself: ``unsupported`` with the reasons,
    or ``error`` in ``step`` (anything else it claims counts as ``error``)."""

    kind: Literal["outcome"] = "outcome"
    item: Optional[int] = None
    status: str
    step: Optional[str]
    reason: str


class Ready(_Message):
    """The implementation takes ``item``: what it declares of it (tail poison, logits
    precision, whether it returns its log-sum-exp and reads the cache in place); the
    judge computes the truth, then answers :class:`Go`."""

    kind: Literal["ready"] = "ready"
    item: Optional[int] = None
    tail_poison: Literal["nan", "stale"]
    logits_precision: Literal["float32", "case"]
    returns_lse: bool = False
    kv_cache_in_place: bool = False


class Descriptor(BaseModel):
    """What an output is: ``type`` (``"Tensor"`` or the type's name), and for a tensor its
    shape, dtype and the bytes of values sent (float32, C order; 0 when its shape or
    dtype is not the case's)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    type: Annotated[str, Field(max_length=TYPE_NAME_CHARS)]
    shape: Optional[list[Annotated[int, Field(ge=0, lt=2**40)]]] = Field(
        default=None, max_length=MAX_DIMS)
    dtype: Optional[Annotated[str, Field(max_length=40)]] = None
    nbytes: Annotated[int, Field(ge=0)] = 0


class Output(_Message):
    """The output of ``run`` (and, for an implementation declaring it, the log-sum-exp:
    ``outputs[1]``), ``describe()``'s facts and the NaN-tail probe; values in
    ``payload``, each descriptor's ``nbytes`` in turn."""

    kind: Literal["output"] = "output"
    item: Optional[int] = None
    outputs: list[Descriptor] = Field(min_length=1, max_length=2)
    details: dict[str, JsonValue]
    nan_tail_output_finite: Optional[bool]


class Timed(_Message):
    """The timing of ``item``: milliseconds per call of each sample and the calls it
    averaged, the method, the drift probe, a CUDA timing's conditions (input copies
    rotated, SM clock and temperature before and after, why a planned graph fell back),
    the calls made on new inputs (``refreshed_calls``: every call of a CPU timing, warm-up
    included; the first of one whose samples a loop of its own takes), the judged calls
    among them and their outputs (and LSEs; values in ``payload``); or ``error``, what a
    timed call raised, or ``refused``, why the worker refused a timed call's output."""

    kind: Literal["timed"] = "timed"
    item: Optional[int] = None
    samples_ms: list[float] = Field(default_factory=list)
    method: str = ""
    probe_ms: list[float] = Field(default_factory=list)
    calls: list[Annotated[int, Field(ge=1)]] = Field(default_factory=list)
    copies: Optional[Annotated[int, Field(ge=1)]] = None
    sm_clock_mhz: Optional[tuple[Optional[float], Optional[float]]] = None
    temperature_c: Optional[tuple[Optional[float], Optional[float]]] = None
    fallback: Optional[Annotated[str, Field(max_length=4000)]] = None
    refreshed_calls: Annotated[int, Field(ge=0)] = 0
    judged_calls: list[Annotated[int, Field(ge=0)]] = Field(default_factory=list)
    outputs: list[Descriptor] = Field(default_factory=list, max_length=64)
    error: Optional[Annotated[str, Field(max_length=4000)]] = None
    refused: Optional[Annotated[str, Field(max_length=4000)]] = None


class Waiting(_Message):
    """The serving loop's worker is ready for its next tick (the judge answers with a
    :class:`LoopTick`)."""

    kind: Literal["waiting"] = "waiting"
    item: Optional[int] = None


class Applied(_Message):
    """The serving loop's worker made a tick's copies and writes; it had no batch, or
    the implementation declined the batch (``unsupported``, with why)."""

    kind: Literal["applied"] = "applied"
    item: Optional[int] = None
    unsupported: str = ""


class StepDone(_Message):
    """The serving loop's worker ran a tick's batch: its output (and LSE) as in
    :class:`Output`, and whether the plan was refreshed rather than prepared (a replay)."""

    kind: Literal["step-done"] = "step-done"
    item: Optional[int] = None
    outputs: list[Descriptor] = Field(min_length=1, max_length=2)
    replayed: bool


class Data(_Message):
    """A job's answer that is data only (``list``: a listing row; ``peaks``: the device's)."""

    kind: Literal["data"] = "data"
    item: Optional[int] = None
    data: dict[str, JsonValue]


class Done(_Message):
    """The job finished."""

    kind: Literal["done"] = "done"


Message = Annotated[Union[Entered, Loaded, Fatal, Concluded, Ready, Output, Timed, Waiting,
                          Applied, StepDone, Data, Done], Field(discriminator="kind")]
_MESSAGE = TypeAdapter(Message)
_OBJECT = TypeAdapter(dict[str, Any])


class Go(BaseModel):
    """The judge's answer to :class:`Ready`: go on with the item or not (its truth failed)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    go: bool


class TimeIt(BaseModel):
    """The judge's answer to :class:`Output`: time the item or not. With a ``seed``, new
    inputs are written into the same buffers before every call of the timing (call ``k``,
    0 the first, warm-up included: :class:`~pagedbench.reference.refresh.TimedInputs` of
    ``seed`` and ``kv_calls``), and the outputs of ``judged`` calls drawn among all it
    makes (:class:`~.judging.Reservoir` of ``seed``) come back in :class:`Timed`.
    Without, the inputs stay as drawn."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    time: bool
    seed: Optional[Annotated[int, Field(ge=0, lt=2**31)]] = None
    judged: Annotated[int, Field(ge=0, le=16)] = 0
    kv_calls: list[Annotated[int, Field(ge=0, lt=2**32)]] = Field(default_factory=list)


class Watched(BaseModel):
    """The judge's answer to :class:`Timed`, sent once it has watched the implementation's
    process for the idle window after the timing and judged it: only then may the worker
    go on to its next item, whose work would otherwise count as the timing's."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class LoopTick(BaseModel):
    """The judge's answer to :class:`Waiting`: the block ``copies`` to make first
    (``[kind, src, dst]``, ``kind`` one of ``copy-on-write``, ``swap-out``, ``swap-in``;
    device ids the pool's), the tokens to write (physical ``slots`` and their ``keys``),
    and the batch to attend over, if any; ``end``: the loop is over."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    end: bool = False
    copies: list[tuple[Literal["copy-on-write", "swap-out", "swap-in"], int, int]] = Field(
        default_factory=list)
    slots: list[Annotated[int, Field(ge=0)]] = Field(default_factory=list)
    keys: list[Annotated[int, Field(ge=0, lt=2**63)]] = Field(default_factory=list)
    index: int = 0
    q_lens: list[Annotated[int, Field(ge=0)]] = Field(default_factory=list)
    kv_lens: list[Annotated[int, Field(ge=0)]] = Field(default_factory=list)
    block_tables: list[list[Annotated[int, Field(ge=0)]]] = Field(default_factory=list)
    q_seed: int = 0


def parse_message(line: bytes) -> tuple[Message, int] | None:
    """``line`` as a message and the bytes of payload it announces (``nbytes``, 0
    without), or None when it is not one (not JSON, an unknown kind, a missing or
    mistyped field, ``nbytes`` not an int >= 0)."""
    try:
        data = _OBJECT.validate_json(line)
    except ValidationError:
        return None
    nbytes = data.pop("nbytes", 0)
    if type(nbytes) is not int or nbytes < 0:
        return None
    try:
        return _MESSAGE.validate_python(data), nbytes
    except ValidationError:
        return None


#: Largest JSON text one adapter may put into a record's ``impl_details`` (bytes).
MAX_DETAILS_BYTES = 64 * 1024
#: Deepest nesting accepted in adapter metadata (a self-referencing dict would recurse).
MAX_DEPTH = 16
_JSON_TYPES = "str, int, float, bool, None, and lists or str-keyed dicts of them"


def to_json_data(value: object, where: str, depth: int = 0) -> JsonValue:
    """``value`` as JSON data, converting what has an obvious JSON form.

    numpy scalars and 0-d tensors become their Python value, sets become sorted lists,
    tuples lists, enums their value, paths, ``torch.dtype`` and ``torch.device`` strings,
    non-finite floats ``None``.

    Raises
    ------
    PagedTypeError
        For anything else (functions, locks, tensors with elements, custom objects),
        naming ``where`` (e.g. ``"impl_details['plan']"``) and the value's type.
    PagedValueError
        For nesting deeper than :data:`MAX_DEPTH`.
    """
    import numpy as np

    torch = sys.modules.get("torch")  # no torch object exists before torch is imported
    if depth > MAX_DEPTH:
        raise PagedValueError(where, type(value).__name__, f"nested at most {MAX_DEPTH} deep")
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value) if math.isfinite(value) else None
    if isinstance(value, np.generic) or (
            torch is not None and isinstance(value, torch.Tensor) and value.dim() == 0):
        return to_json_data(value.item(), where, depth + 1)
    if isinstance(value, enum.Enum):
        return to_json_data(value.value, where, depth + 1)
    if isinstance(value, PurePath) or (
            torch is not None and isinstance(value, (torch.dtype, torch.device))):
        return str(value)
    if isinstance(value, dict):
        bad = [k for k in value if not isinstance(k, str)]
        if bad:
            raise PagedTypeError(f"{where} key", bad[0], "a str (JSON object keys are strings)")
        return {k: to_json_data(v, f"{where}[{k!r}]", depth + 1) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_json_data(v, f"{where}[{i}]", depth + 1) for i, v in enumerate(value)]
    if isinstance(value, (set, frozenset)):
        items = [to_json_data(v, f"{where} element", depth + 1) for v in value]
        return sorted(items, key=lambda v: json.dumps(v, sort_keys=True))
    raise PagedTypeError(where, type(value).__name__, f"JSON data ({_JSON_TYPES})",
                         f"{where} must be JSON data ({_JSON_TYPES}), not a "
                         f"{type(value).__module__}.{type(value).__qualname__}")



def output_shape(case: PagedCase) -> tuple[int, int, int]:
    """The shape of a correct output of ``case``: ``(total_q, num_q_heads, v_head_dim)``."""
    return (case.total_q, case.num_q_heads, case.v_head_dim)


def lse_shape(case: PagedCase) -> tuple[int, int]:
    """The shape of a correct log-sum-exp of ``case``: ``(total_q, num_q_heads)``."""
    return (case.total_q, case.num_q_heads)


def encode(out: object, shape: tuple[int, ...], dtype: str) -> tuple[Descriptor, bytes]:
    """The :class:`Descriptor` of ``out`` and, when it is a dense tensor of ``shape`` and
    ``dtype``, its values as C-order float32 bytes (exact for float32, float16 and
    bfloat16); otherwise no values (the judge refuses it on its shape or dtype).

    Raises
    ------
    Exception
        Whatever reading ``out`` raises (a ``meta`` tensor, a subclass that refuses): the
        implementation's fault, raised in its own process.
    """
    import numpy as np
    import torch

    if not isinstance(out, torch.Tensor):
        return Descriptor(type=type(out).__name__[:TYPE_NAME_CHARS]), b""
    found = [int(n) for n in out.shape]
    found_dtype = str(out.dtype).removeprefix("torch.")
    payload = b""
    if tuple(found) == shape and found_dtype == dtype:
        if out.layout != torch.strided:
            raise TypeError(f"output has layout {out.layout}, not a dense (strided) tensor")
        values = torch.Tensor.float(out.detach().as_subclass(torch.Tensor).cpu())
        payload = np.ascontiguousarray(values.numpy(), dtype=np.float32).tobytes()
    return Descriptor(type="Tensor", shape=found[:MAX_DIMS], dtype=found_dtype,
                      nbytes=len(payload)), payload


def decode(descriptor: Descriptor, payload: bytes, shape: tuple[int, ...],
           dtype: str) -> object:
    """The output ``descriptor`` describes, rebuilt for the comparison: a CPU tensor of
    ``dtype`` with the sent values, an empty ``meta`` tensor of the sent shape and dtype
    when they are not ``shape`` and ``dtype``, or a stand-in of the sent type name.

    Raises
    ------
    ValueError
        If the values are not what :func:`encode` writes for ``shape`` and ``dtype``.
    """
    import numpy as np
    import torch

    if descriptor.type != "Tensor":
        if payload:
            raise ValueError("a non-tensor output came with values")
        return type(descriptor.type, (), {})()
    torch_dtype = getattr(torch, descriptor.dtype or "", None)
    if descriptor.shape is None or not isinstance(torch_dtype, torch.dtype):
        raise ValueError(f"output dtype {descriptor.dtype!r} is not a torch dtype")
    if tuple(descriptor.shape) != shape or descriptor.dtype != dtype:
        if payload:
            raise ValueError("an output of another shape or dtype came with values")
        return torch.empty(descriptor.shape, dtype=torch_dtype, device="meta")
    if len(payload) != math.prod(shape) * 4:
        raise ValueError(f"{len(payload)} bytes of values for an output of "
                         f"{math.prod(shape) * 4}")
    values = np.frombuffer(payload, dtype=np.float32).reshape(shape)
    return torch.from_numpy(values.copy()).to(torch_dtype)


def split_payload(payload: bytes, descriptors: list[Descriptor]) -> list[bytes]:
    """``payload`` cut into each descriptor's ``nbytes`` in turn.

    Raises
    ------
    ValueError
        If the sizes do not add up to the payload.
    """
    chunks = []
    for descriptor in descriptors:
        chunks.append(payload[:descriptor.nbytes])
        payload = payload[descriptor.nbytes:]
    if payload or any(len(c) != d.nbytes for c, d in zip(chunks, descriptors)):
        raise ValueError("the values sent do not match the outputs described")
    return chunks


def as_json(model: BaseModel) -> dict[str, Any]:
    """A reply as the JSON object that travels."""
    return model.model_dump(mode="json")


def validation_problem(exc: ValidationError) -> str:
    """The first few problems of a pydantic ``ValidationError``, one line:
    ``field.path: message; ...``."""
    parts = []
    for error in exc.errors()[:3]:
        loc = ".".join(str(p) for p in error["loc"] if p not in ("result", "run"))
        cause = error.get("ctx", {}).get("error")
        message = str(cause) if isinstance(cause, Exception) else error["msg"]
        parts.append(message if isinstance(cause, PagedInputError) else
                     f"{loc or 'line'}: {message}")
    more = f" (and {exc.error_count() - 3} more)" if exc.error_count() > 3 else ""
    return "; ".join(parts) + more


__all__ = ["HARNESS", "HARNESS_STEPS", "IMPL", "JOB_STEPS", "MAX_DEPTH", "MAX_DETAILS_BYTES",
           "MAX_DIMS", "TYPE_NAME_CHARS", "Applied", "Concluded", "Data", "Descriptor", "Done",
           "Entered", "Fatal", "Go", "Loaded", "LoopTick", "Message", "Output", "Party", "Ready",
           "StepDone", "TimeIt", "Timed", "Waiting", "Watched", "as_json", "decode", "encode",
           "lse_shape", "output_shape", "parse_message", "party_of", "split_payload",
           "to_json_data", "validation_problem"]
