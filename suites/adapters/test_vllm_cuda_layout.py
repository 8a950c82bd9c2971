"""vLLM CUDA adapter (``vllm.vllm_flash_attn``): its declared limits, the FlashAttention
generation it picks, and why it is unavailable here; on a GPU, it matches the truth.

Its paged arguments are FlashAttention's (``flash_attn_paged``), whose conversion is
checked gather by gather in ``test_flash_attn_layout.py``; vLLM's fork passes
``seqused_k`` = ``cache_seqlens``, the canonical ``kv_lens``.
"""

from __future__ import annotations

import pytest
import torch

from pagedbench.adapters.cuda_probe import installed_distribution
from pagedbench.adapters.vllm_cuda import CAPABILITIES, VllmCudaFlashAttn, default_fa_version
from pagedbench.harness.verdict.tolerance import assert_matches_truth
from pagedbench.reference import PagedCase, materialize


@pytest.mark.parametrize("capability, fa3_built, expected", [
    ((9, 0), True, 3),   # Hopper with FA3 kernels: vLLM's default
    ((9, 0), False, 2),  # Hopper, FA3 not built
    ((8, 0), True, 2),   # Ampere: FA2
    ((8, 9), True, 2),   # Ada: FA2
    ((10, 0), True, 2),  # Blackwell: vLLM would take FA4, which the varlen wrapper lacks
])
def test_default_fa_version(capability, fa3_built, expected) -> None:
    assert default_fa_version(capability, fa3_built) == expected


@pytest.mark.parametrize("block_size, head_dim, refused", [
    (16, 128, []), (32, 72, []), (48, 256, []),  # MultipleOf(16); head_dim % 8, <= 256
    (8, 128, ["block_size 8"]), (16, 264, ["head_dim 264"]),
    (24, 60, ["block_size 24", "head_dim 60"]),
])
def test_declared_limits(block_size, head_dim, refused) -> None:
    """vLLM's FlashAttention backend: block_size a multiple of 16; head_dim a multiple of
    8 up to 256. Each reason names the axis and value it refuses."""
    case = PagedCase(kv_lens=(20,), num_q_heads=4, num_kv_heads=1, head_dim=head_dim,
                     block_size=block_size, dtype="float16")
    reasons = CAPABILITIES.why_unsupported(case, "cuda")
    assert [" ".join(r.split()[:2]) for r in sorted(reasons)] == refused, reasons


def test_float32_and_cpu_unsupported() -> None:
    case = PagedCase(kv_lens=(20,), num_q_heads=4, num_kv_heads=1, head_dim=64,
                     block_size=16, dtype="float32")
    reasons = VllmCudaFlashAttn().why_unsupported(case, "cpu")
    assert any("device 'cpu'" in r for r in reasons)
    assert any("dtype float32" in r for r in reasons)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the reason given without CUDA")
def test_unavailable_without_cuda_says_why() -> None:
    reason = VllmCudaFlashAttn().available("cuda").reason
    found = installed_distribution("vllm")
    if found is None:
        assert reason.startswith("vllm not installed")
    else:
        distribution, version = found
        assert reason.startswith(f"{distribution} {version} installed")
        assert "sees no CUDA device" in reason


@pytest.mark.gpu
@pytest.mark.parametrize("q_lens", [None, (1, 9, 4)], ids=["decode", "mixed-prefill"])
def test_vllm_cuda_matches_truth(q_lens) -> None:
    """Block size 16 with lengths 1, 16 and 17, GQA 4, a window and a soft cap."""
    adapter = VllmCudaFlashAttn()
    availability = adapter.available("cuda")
    if not availability.ok:
        pytest.skip(availability.reason)
    case = PagedCase(kv_lens=(1, 16, 17), q_lens=q_lens, num_q_heads=8, num_kv_heads=2,
                     head_dim=128, block_size=16, dtype="bfloat16", sliding_window=10,
                     logits_soft_cap=50.0, name="vllm-fa-pinned")
    assert adapter.why_unsupported(case, "cuda") == []
    out = adapter.run(adapter.prepare(materialize(case, "cuda")))
    cpu = materialize(case)
    assert_matches_truth(out, cpu, case.case_id)
