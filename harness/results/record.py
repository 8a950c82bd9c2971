"""The typed, versioned result record: one pydantic model per kind of line in a results file.

A results file (JSON lines, :mod:`.store`) holds :class:`ResultRecord` lines (one per
implementation x case) and :class:`RunRecord` lines (a run's start with its plan, its
resumptions, interruptions and its end), told apart by ``kind``. The runner writes them,
report and the tests read them, and ``pagedbench schema`` prints the JSON Schema generated
from them (committed as ``docs/result.schema.json``). :data:`SCHEMA_VERSION` changes
whenever a field is added, removed or changes meaning.

Everything an adapter hands over for a record (``Availability.version`` and ``details``,
``describe()``) passes :func:`to_json_data` here: numpy and 0-d torch scalars, sets,
tuples, paths, enums and dtypes become JSON values; anything else is refused with a
:class:`~pagedbench.reference.PagedTypeError` naming where it was found, so that a bad
value costs that implementation one ``error``, never the run. Non-finite figures are
``null``. The figures of a comparison are every field of
:class:`~pagedbench.harness.verdict.comparison.Comparison` but ``passed`` and ``reason`` (which
become ``status`` and ``reason``), so the record follows the tolerance policy's fields.
"""

from __future__ import annotations

import dataclasses
import json
import math
import typing
from collections.abc import Callable, Hashable, Iterable
from datetime import datetime, timezone
from typing import Annotated, Any, Literal, Optional, Union

import numpy as np
from pydantic import (AwareDatetime, BaseModel, BeforeValidator, ConfigDict, Field, JsonValue,
                      PrivateAttr, TypeAdapter, ValidationInfo,
                      create_model, field_validator, model_validator)

from pagedbench.reference import PagedCase, PagedInputError, PagedTypeError, PagedValueError

from pagedbench.harness.measure.samples import METHODS
from pagedbench.harness.verdict.messages import MAX_DETAILS_BYTES, to_json_data
from pagedbench.harness.verdict.comparison import Comparison
from pagedbench.harness.verdict.status import Status

SCHEMA_VERSION = 8


def _finite_or_none(value: object) -> object:
    if isinstance(value, (float, np.floating)) and not math.isfinite(value):
        return None
    return value


#: A measured figure: a float, ``None`` when absent or not finite.
Figure = Annotated[Optional[float], BeforeValidator(_finite_or_none)]


class _Strict(BaseModel):
    """Every field required and strictly typed (no "3" for 3, no "true" for True);
    unknown fields refused. Read JSON with ``model_validate_json``."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, ser_json_inf_nan="null")


class TimingStats(_Strict):
    """Latency of one implementation on one case, ms per call (``harness.measure.timing.Timing``):
    the raw ``samples`` in order and their statistics; ``noisy`` when IQR / median exceeds
    ``harness.measure.timing.NOISE_THRESHOLD``; ``probe``: ms per call of the fixed work timed
    after each sample (``harness.measure.timing.DriftProbe``, CPU only, else ``[]``). Lines written
    before schema 3 have no samples (``[]``), and ``iqr`` and ``noisy`` are null; before
    schema 4 no drift probe (``[]``). On CUDA (schema 8 on): ``copies``, the input copies
    the samples rotated over (1 with ``cuda_events``); ``sm_clock_mhz`` and
    ``temperature_c``, read after the point's pre-roll and after its samples (an entry null
    where not read); ``fallback``, why the point's planned ``cuda_graph`` gave way to the
    cold timing. All null elsewhere and in older lines."""

    median: float
    p10: float
    p90: float
    iqr: Optional[float]
    n: int
    method: Literal[METHODS]
    samples: list[float]
    noisy: Optional[bool]
    probe: list[float]
    copies: Optional[Annotated[int, Field(ge=1)]] = None
    sm_clock_mhz: Optional[Annotated[list[Figure], Field(min_length=2, max_length=2)]] = None
    temperature_c: Optional[Annotated[list[Figure], Field(min_length=2, max_length=2)]] = None
    fallback: Optional[str] = None

    @field_validator("probe", mode="after")
    @classmethod
    def _one_probe_per_sample(cls, value: list[float], info: ValidationInfo) -> list[float]:
        samples = info.data.get("samples", [])
        if value and len(value) != len(samples):
            raise PagedValueError("time_ms.probe", f"{len(value)} blocks",
                                  f"none or one per sample ({len(samples)})")
        return value


class DevicePeaks(_Strict):
    """What the device sustained when the run measured it (``harness.measure.timing.measure_peaks``):
    copy bandwidth (GB/s), bf16 matmul throughput (TFLOP/s), fastest copy in cache (GB/s)."""

    copy_gbps: float
    bf16_tflops: float
    method: Literal[METHODS]
    cache_copy_gbps: Optional[float] = Field(default=None, description="the fastest copy "
        "staying in a cache (GB/s; harness/results/floor.py); null when not measured")


#: The libraries whose versions every result records (``env.<name>``, by top-level import
#: name; None when absent, torch always there) and is keyed by (:func:`versions_key`), in
#: this order: the one table of them. A peer's library added here is found by
#: :func:`~pagedbench.harness.results.store.environment`, recorded, keyed and in the
#: schema (regenerate ``docs/result.schema.json``).
VERSION_FIELDS = ("torch", "triton", "vllm", "flashinfer", "flash_attn", "xformers")


class _EnvironmentFields(_Strict):
    device: str
    device_type: str
    cc: Optional[str]
    driver: Optional[str]
    threads: int
    python: str
    git_sha: Optional[str]
    dirty: bool
    host: str
    # Where a run spread over devices (--devices) measured it: the GPU's
    # CUDA_VISIBLE_DEVICES entry or the CPU worker's number, and the GPU's UUID.
    device_index: Optional[str] = None
    device_uuid: Optional[str] = None


Environment = create_model(  # noqa: N816 (a class)
    "Environment",
    __base__=_EnvironmentFields,
    __doc__="Where a result was measured (``harness.results.store.environment``).",
    **{name: (str if name == "torch" else Optional[str], ...) for name in VERSION_FIELDS},
)


def _version_text(value: object) -> object:
    """A version as text: numbers (``3``, ``0.32``; numpy scalars and 0-d tensors first
    become their Python value, as in :func:`to_json_data`) are converted; anything else but
    a str (a bool, a non-finite float) is refused by the field's type."""
    if not isinstance(value, str):
        try:
            value = to_json_data(value, "version")
        except PagedInputError:
            return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    return value


Version = Annotated[str, BeforeValidator(_version_text)]


class _ResultFields(_Strict):
    """The fields of a result line other than the comparison's figures."""

    kind: Literal["result"]
    schema_version: Literal[SCHEMA_VERSION]
    run_id: str
    suite: str
    impl: str
    impl_target: str
    impl_version: Version
    impl_details: dict[str, JsonValue]
    case_id: str
    case: dict[str, JsonValue]
    workload: Optional[str] = Field(description="the benchmark workload (pagedbench bench; "
                                    "its name leads case_id); null for pagedbench run")
    bench_mode: Optional[Literal["decode", "prefill", "chunked", "mixed"]]
    batch_spec: Optional[str]
    device: str
    status: Status
    reason: str
    step: Optional[str] = Field(description="where a non-pass outcome arose (import, "
                                "available, prepare, run, truth, timing, ...); floor: a "
                                "time no device could take (harness/results/floor.py)")
    time_ms: Optional[TimingStats]
    time_ms_median: Figure
    timing_method: Optional[str]
    interpreted: Optional[bool]
    tail_poison: Optional[Literal["nan", "stale"]]
    logits_precision: Optional[Literal["float32", "case"]] = Field(
        default=None, description="the yardstick's logits precision: float32, or the case "
        "dtype for an implementation that declares it computes its logits there")
    truth: Optional[Literal["host", "device"]] = Field(
        default=None, description="where the float64 truth was computed: host (inputs "
        "drawn there, cached) or device (inputs drawn on the run's device, for a case the "
        "host cannot hold); null when no truth was needed")
    nan_tail_output_finite: Optional[bool]
    bytes_moved: int
    flops: int
    bandwidth_gbps: Figure
    tflops: Figure
    arithmetic_intensity: Figure
    peaks: Optional[DevicePeaks]
    frac_of_peak_bandwidth: Figure
    frac_of_peak_tflops: Figure
    roofline_floor_ms: Figure
    frac_of_roofline: Figure
    env: Environment
    timestamp: AwareDatetime

    @field_validator("impl_details", mode="before")
    @classmethod
    def _details_as_json(cls, value: object) -> object:
        data = to_json_data(value, "impl_details")
        if not isinstance(data, dict):
            raise PagedTypeError("impl_details", value, "a dict")
        size = len(json.dumps(data))
        if size > MAX_DETAILS_BYTES:
            raise PagedValueError("impl_details", f"{size} bytes of JSON",
                                  f"at most {MAX_DETAILS_BYTES} bytes")
        return data

    _paged: Optional[PagedCase] = PrivateAttr(default=None)

    @model_validator(mode="after")
    def _case_is_a_case(self, info: ValidationInfo) -> _ResultFields:
        """Parse ``case`` once (raises PagedInputError, a ValueError), unless the caller
        passes the :class:`PagedCase` it came from as ``context={"case": ...}``
        (:func:`~pagedbench.harness.results.outcome.result_record`: the case is not parsed
        again in the process that wrote it). A record validated again (as a field of
        another model) keeps the case it has."""
        if self._paged is None:
            given = (info.context or {}).get("case")
            self._paged = (given if isinstance(given, PagedCase)
                           else PagedCase.from_dict(self.case))
        return self

    def paged_case(self) -> PagedCase:
        """The case this result is about (parsed once, when the record was validated)."""
        return self._paged


_NOT_FIGURES = {"passed", "reason"}


def _comparison_fields() -> dict[str, Any]:
    """One optional record field per field of ``Comparison`` (floats as
    :data:`Figure`), so the record follows the tolerance policy's figures."""
    hints = typing.get_type_hints(Comparison)
    out: dict[str, Any] = {}
    # the figures over all rows first, then the binding element's (its allowance, its
    # error over it, where it is)
    binding = ("allowed_abs_err", "err_over_allowance", "worst_index")
    for f in sorted(dataclasses.fields(Comparison), key=lambda f: f.name in binding):
        if f.name in _NOT_FIGURES:
            continue
        if f.name in _ResultFields.model_fields:
            raise TypeError(f"Comparison.{f.name} collides with a result-record field")
        hint = hints[f.name]
        out[f.name] = (Figure if hint is float else Optional[hint], ...)
    return out


ResultRecord = create_model(  # noqa: N816 (a class)
    "ResultRecord",
    __base__=_ResultFields,
    __doc__="One implementation on one case: verdict, figures, timing, environment.",
    **_comparison_fields(),
)
COMPARISON_FIELDS = tuple(name for name in ResultRecord.model_fields
                          if name not in _ResultFields.model_fields)


def comparison_figures(comparison: Comparison | None) -> dict[str, Any]:
    """The record fields of ``comparison`` (all ``None`` when there is none)."""
    if comparison is None:
        return dict.fromkeys(COMPARISON_FIELDS)
    data = dataclasses.asdict(comparison)
    return {name: data[name] for name in COMPARISON_FIELDS}


class PlannedImpl(_Strict):
    """An implementation of a plan: its name and ``"module:Class"`` target."""

    name: str
    target: str


class Plan(_Strict):
    """What a run checks: implementations (in order) times cases; recorded when the run
    starts so that ``--resume`` can finish exactly this run."""

    impls: list[PlannedImpl]
    cases: list[dict[str, JsonValue]]

    _paged: Optional[list[PagedCase]] = PrivateAttr(default=None)

    @model_validator(mode="after")
    def _cases_are_cases(self, info: ValidationInfo) -> Plan:
        """Parse each case once (or take the :class:`PagedCase` list the caller passes as
        ``context={"cases": ...}``, :func:`~pagedbench.harness.run.runner.make_plan`), and
        refuse two with one case id (results are keyed by it). A plan validated again (as
        the field of a run record) keeps the cases it has."""
        if self._paged is not None:
            return self
        given = (info.context or {}).get("cases")
        self._paged = (list(given) if given is not None
                       else [PagedCase.from_dict(c) for c in self.cases])
        ids = [c.case_id for c in self._paged]
        twice = sorted({i for i in ids if ids.count(i) > 1})
        if twice:
            raise PagedValueError("cases", twice, "distinct case ids")
        return self

    def paged_cases(self) -> list[PagedCase]:
        """The cases (parsed once, when the plan was validated)."""
        return list(self._paged)

    @property
    def size(self) -> int:
        """How many (implementation, case) results the finished run holds."""
        return len(self.impls) * len(self.cases)


class Shard(_Strict):
    """The part of its plan a sharded run measured (``--shard K/N``, :mod:`.shard`)."""

    index: int = Field(ge=1, description="K of --shard K/N, from 1")
    count: int = Field(ge=1, description="N of --shard K/N")
    plan_sha256: str = Field(description="SHA-256 of the whole plan's JSON (harness/results/shard.py)")
    pairs: int = Field(ge=0, description="(implementation, case) pairs of this shard")
    balance: Optional[str] = Field(default=None, description="null: balanced by bytes; "
        "'seconds:<sha256 of the costs>': by --balance-from's seconds")


class RunRecord(_Strict):
    """One event of a run: ``started`` (with the plan and configuration), ``resumed``,
    ``interrupted`` (by a signal; resumable) or ``finished`` (with its exit code)."""

    kind: Literal["run"]
    schema_version: Literal[SCHEMA_VERSION]
    run_id: str
    event: Literal["started", "resumed", "interrupted", "finished"]
    timestamp: AwareDatetime
    plan: Optional[Plan]
    config: Optional[dict[str, JsonValue]]
    device_peaks: Optional[DevicePeaks] = Field(
        default=None, description="measured when the run started or resumed (pagedbench "
        "bench, and run with timing), or read from --peaks; null otherwise")
    left_out: Optional[list[str]] = Field(
        default=None, description="started: the sweep's points left out, each with why "
        "(pagedbench bench: a truth that fits neither the host budget nor the device, a "
        "mode a grid point cannot take); null otherwise")
    exit_code: Optional[int]
    counts: Optional[dict[Status, int]]
    shard: Optional[Shard] = Field(
        default=None, description="started, of a run with --shard K/N: which part of the "
        "plan (the whole plan is in plan) it runs; null otherwise")


#: A line of a results file: a result or a run event.
Line = Annotated[Union[ResultRecord, RunRecord], Field(discriminator="kind")]
LINE = TypeAdapter(Line)


class ListingRow(_Strict):
    """One implementation as ``pagedbench list --json`` shows it."""

    name: str
    target: str
    status: Literal["available", "unavailable", "error", "crash", "timeout"]
    description: str
    available: bool
    reason: str
    version: Version
    details: dict[str, JsonValue]
    interpreted: Optional[bool]
    capabilities: Optional[dict[str, JsonValue]]

    @field_validator("details", "capabilities", mode="before")
    @classmethod
    def _as_json(cls, value: object, info: Any) -> object:
        return None if value is None else to_json_data(value, info.field_name)

    @classmethod
    def error(cls, name: str, target: str, status: str, reason: str) -> ListingRow:
        """The row of an implementation that could not answer: ``status`` (``error``,
        ``crash``, ``timeout``) and why."""
        return cls(name=name, target=target, status=status, description="", available=False,
                   reason=reason, version="", details={}, interpreted=None, capabilities=None)


def timing_environment(env: Environment) -> str:
    """What in an environment changes timings, beside the device, as one string: the
    library versions, the driver and the thread count, ``torch <v>; triton <v>; ...;
    driver <v>; threads <n>`` (``-`` when absent)."""
    versions = (f"{name} {getattr(env, name) or '-'}" for name in VERSION_FIELDS)
    return "; ".join([*versions, f"driver {env.driver or '-'}", f"threads {env.threads}"])


def versions_key(record: ResultRecord) -> str:
    """The versions a result was measured with: ``impl <impl_version>; torch <v>; ...``."""
    return f"impl {record.impl_version or '-'}; {timing_environment(record.env)}"


def environment_key(record: ResultRecord) -> tuple[str, str]:
    """``(device name, library versions, driver and threads)``: results with the same key
    share a table in reports (the implementations' own versions may differ)."""
    return record.env.device, timing_environment(record.env)


def result_key(record: ResultRecord) -> tuple[str, str, str, str]:
    """What results are matched by, in reports and in the gate: ``(impl, device name,
    versions, case id)`` with the versions of :func:`versions_key`. The device name is
    the CPU model or GPU name of the environment (never the device type), so two CPUs, or
    an H100 and an H200, never merge; the case id identifies the point (a bench
    workload's name leads it)."""
    return record.impl, record.env.device, versions_key(record), record.case_id


def latest(records: Iterable[ResultRecord],
           key: Callable[[ResultRecord], Hashable] = result_key) -> dict[Hashable, ResultRecord]:
    """The results of ``records`` by ``key`` (:func:`result_key` unless given), each key's
    the one measured last (its ``timestamp``; of two as late, the one read last), so that
    the order files are named in never decides which of two runs of a point is shown or
    gated; keys in the order they first appear."""
    out: dict[Hashable, ResultRecord] = {}
    for record in records:
        found = key(record)
        if found not in out or record.timestamp >= out[found].timestamp:
            out[found] = record
    return out


def now() -> datetime:
    """The timestamp records carry: now, UTC, to the millisecond (``--balance-from``)."""
    moment = datetime.now(timezone.utc)
    return moment.replace(microsecond=moment.microsecond // 1000 * 1000)


def json_schema() -> dict[str, Any]:
    """The JSON Schema of a results-file line (``pagedbench schema``)."""
    schema = LINE.json_schema()
    schema["title"] = f"pagedbench results line, schema_version {SCHEMA_VERSION}"
    return schema


__all__ = [
    "COMPARISON_FIELDS",
    "LINE",
    "SCHEMA_VERSION",
    "VERSION_FIELDS",
    "DevicePeaks",
    "Environment",
    "ListingRow",
    "Plan",
    "PlannedImpl",
    "ResultRecord",
    "RunRecord",
    "Shard",
    "TimingStats",
    "comparison_figures",
    "environment_key",
    "json_schema",
    "latest",
    "now",
    "result_key",
    "timing_environment",
    "to_json_data",
    "versions_key",
]
