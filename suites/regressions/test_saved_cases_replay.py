"""Every failing case found once (``cases/*.json``, written by ``pagedbench selftest
--save-regressions`` and ``pagedbench replay --save``) is replayed: the implementation
that got it wrong still gets the status recorded with it, and every built-in
implementation that supports the case passes it (one that compiles per shape in the
nightly profile). Interpreted kernels skip cases with
more than 300 keys in a sequence (minutes each under the Triton interpreter)."""

from __future__ import annotations

import json
from importlib.metadata import distributions
from pathlib import Path

import pytest

from pagedbench.adapters import BUILTIN, ENTRY_POINT_GROUP, entries, load
from pagedbench.harness.run import replay
from pagedbench.harness.run.config import DEFAULT_CATALOGUE
from pagedbench.harness.verdict import conformance
from pagedbench.reference import PagedCase

SAVED = sorted((Path(__file__).parent / "cases").glob("*.json"))
#: Distinct cases among the saved ones (several faults can fail the same case).
CASES = sorted({json.dumps(json.loads(p.read_text())["case"], sort_keys=True) for p in SAVED})
#: Where a saved case's implementation is found: installed entry points, then the fault
#: catalogue (read, not registered, so the session's other tests never see it).
TARGETS = {e.name: e.target for e in entries()} | {
    ep.name: ep.value for dist in distributions(path=[str(DEFAULT_CATALOGUE)])
    for ep in dist.entry_points if ep.group == ENTRY_POINT_GROUP}
INTERPRETED_MAX_KV_LEN = 300


def test_cases_are_saved() -> None:
    assert SAVED, "no regression cases: run pagedbench selftest --save-regressions"


@pytest.mark.parametrize("path", SAVED, ids=lambda p: p.stem)
def test_finder_still_gets_its_status(path: Path) -> None:
    saved = json.loads(path.read_text())
    if saved["impl"] not in TARGETS:
        pytest.skip(f"{saved['impl']} is not installed here")
    adapter = load(TARGETS[saved["impl"]])
    if not adapter.available("cpu").ok:
        pytest.skip(f"{saved['impl']} unavailable here")
    verdict = conformance.check(adapter, PagedCase.from_dict(saved["case"]), "cpu")
    assert str(verdict.status) == saved["status"], (saved, verdict.reason)


def _builtin(impl: str):
    """A built-in that compiles each new shape (FlexAttention, seconds a case) replays the
    saved cases in ``make nightly`` only; the case it found itself replays above."""
    slow = load(BUILTIN[impl]).compiles_per_shape
    return pytest.param(impl, marks=[pytest.mark.nightly] if slow else [])


@pytest.mark.parametrize("impl", [_builtin(impl) for impl in BUILTIN])
def test_builtin_passes_saved_cases(impl: str) -> None:
    adapter = load(BUILTIN[impl])
    availability = adapter.available("cpu")
    if not availability.ok:
        pytest.skip(f"{impl} unavailable: {availability.reason}")
    checked = 0
    for text in CASES:
        case = PagedCase.from_dict(json.loads(text))
        if adapter.why_unsupported(case, "cpu") or (
                adapter.is_interpreted("cpu") and max(case.kv_lens) > INTERPRETED_MAX_KV_LEN):
            continue
        replay.check(adapter, case, "cpu", impl)
        checked += 1
    if not checked:
        pytest.skip(f"{impl} supports none of the {len(CASES)} saved cases")
