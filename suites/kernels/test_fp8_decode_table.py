"""Triton's fp8 decode against torch's, code by code: every finite code agrees; under the
interpreter every NaN and Inf code reads as a finite number (the fact the verdicts' mark
rests on: ``harness/verdict/fp8_interpreter.py``, tested in
``suites/harness/verdict/test_fp8_interpreter.py``); the committed table
(``results/fp8-interpreter/``) is what this Triton gives."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from pagedbench.harness.verdict import fp8_interpreter

triton = pytest.importorskip("triton")
from pagedbench.kernels import fp8_decode  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ROOT = Path(__file__).resolve().parents[2]
COMMITTED = ROOT / fp8_interpreter.DEFAULT_OUTPUT / fp8_interpreter.TABLE_JSON
PAIRS = [(f, t) for f in fp8_decode.FP8_TYPES for t in fp8_decode.TARGETS]
interpreted_only = pytest.mark.skipif(not fp8_decode.is_interpreted(),
                                      reason="Triton's interpreter is off (a GPU's decode)")


@pytest.fixture(scope="module")
def tables():
    return fp8_interpreter.tables(DEVICE)


#: Finite codes the interpreter decodes wrong: E5M2's subnormals to float16 (both have 5
#: exponent bits; the interpreter's underflow path drops or halves them).
INTERPRETER_WRONG_FINITE = {("fp8_e5m2", "float16"): [0x01, 0x02, 0x03, 0x81, 0x82, 0x83]}


@pytest.mark.parametrize("fp8, target", PAIRS)
def test_finite_codes_decode_as_torch_does(tables, fp8, target) -> None:
    """Zeros of both signs, subnormals and normals: the same value and sign, but for the
    interpreter's E5M2 subnormals to float16, each off by at most 2**-15 (one or two of
    their steps of 2**-16)."""
    codes = tables[fp8][target]
    assert len(codes) == 256
    wrong = [c for c in codes if math.isfinite(c.torch_value) and not c.agrees]
    expected = (INTERPRETER_WRONG_FINITE.get((fp8, target), [])
                if fp8_decode.is_interpreted() else [])
    assert [c.code for c in wrong] == expected, wrong
    assert all(abs(c.torch_value - c.triton_value) <= 2**-15 for c in wrong), wrong


@interpreted_only
@pytest.mark.parametrize("fp8, target", PAIRS)
def test_nan_and_inf_codes_read_finite_under_the_interpreter(tables, fp8, target) -> None:
    """Every code torch decodes as NaN or Inf comes out finite, except E5M2 to float16,
    whose exponents are as wide, so the bits carry over. When a Triton release decodes
    them as the hardware does, this fails: the mark (``FP8_POISON_MARK``) can go."""
    special = [c for c in tables[fp8][target] if not math.isfinite(c.torch_value)]
    assert special  # E4M3 "fn": 0x7F, 0xFF; E5M2: 0x7C-0x7F, 0xFC-0xFF
    keeps = fp8 == "fp8_e5m2" and target == "float16"
    assert all(c.agrees is keeps for c in special), special
    assert all(math.isfinite(c.triton_value) is not keeps for c in special), special


@interpreted_only
def test_the_poison_code_is_0x7f_and_reads_as_the_committed_figures(tables) -> None:
    """pagedbench's fp8 NaN is byte 0x7F (reference/inputs.py): 480 in E4M3 and 114688 in
    E5M2 to float32 under the interpreter, as the module docstring says."""
    for fp8, dtype in fp8_decode.FP8_TYPES.items():
        assert torch.tensor([math.nan]).to(dtype).view(torch.uint8).item() == 0x7F
    assert tables["fp8_e4m3"]["float32"][0x7F].triton_value == 480.0
    assert tables["fp8_e5m2"]["float32"][0x7F].triton_value == 114688.0


@interpreted_only
def test_the_committed_table_is_what_this_triton_gives(tables) -> None:
    committed = json.loads(COMMITTED.read_text())
    assert committed["decoded_by"] == "Triton's interpreter"
    for fp8, by_target in tables.items():
        for target, codes in by_target.items():
            now = [[c.code, repr(c.torch_value), repr(c.triton_value)] for c in codes]
            assert committed["codes"][fp8][target] == now, (
                f"{fp8} -> {target} differs from {COMMITTED} (written with "
                f"{committed['versions']}); rerun: python -m pagedbench.harness.verdict.fp8_interpreter")
