"""The shared parts of the adapter contract (``adapters/base.py``, ``adapters/cuda_probe.py``):
capabilities that depend on the device, the compute-capability check, axis notes, the
``AtLeast`` rule, ``Prepared``'s two output conventions and the interpreter budget."""

from __future__ import annotations

import functools
import json

import pytest
import torch

from pagedbench.adapters.base import AtLeast, Capabilities, MultipleOf, Prepared, allows
from pagedbench.adapters.interpreted import InterpretedWork, InterpreterBudget
from pagedbench.adapters.cuda_probe import cuda_peer_available
from pagedbench.harness.cli import main
from pagedbench.reference import PagedCase

CASE = PagedCase(kv_lens=(5, 17), num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16,
                 dtype="bfloat16")
CUDA_ONLY = Capabilities(devices=frozenset({"cuda"}), dtypes=frozenset({"bfloat16"}),
                         min_compute_capability=(8, 0))


def _fake_gpu(monkeypatch: pytest.MonkeyPatch, capability: tuple[int, int]) -> None:
    """torch reports one CUDA device of ``capability`` (the check reads nothing else)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: "Fake T4")


def test_compute_capability_below_the_minimum_is_unsupported(monkeypatch) -> None:
    _fake_gpu(monkeypatch, (7, 5))
    assert CUDA_ONLY.why_unsupported(CASE, "cuda") == [
        "compute capability 7.5 of Fake T4 not supported (supported: >= 8.0)"]
    _fake_gpu(monkeypatch, (8, 0))
    assert CUDA_ONLY.why_unsupported(CASE, "cuda:0") == []


def test_compute_capability_above_the_maximum_is_unsupported(monkeypatch) -> None:
    """A kernel built for one architecture (FlashMLA: SM90a only) names its range."""
    one_arch = Capabilities(devices=frozenset({"cuda"}), dtypes=frozenset({"bfloat16"}),
                            min_compute_capability=(9, 0), max_compute_capability=(9, 0),
                            notes={"max_compute_capability": "built for SM90a"})
    _fake_gpu(monkeypatch, (10, 0))
    assert one_arch.why_unsupported(CASE, "cuda") == [
        "compute capability 10.0 of Fake T4 not supported (supported: 9.0) (built for SM90a)"]
    _fake_gpu(monkeypatch, (8, 9))
    assert one_arch.why_unsupported(CASE, "cuda") == [
        "compute capability 8.9 of Fake T4 not supported (supported: 9.0)"]
    _fake_gpu(monkeypatch, (9, 0))
    assert one_arch.why_unsupported(CASE, "cuda") == []
    ranged = Capabilities(devices=frozenset({"cuda"}), dtypes=frozenset({"bfloat16"}),
                          min_compute_capability=(8, 0), max_compute_capability=(9, 0))
    _fake_gpu(monkeypatch, (12, 0))
    assert ranged.why_unsupported(CASE, "cuda") == [
        "compute capability 12.0 of Fake T4 not supported (supported: 8.0 to 9.0)"]


def test_compute_capability_is_not_read_without_a_visible_device(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert CUDA_ONLY.why_unsupported(CASE, "cuda") == []  # available() says why not


def test_a_note_explains_its_axis_in_the_reason() -> None:
    caps = Capabilities(devices=frozenset({"cpu"}), dtypes=frozenset({"float32"}),
                        notes={"dtypes": "the interpreter is wrong in bf16"})
    assert caps.why_unsupported(CASE, "cpu") == [
        "dtype bfloat16 not in ['float32'] (the interpreter is wrong in bf16)"]
    assert caps.to_dict()["notes"] == {"dtypes": "the interpreter is wrong in bf16"}
    with pytest.raises(ValueError, match=r"notes name unknown attributes \['dtype'\]"):
        Capabilities(devices=frozenset(), dtypes=frozenset(), notes={"dtype": "typo"})


def test_at_least_and_multiple_of_rules() -> None:
    allowed = frozenset({8, AtLeast(32), MultipleOf(5)})
    assert [v for v in range(1, 40) if allows(allowed, v)] == [5, 8, 10, 15, 20, 25, 30,
                                                                 *range(32, 40)]
    caps = Capabilities(devices=frozenset({"cpu"}), dtypes=frozenset({"bfloat16"}),
                        head_dims=allowed)
    assert caps.to_dict()["head_dims"] == [8, ">= 32", "multiples of 5"]
    assert caps.why_unsupported(CASE.with_(head_dim=16), "cpu") == [
        "head_dim 16 not supported (supported: 8, >= 32, multiples of 5)"]


def test_prepared_returns_the_written_buffer_or_the_returned_tensor_viewed() -> None:
    out = torch.full((2, 3), float("nan"))
    writes = Prepared(functools.partial(out.fill_, 1.0), out)
    assert writes.launch() is out and bool((out == 1).all())
    returns = Prepared(lambda: torch.arange(6.0).view(1, 2, 1, 3), out_shape=(2, 1, 3))
    assert returns.launch().shape == (2, 1, 3)
    assert returns.launch()[1, 0].tolist() == [3.0, 4.0, 5.0]


def test_interpreter_budget_states_the_estimate() -> None:
    budget = InterpreterBudget(s_per_program=0.5, s_per_step=0.25, max_s=10.0)
    small, large = InterpretedWork(4, 20, step_weight=1.0), InterpretedWork(4, 20, 2.0)
    assert budget.seconds(small) == 4 * 0.5 + 20 * 0.25
    assert budget.why_over(small) == []
    assert budget.why_over(large) == [
        "too large for Triton's interpreter: about 12.0 s per call (4 programs, 20 key-loop "
        "steps) against a budget of 10 s"]


def test_cuda_peer_is_not_imported_where_it_cannot_run() -> None:
    """The probe answers first: on a CPU device, ``load`` (the peer's import) never runs."""
    def load():
        raise AssertionError("load ran although the device is not CUDA")

    availability = cuda_peer_available("torch", "cpu", "pip install torch", load)
    assert not availability.ok
    assert availability.reason.startswith("torch ") and "runs only on CUDA devices" in \
        availability.reason


def test_list_shows_what_runs_on_the_chosen_device(capsys) -> None:
    """``pagedbench list --device cuda`` shows the compiled kernels' bfloat16, which
    ``capabilities("cpu")`` leaves out where they would run interpreted."""
    from pagedbench.adapters.vllm_triton import VllmUnified

    if torch.cuda.is_available():
        pytest.skip("checks the listing of a machine whose CUDA device is absent")
    assert main(["list", "--json", "--device", "cuda"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert "bfloat16" in rows["vllm-unified"]["capabilities"]["dtypes"]
    assert "bfloat16" not in VllmUnified().capabilities("cpu").dtypes


def test_edge_capabilities_make_a_case_unsupported_with_the_reason() -> None:
    """Degenerate rows, a V head dim of its own, a layout and a pool past
    ``max_num_blocks`` are each unsupported, naming the axis, unless declared."""
    plain = Capabilities(devices=frozenset({"cpu"}), dtypes=frozenset({"bfloat16"}),
                         head_dims=frozenset({64, 128}), modes=frozenset({"prefill"}),
                         max_num_blocks=40000)
    edges = CASE.with_(kv_lens=(0, 5, 3), q_lens=(1, 0, 6), head_dim_v=128,
                       layout="fused_qkv", min_block_id=65534)
    assert edges.features == {"empty_kv", "empty_q", "unseen_rows", "head_dim_v"}
    assert plain.why_unsupported(edges, "cpu") == [
        "feature 'empty_kv' not supported", "feature 'empty_q' not supported",
        "feature 'head_dim_v' not supported", "feature 'unseen_rows' not supported",
        "layout 'fused_qkv' not in ['contiguous']",
        f"num_blocks {edges.pool_blocks} not supported (supported: <= 40000)"]
    declared = Capabilities(devices=frozenset({"cpu"}), dtypes=frozenset({"bfloat16"}),
                            head_dims=frozenset({64, 128}), modes=frozenset({"prefill"}),
                            features=edges.features,
                            layouts=frozenset({"contiguous", "fused_qkv"}))
    assert declared.why_unsupported(edges, "cpu") == []
    assert declared.why_unsupported(edges.with_(head_dim_v=96), "cpu") == [
        "head_dim_v 96 not supported (supported: 64, 128)"]
    with pytest.raises(ValueError, match="layouts \\['hnd'\\] unknown"):
        Capabilities(devices=frozenset(), dtypes=frozenset(), layouts=frozenset({"hnd"}))
