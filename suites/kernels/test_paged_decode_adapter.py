"""The ``pagedbench-triton`` adapter: registration, availability, declared limits and
the interpreter budget, and one prepare/run round trip against the truth."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch

from pagedbench.adapters import BUILTIN, load
from pagedbench.harness.cases.presets import default_cases
from pagedbench.harness.verdict.tolerance import assert_matches_truth
from pagedbench.reference import PagedCase, materialize

triton = pytest.importorskip("triton")
from pagedbench.adapters.triton_decode import (  # noqa: E402
    INTERPRETER_STEP_BUDGET,
    TritonPagedDecode,
)
from pagedbench.kernels.paged_decode import KV_TILE, program_steps  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
#: Interpreted on the CPU, and on CUDA only when Triton's interpreter was switched on.
INTERPRETED = DEVICE == "cpu" or triton.knobs.runtime.interpret


def test_registered_name_loads_this_adapter():
    assert isinstance(load(BUILTIN["pagedbench-triton"]), TritonPagedDecode)


def test_available_here_records_interpretation_and_the_tile_it_steps_by():
    """``interpreted`` is a JSON boolean that follows the device; ``kv_tile`` is the step
    of the key loop: one more key than a tile takes a second step."""
    availability = TritonPagedDecode().available(DEVICE)
    assert availability.ok, availability.reason
    assert availability.version == triton.__version__
    details = availability.details
    assert set(details) == {"interpreted", "kv_tile"}
    assert details["interpreted"] is INTERPRETED
    tile = details["kv_tile"]
    assert (program_steps([tile], 1), program_steps([tile + 1], 1)) == (1, 2)
    assert TritonPagedDecode().is_interpreted("cpu")


def test_cpu_needs_the_interpreter_set_before_import():
    """In a fresh process without TRITON_INTERPRET the CPU is refused with the remedy,
    and setting the variable after the kernel module was imported is too late."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = (
        "import os\n"
        "from pagedbench.adapters.triton_decode import TritonPagedDecode\n"
        "a = TritonPagedDecode().available('cpu'); print(a.ok, a.reason, sep='|')\n"
        "os.environ['TRITON_INTERPRET'] = '1'\n"
        "a = TritonPagedDecode().available('cpu'); print(a.ok, a.reason, sep='|')\n"
    )
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=300, check=True)
    before, after = done.stdout.splitlines()
    assert before.startswith("False|") and "set TRITON_INTERPRET=1" in before
    assert after.startswith("False|") and "imported before TRITON_INTERPRET=1" in after


def test_every_reduced_preset_fits_the_interpreter_budget():
    # The MLA preset's head_dim 576 is outside the kernel's head dims (unsupported there).
    reduced = [c for c in default_cases() if c.tag == "reduced" and c.head_dim_v is None]
    assert reduced, "the default cases have no reduced presets to check"
    for case in reduced:
        assert TritonPagedDecode().why_unsupported(case, "cpu") == [], case.case_id


def test_interpreter_budget_rejects_by_step_count():
    """A full preset is refused on the CPU exactly when its steps, counted here from the
    lengths, exceed the budget; of the full presets only llama3.1-70b-tp8 (one KV head)
    fits, the purpose the budget's comment states."""
    adapter = TritonPagedDecode()
    full = [c for c in default_cases() if c.tag != "reduced" and c.head_dim_v is None]
    for case in full:
        steps = sum(math.ceil(n / KV_TILE) for n in case.kv_lens) * case.num_kv_heads
        reasons = adapter.why_unsupported(case, "cpu")
        if steps > INTERPRETER_STEP_BUDGET:
            assert len(reasons) == 1, case.case_id
            assert reasons[0].startswith("too large for Triton's interpreter"), reasons
            assert f"{case.batch_size * case.num_kv_heads} programs, {steps} key-loop " \
                   "steps" in reasons[0], reasons
        else:
            assert reasons == [], case.case_id
    admitted = {c.name for c in full if not adapter.why_unsupported(c, "cpu")}
    assert admitted == {"llama3.1-70b-tp8"}


@pytest.mark.parametrize(("change", "reason"), [
    ({"q_lens": (1, 2)}, "mode 'prefill' not in ['decode']"),
    ({"alibi": True}, "feature 'alibi' not supported"),
    ({"sinks": True}, "feature 'sinks' not supported"),
    ({"kv_cache_dtype": "fp8_e4m3"}, "kv_cache_dtype 'fp8_e4m3' not in ['auto']"),
    ({"head_dim": 72}, "head_dim 72 not supported (supported: 64, 80, 96, 128, 256)"),
])
def test_declared_limits_give_reasons(change, reason):
    case = PagedCase(kv_lens=(3, 9), num_q_heads=4, num_kv_heads=2, head_dim=64,
                     block_size=16).with_(**change)
    assert reason in TritonPagedDecode().why_unsupported(case, DEVICE)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_prepare_then_run_matches_dense(dtype):
    case = PagedCase(kv_lens=(1, 30, 49), num_q_heads=10, num_kv_heads=2, head_dim=80,
                     block_size=48, dtype=dtype, sliding_window=20, logits_soft_cap=8.0,
                     name="adapter")
    adapter = TritonPagedDecode()
    assert adapter.why_unsupported(case, DEVICE) == []
    inputs = materialize(case, DEVICE)
    prepared = adapter.prepare(inputs)
    assert bool(prepared.out.isnan().all()), "prepare must leave the NaN buffer unwritten"
    first = adapter.run(prepared).clone()
    assert_matches_truth(first, inputs, case.case_id)
    assert torch.equal(adapter.run(prepared), first)
