"""The truth cache is plain data, signed: a corrupt, mismatching, planted or forged file is
detected, recomputed and replaced, never fatal and never executed; a folder or FIFO where a
file should be never blocks nor fails the truth and leaves no temporary file."""

from __future__ import annotations

import os
import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from pagedbench.harness.verdict.truth import cache_path, compute_truth, truth_for
from pagedbench.reference import PagedCase

from ..conftest import RunsCode

CASE = PagedCase(kv_lens=(3, 17), num_q_heads=4, num_kv_heads=2, head_dim=16, block_size=8,
                 dtype="bfloat16", name="cache")
OTHER = CASE.with_(seed=1)


def _expected():
    return compute_truth(CASE)


def _assert_is_the_truth(found) -> None:
    expected = _expected()
    assert torch.equal(found.truth, expected.truth)
    assert found.naive.dtype == torch.bfloat16 and torch.equal(found.naive, expected.naive)
    assert torch.equal(found.logit_rounding, expected.logit_rounding)


def test_a_cached_truth_is_read_back_exactly(tmp_path) -> None:
    first = truth_for(CASE, tmp_path)
    path = cache_path(CASE, tmp_path)
    assert path.exists()
    stamp = path.stat().st_mtime_ns
    _assert_is_the_truth(truth_for(CASE, tmp_path))
    _assert_is_the_truth(first)
    assert path.stat().st_mtime_ns == stamp  # read, not rewritten


def test_a_float32_truth_keeps_its_logit_rounding(tmp_path) -> None:
    case = CASE.with_(dtype="float32", logit_offset=100.0)
    computed = compute_truth(case)
    truth_for(case, tmp_path)
    read = truth_for(case, tmp_path)  # from the file
    assert computed.logit_rounding is not None and float(computed.logit_rounding.max()) > 0
    assert read.logit_rounding.dtype == torch.float64
    assert torch.equal(read.logit_rounding, computed.logit_rounding)


def _plant_torch_save(path: Path, marker: Path) -> None:
    torch.save({"truth": RunsCode(marker)}, path)


def _plant_npz_of_other_case(path: Path, tmp_path: Path) -> None:
    truth_for(OTHER, tmp_path)
    shutil.copy(cache_path(OTHER, tmp_path), path)


def _forge_values(path: Path, tmp_path: Path) -> None:
    """The valid file with its truth zeroed, its key and HMAC field kept."""
    truth_for(CASE, tmp_path)
    with np.load(path) as saved:
        data = dict(saved)
    data["truth"] = np.zeros_like(data["truth"])
    np.savez(path, **data)


@pytest.mark.parametrize("plant", ["random bytes", "truncated", "pickle", "torch.save",
                                   "other case", "object array", "forged values", "fifo"])
def test_a_bad_cache_file_is_recomputed_and_replaced(plant, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    marker = tmp_path / "pwned"
    path = cache_path(CASE, tmp_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if plant == "random bytes":
        path.write_bytes(np.random.default_rng(0).bytes(1000))
    elif plant == "truncated":
        truth_for(CASE, tmp_path)
        path.write_bytes(path.read_bytes()[:200])
    elif plant == "pickle":
        path.write_bytes(pickle.dumps({"truth": RunsCode(marker)}))
    elif plant == "torch.save":
        _plant_torch_save(path, marker)
    elif plant == "other case":
        _plant_npz_of_other_case(path, tmp_path)
    elif plant == "forged values":
        _forge_values(path, tmp_path)
    elif plant == "fifo":
        os.mkfifo(path)  # opened blocking, it would wait for a writer forever
    else:
        np.savez(path, key=np.array([RunsCode(marker)], dtype=object),
                 truth=np.zeros(1), naive=np.zeros(1))
    with pytest.warns(UserWarning, match=f"truth cache {path} is unusable"):
        found = truth_for(CASE, tmp_path)
    _assert_is_the_truth(found)
    assert not marker.exists()
    assert path.is_file()
    _assert_is_the_truth(truth_for(CASE, tmp_path))  # the replacement is valid
    assert not list(path.parent.glob("*.tmp*"))


def test_a_folder_at_the_cache_path_costs_only_the_caching(tmp_path) -> None:
    path = cache_path(CASE, tmp_path)
    (path / "inside").mkdir(parents=True)
    with pytest.warns(UserWarning, match=f"truth cache {path} cannot be written"):
        _assert_is_the_truth(truth_for(CASE, tmp_path))
    assert (path / "inside").is_dir() and not list(path.parent.glob("*.tmp*"))


def test_entries_signed_under_another_secret_are_recomputed(tmp_path) -> None:
    """A file copied from another cache folder (another secret) is refused here."""
    truth_for(CASE, tmp_path / "a")
    path = cache_path(CASE, tmp_path / "b")
    path.parent.mkdir(parents=True)
    shutil.copy(cache_path(CASE, tmp_path / "a"), path)
    with pytest.warns(UserWarning, match="HMAC does not match"):
        _assert_is_the_truth(truth_for(CASE, tmp_path / "b"))
    assert oct((path.parent / ".key").stat().st_mode & 0o777) == "0o600"


def test_the_plants_would_run_code_if_unpickled(tmp_path) -> None:
    """The planted files of the test above are real exploits for ``pickle`` and
    ``torch.load(weights_only=False)``, which the old cache reader was one variable away
    from."""
    pickle.loads(pickle.dumps(RunsCode(tmp_path / "a")))
    _plant_torch_save(tmp_path / "t.pt", tmp_path / "b")
    torch.load(tmp_path / "t.pt", weights_only=False)
    assert (tmp_path / "a").is_dir() and (tmp_path / "b").is_dir()
