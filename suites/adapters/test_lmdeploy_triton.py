"""LMDeploy's Triton kernels (``lmdeploy-decode``, ``lmdeploy-prefill``): its wheel's files
loaded without LMDeploy (sha256 checked, stand-ins complete, ``sys.modules`` untouched),
what the host answers for them, the window's convention, and the declared deviations
held to ``suites/peer_findings.py`` by running them anyway.

On the CPU the decode kernel runs under Triton's interpreter (suites/conftest.py sets
``TRITON_INTERPRET=1``); skipped when ``make`` has not extracted the files.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

from pagedbench.adapters import lmdeploy_triton_load as load
from pagedbench.adapters.base import Adapter
from pagedbench.adapters.pinned_files import PinnedFiles, PinnedFilesInvalid, module_path
from pagedbench.harness.run import replay
from pagedbench.reference import PagedCase
from pagedbench.suites import peer_findings

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FIRST = next(iter(load.LMDEPLOY.files))
pytestmark = pytest.mark.skipif(
    not (load.LMDEPLOY.files_dir() / module_path(FIRST)).exists(),
    reason=f"LMDeploy's kernel files are not in {load.LMDEPLOY.files_dir()} (`make` extracts them)")


def _decode():
    from pagedbench.adapters.lmdeploy_triton import LmdeployDecode

    if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton interpreter is off (TRITON_INTERPRET != 1) on this CPU run")
    adapter = LmdeployDecode()
    availability = adapter.available(DEVICE)
    assert availability.ok, availability.reason
    return adapter


def test_files_load_without_importing_lmdeploy() -> None:
    kernels = load.load_kernels()
    assert kernels.version == load.LMDEPLOY_VERSION
    assert callable(kernels.decode.flash_attn_with_kvcache)
    assert not any(name == "lmdeploy" or name.startswith("lmdeploy.") for name in sys.modules)
    with pytest.raises(ImportError):
        import lmdeploy  # noqa: F401


def test_stand_ins_cover_every_import_of_the_files() -> None:
    sources = load.LMDEPLOY.read()
    assert load.LMDEPLOY.unmet_imports(sources, load.stand_ins(), "lmdeploy") == []


def test_unmet_imports_sees_an_uncovered_name() -> None:
    sources = {FIRST: b"from lmdeploy.messages import QuantPolicy, KVTransferConfig\n"
                      b"from .nowhere import x\n"}
    unmet = load.LMDEPLOY.unmet_imports(sources, load.stand_ins(), "lmdeploy")
    assert [line.split(": ", 1)[1] for line in unmet] == [
        "lmdeploy.messages.KVTransferConfig", "module lmdeploy.pytorch.kernels.cuda.nowhere"]


def test_a_changed_byte_is_refused_naming_the_file(tmp_path: Path) -> None:
    load.LMDEPLOY.copy(tmp_path)
    changed = tmp_path / module_path(load.KERNELS + "pagedattention")
    changed.write_bytes(changed.read_bytes().replace(b"BLOCK >= 16", b"BLOCK >= 8 "))
    with pytest.raises(PinnedFilesInvalid, match=f"{changed}: sha256 .* differs"):
        load.LMDEPLOY.read(tmp_path)
    changed.unlink()
    with pytest.raises(PinnedFilesInvalid, match="`make` .* extracts lmdeploy 0.18.0's"):
        load.LMDEPLOY.read(tmp_path)


def test_a_file_missing_from_the_wheel_is_refused(tmp_path: Path) -> None:
    import zipfile

    wheel = tmp_path / "lmdeploy-0.18.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("lmdeploy/version.py", "__version__ = '0.18.0'\n")
    pinned = PinnedFiles("lmdeploy", "0.18.0", (), {FIRST: "0" * 64}, "UNSET", tmp_path)
    with pytest.raises(PinnedFilesInvalid, match=f"has no {module_path(FIRST)}"):
        pinned.extract(wheel, tmp_path / "out")


def test_host_answers_for_a_cpu_tensor() -> None:
    kernels = load.load_kernels()
    assert kernels.decode.get_device_props(None) == load.CPU_DEVICE_PROPS
    assert kernels.decode._get_split_k(None, 8, 3, 4) == load.CPU_SPLIT_K
    if kernels.interpreted:
        assert kernels.decode.is_cuda() is False
        assert {"pagedattention.tl_exp2", "pagedattention.tl_log2"} <= set(kernels.rebound)


def test_window_is_passed_as_flash_attn_left_window() -> None:
    from pagedbench.adapters.lmdeploy_triton import window_size

    case = PagedCase(kv_lens=(9,), num_q_heads=2, num_kv_heads=1, head_dim=16, block_size=16)
    assert window_size(case) == -1
    assert window_size(case.with_(sliding_window=5)) == 4  # keys >= position - 4: five


def test_declared_limits_are_unsupported_with_the_reason() -> None:
    adapter = _decode()
    base = PagedCase(kv_lens=(3,), num_q_heads=2, num_kv_heads=1, head_dim=64, block_size=16)
    reasons = {
        "sliding_window 1": base.with_(sliding_window=1),
        "alibi with sinks": base.with_(alibi=True, sinks=True),
        "block_size 8 not supported": base.with_(block_size=8),
        "head_dim 8 not supported": base.with_(head_dim=8),
    }
    for expected, case in reasons.items():
        assert any(expected in r for r in adapter.why_unsupported(case, DEVICE)), expected
    assert adapter.why_unsupported(base.with_(dtype="float16", logit_offset=1e4), DEVICE) == []
    if adapter.is_interpreted(DEVICE):
        assert any("libdevice" in r for r in
                   adapter.why_unsupported(base.with_(logits_soft_cap=30.0), DEVICE))


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_alibi_with_sinks_really_deviates(pytestconfig, monkeypatch) -> None:
    """The smallest case of the finding, run past the declaration: held to the table."""
    adapter = _decode()
    monkeypatch.setattr(type(adapter), "why_unsupported", Adapter.why_unsupported)
    case = PagedCase(kv_lens=(1,), num_q_heads=2, num_kv_heads=1, head_dim=64, block_size=16,
                     dtype="float32", alibi=True, sinks=True, name="alibi-sinks")
    outcome, error = peer_findings.observe(
        lambda: replay.check(adapter, case, DEVICE, adapter.name))
    key = peer_findings.combination(adapter, DEVICE) + ("alibi-with-sinks",)
    peer_findings.expect(key, outcome, error, case.case_id, pytestconfig.rootpath)


def test_fp16_logits_near_1e4_pass() -> None:
    """Float16 logits near 1e4, a case of the search (1.08x the allowance without the
    logits' float32 rounding term): taken, and passed."""
    adapter = _decode()
    case = PagedCase(kv_lens=(38, 38, 38), num_q_heads=1, num_kv_heads=1, head_dim=192,
                     block_size=64, dtype="float16", logit_offset=1e4, seed=186, name="hyp")
    assert adapter.why_unsupported(case, DEVICE) == []
    assert replay.check(adapter, case, DEVICE, adapter.name).comparison.err_over_allowance < 0.5


def test_prefill_says_why_it_cannot_run_here() -> None:
    """Triton 3.9 removed block pointers, which LMDeploy's varlen kernel builds: the
    prefill adapter is unavailable and says so; with an older Triton it runs."""
    import triton

    from pagedbench.adapters.lmdeploy_triton import LmdeployPrefill

    if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton interpreter is off (TRITON_INTERPRET != 1) on this CPU run")
    availability = LmdeployPrefill().available(DEVICE)
    major, minor = (int(part) for part in triton.__version__.split(".")[:2])
    if (major, minor) >= (3, 9):
        assert not availability.ok
        assert "tl.make_block_ptr" in availability.reason and "triton<=3.7.1" in availability.reason
    else:
        assert availability.ok, availability.reason
