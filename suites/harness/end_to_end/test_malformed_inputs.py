"""Malformed input of every kind gets pagedbench's own error (a ``PagedInputError``, naming
the parameter), never a crash, a hang, a NaN result or a bare traceback. Hypothesis draws
the inputs: case fields, case dicts, devices, tensors, result lines, adapter metadata,
command lines and report files."""

from __future__ import annotations

import contextlib
import io
import json
from dataclasses import replace

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from pagedbench.harness import cli
from pagedbench.harness.results.record import to_json_data
from pagedbench.harness.results.store import ResultsFileError, parse_line
from pagedbench.harness.run import jobs, runner
from pagedbench.harness.verdict.status import ExitCode
from pagedbench.harness.verdict.truth import compute_truth
from pagedbench.reference import (PagedCase, PagedInputError, PagedTypeError, PagedValueError,
                                  materialize, reference_attention)
from pagedbench.reference.inputs import footprint_bytes

from ..conftest import result

#: Each example must finish well within this (ms): a hang fails the test.
DEADLINE_MS = 5000
SETTINGS = settings(max_examples=60, deadline=DEADLINE_MS,
                    suppress_health_check=[HealthCheck.too_slow,
                                           HealthCheck.function_scoped_fixture])
BASE = dict(kv_lens=(3, 9), num_q_heads=4, num_kv_heads=2, head_dim=8, block_size=4,
            dtype="float32")
JUNK = st.one_of(
    st.none(), st.booleans(), st.integers(-2**70, 2**70), st.integers(0, 20),
    st.floats(allow_nan=True, allow_infinity=True), st.floats(1e-3, 1e3),
    st.sampled_from([1e300, -0.0, 1e-320, float("nan"), 2**63, "float32", "bfloat16",
                     "fp8_e4m3", "auto", "", "cuda", "nan", (), [], (1, 2), [3, 0], {}]),
    st.text(max_size=8), st.lists(st.integers(-3, 40), max_size=4),
    st.tuples(st.integers(1, 20)), st.just(np.int64(4)), st.just(np.float32(0.5)),
    st.just(torch.tensor(3)), st.just(object()),
)
FIELDS = ["kv_lens", "q_lens", "num_q_heads", "num_kv_heads", "head_dim", "block_size",
          "dtype", "sm_scale", "sliding_window", "logits_soft_cap", "num_blocks", "seed",
          "name", "tag", "alibi", "sinks", "kv_cache_dtype", "k_scale", "v_scale"]


def _case_or_error(changes: dict) -> PagedCase | None:
    try:
        return PagedCase(**(BASE | changes))
    except PagedInputError as exc:
        assert exc.parameter and str(exc)
        return None


def _assert_finite_truth(case: PagedCase) -> None:
    """A case that was accepted has a finite truth (small cases only: the test is about
    validation, not speed)."""
    if footprint_bytes(case) > 2**20 or sum(case.kv_lens) > 400:
        return
    found = compute_truth(case)
    assert bool(torch.isfinite(found.truth).all()), case


@SETTINGS
@given(st.dictionaries(st.sampled_from(FIELDS), JUNK, min_size=1, max_size=3))
def test_a_case_with_junk_fields_is_refused_or_has_a_finite_truth(changes) -> None:
    case = _case_or_error(changes)
    if case is not None:
        _assert_finite_truth(case)
        assert PagedCase.from_dict(case.to_dict()) == case


@SETTINGS
@given(st.one_of(JUNK, st.dictionaries(st.one_of(st.sampled_from(FIELDS), st.text(max_size=5)),
                                       JUNK, max_size=6)))
def test_a_junk_case_dict_is_refused(data) -> None:
    try:
        case = PagedCase.from_dict(data)
    except PagedInputError:
        return
    _assert_finite_truth(case)


@SETTINGS
@given(device=JUNK, tail_poison=JUNK)
def test_materialize_refuses_junk_devices_and_poisons_before_building(device, tail_poison) -> None:
    case = PagedCase(**BASE)
    try:
        inputs = materialize(case, device, tail_poison=tail_poison)
    except PagedInputError as exc:
        assert exc.parameter in ("device", "tail_poison")
        return
    assert inputs.device.type == "cpu" and tail_poison in ("nan", "stale")


def test_materialize_refuses_a_case_that_cannot_fit_before_allocating() -> None:
    huge = PagedCase(**BASE | {"block_size": 10**9})
    with pytest.raises(PagedValueError, match=r"block_size=1000000000: case .* needs"):
        materialize(huge)
    with pytest.raises(PagedTypeError, match="case must be a PagedCase"):
        materialize(BASE)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_materialize_on_cuda_without_cuda_is_refused_before_building() -> None:
    with pytest.raises(PagedValueError, match="no CUDA device is visible to torch"):
        materialize(PagedCase(**BASE | {"block_size": 10**9}), "cuda")


TENSORS = ["q", "kv_cache", "block_tables", "kv_lens", "cu_seqlens_q", "slot_mapping"]
#: Dimensions a tensor's case fixes (kv_cache's dim 0 is the pool, block_tables' dim 1 may
#: be wider than needed).
FIXED_DIMS = {"q": (0, 1, 2), "kv_cache": (1, 2, 3, 4), "block_tables": (0,), "kv_lens": (0,),
              "cu_seqlens_q": (0,), "slot_mapping": (0,)}
INDEX_TENSORS = ["block_tables", "kv_lens", "cu_seqlens_q", "slot_mapping"]


@SETTINGS
@given(name=st.sampled_from(TENSORS), kind=st.sampled_from(["type", "dtype", "shape", "values"]),
       data=st.data())
def test_inputs_with_a_malformed_tensor_are_refused(name, kind, data) -> None:
    inputs = materialize(PagedCase(**BASE))
    tensor = getattr(inputs, name)
    if kind == "values" and name not in INDEX_TENSORS:
        kind = "dtype"
    if kind == "type":
        bad = tensor.tolist()
    elif kind == "dtype":
        dtype = data.draw(st.sampled_from([d for d in (torch.float32, torch.float64, torch.int32,
                                                       torch.int64, torch.bfloat16)
                                           if d != tensor.dtype]))
        bad = tensor.to(dtype)
    elif kind == "shape":
        dim = data.draw(st.sampled_from(FIXED_DIMS[name]))
        shape = list(tensor.shape)
        shape[dim] += 1 if shape[dim] == 1 else data.draw(st.sampled_from([-1, 1]))
        bad = torch.zeros(shape, dtype=tensor.dtype)
    else:
        bad = tensor.clone()
        flat = bad.view(-1)
        index = data.draw(st.integers(0, (inputs.case.batch_size if name == "block_tables"
                                          else flat.numel()) - 1))
        if name == "block_tables":  # a used entry, past either end of the pool
            index = index * bad.shape[1]
            offset = data.draw(st.one_of(st.integers(inputs.kv_cache.shape[0], 2**30),
                                         st.integers(-2**30, -1)))
            flat[index] = offset
        else:
            flat[index] += data.draw(st.one_of(st.integers(1, 2**20), st.integers(-2**20, -1)))
    with pytest.raises(PagedInputError) as refused:
        reference_attention(replace(inputs, **{name: bad}))
    assert refused.value.parameter.split("[")[0] == name


VALUES = st.recursive(
    JUNK | st.just({1, 2}) | st.just(frozenset({"a"})) | st.just(lambda: 0)
    | st.just(torch.zeros(2)) | st.just(np.zeros(2)),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
        st.one_of(st.text(max_size=3), st.integers()), inner, max_size=3),
    max_leaves=8)


@SETTINGS
@given(VALUES)
def test_adapter_metadata_becomes_json_or_is_refused(value) -> None:
    try:
        data = to_json_data(value, "impl_details")
    except PagedInputError as exc:
        assert exc.parameter.startswith("impl_details")
        return
    assert json.loads(json.dumps(data, allow_nan=False)) == data


def _with_version(version):
    from pagedbench.harness.results.record import ResultRecord

    return ResultRecord.model_validate(result("x").model_dump() | {"impl_version": version})


@pytest.mark.parametrize("version, text", [
    (np.int64(7), "7"), (np.float32(0.5), "0.5"), (np.str_("1.2.3"), "1.2.3"),
    (torch.tensor(3), "3"), (3, "3"), ("0.32", "0.32")])
def test_a_numeric_version_is_recorded_as_text(version, text) -> None:
    """Numpy scalars (and 0-d tensors) are converted as ``to_json_data`` converts them, then
    recorded as text."""
    from pagedbench.adapters.base import Availability
    from pagedbench.adapters.torch_sdpa import TorchGather

    class NumpyVersion(TorchGather):
        def available(self, device: str = "cpu") -> Availability:
            return Availability(True, version=version)

    row = jobs._listing("numpy-version", "t:T", NumpyVersion(), "cpu")
    assert row.version == text and type(row.version) is str
    assert _with_version(version).impl_version == text


@pytest.mark.parametrize("version", [np.bool_(True), True, np.float64("nan"), object(),
                                     torch.zeros(2)])
def test_a_version_that_is_no_number_or_text_is_refused(version) -> None:
    with pytest.raises(ValidationError, match="impl_version"):
        _with_version(version)


FIELD_NAMES = list(json.loads(result("x").model_dump_json()))


@SETTINGS
@given(st.dictionaries(st.sampled_from(FIELD_NAMES), JUNK, max_size=3),
       st.sets(st.sampled_from(FIELD_NAMES), max_size=2))
def test_a_mutated_result_line_is_refused_or_read(changes, dropped) -> None:
    data = json.loads(result("x").model_dump_json()) | changes
    for name in dropped:
        data.pop(name, None)
    try:
        line = json.loads(json.dumps(data))
    except (TypeError, ValueError):
        return  # not JSON at all: never reaches a reader
    try:
        record = parse_line(line, "f.jsonl", 7)
    except ResultsFileError as exc:
        assert str(exc).startswith("f.jsonl:7: ")
        return
    assert record.impl == "x" or "impl" in changes


OPTIONS = ["--device", "--block-size", "--dtype", "--threads", "--repetitions",
           "--case-timeout", "--harness-timeout", "--impl", "--preset"]


class _Reached(BaseException):
    """The command line was accepted: the run would start."""


@SETTINGS
@given(st.lists(st.tuples(st.sampled_from(OPTIONS), st.one_of(
    st.text(max_size=12), st.sampled_from(["1", "0", "-1", "nan", "inf", "1e9", "cuda", "cpu",
                                           "cuda:7", "torch-gather", "float32", "16"]))),
    max_size=3))
def test_run_command_lines_are_refused_with_exit_2_or_accepted(tmp_path, monkeypatch,
                                                                argv) -> None:
    def reached(*args, **kwargs):
        raise _Reached

    monkeypatch.setattr(runner, "run", reached)
    flat = ["run", "--results-dir", str(tmp_path / "r"), "--cache-dir", str(tmp_path / "b"),
            *[part for pair in argv for part in pair]]
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = cli.main(flat)
        except SystemExit as exc:  # argparse's own refusal
            code = exc.code
        except _Reached:
            return
    assert code == ExitCode.USAGE_ERROR, err.getvalue()
    assert "Traceback" not in err.getvalue() and "error" in err.getvalue()


@pytest.mark.filterwarnings("ignore:.*skipping a torn")
@SETTINGS
@given(st.lists(st.one_of(st.binary(max_size=60), st.sampled_from(
    [b"{}", b"[]", b'{"schema_version": 2}', b'{"kind": "run"}', b"null", b"\xff\xfe"])),
    max_size=4))
def test_report_of_a_junk_file_is_a_usage_error_not_a_traceback(tmp_path, lines) -> None:
    path = tmp_path / "junk.jsonl"
    path.write_bytes(b"\n".join(lines))
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = cli.main(["report", str(path)])
    assert code in (ExitCode.CLEAN, ExitCode.USAGE_ERROR), err.getvalue()
    assert "Traceback" not in err.getvalue()
    if code == ExitCode.USAGE_ERROR:
        assert f"{path}:" in err.getvalue()


def test_scales_that_would_overflow_the_truth_are_refused() -> None:
    for name in ("sm_scale", "logits_soft_cap", "k_scale", "v_scale"):
        with pytest.raises(PagedValueError, match=f"{name} must be .* at most 1e\\+06"):
            PagedCase(**BASE | {name: 1e300, "kv_cache_dtype": "fp8_e4m3"})


@pytest.mark.parametrize("argv, message", [
    (["loop", "--impl", "torch-gather", "--trace", "{missing}"],
     "{missing}: cannot read it (No such file or directory)"),
    (["simulate", "--trace", "{missing}"], "--trace {missing}: no such file"),
    (["tune", "--trace", "{missing}"], "--trace {missing}: no such file"),
    (["run", "--peaks", "{missing}"], "--peaks {missing}: no such file"),
], ids=["loop", "simulate", "tune", "run-peaks"])
def test_a_missing_input_file_is_named_with_its_option(tmp_path, capsys, argv,
                                                        message) -> None:
    """Exit 2 naming the option (or the path and why), before anything runs."""
    missing = str(tmp_path / "nowhere.jsonl")
    try:
        code = cli.main([a.format(missing=missing) for a in argv])
    except SystemExit as refused:  # argparse's own refusal
        code = refused.code
    assert code == 2
    err = capsys.readouterr().err
    assert message.format(missing=missing) in err and "Errno" not in err


@pytest.mark.parametrize("text, message", [
    ("junk\n", ":1: not a loop spec: line: Invalid JSON: expected value at line 1 column 1"),
    ('{"steps": 3}\n', ":1: not a loop spec: case: Field required; num_blocks: Field required"),
], ids=["not-json", "missing-fields"])
def test_a_bad_loop_trace_names_its_line_and_the_problems(tmp_path, capsys, text,
                                                          message) -> None:
    """A loop trace that is not one: exit 2, the file's line and pydantic's first problems,
    without its links."""
    trace = tmp_path / "trace.jsonl"
    trace.write_text(text)
    assert cli.main(["loop", "--impl", "torch-gather", "--trace", str(trace)]) == 2
    err = capsys.readouterr().err
    assert f"{trace}{message}" in err and "http" not in err
