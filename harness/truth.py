"""The truth of a case (float64 dense attention) and its naive yardstick
(:class:`~pagedbench.harness.tolerance.Expected`), cached.

Computing the truth is the harness's work, done once per case and kept between workers and
runs in ``<cache_dir>/truth/<key>.npz``: plain numpy arrays, read with
``allow_pickle=False``, so a planted file can never execute code (``torch.load`` is not
used, whatever ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD`` says). The key is a SHA-256 over the
case, the source of ``reference/`` and the torch version; the file stores the key and the
shapes, so a file that is corrupt, truncated, of another case or of another reference is
detected, recomputed and replaced (atomically), never fatal.
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from pathlib import Path

import numpy as np
import torch

from pagedbench.reference import PagedCase, materialize

from .tolerance import Expected

_REFERENCE_DIR = Path(__file__).resolve().parent.parent / "reference"


def compute_truth(case: PagedCase, logits_precision: str = "float32") -> Expected:
    """The truth and yardstick of ``case`` (logits of the yardstick in
    ``logits_precision``), computed on the CPU (no cache)."""
    return Expected.of(materialize(case, "cpu"), logits_precision)


def cache_key(case: PagedCase, logits_precision: str = "float32") -> str:
    """SHA-256 (hex) of the case, the yardstick's logits precision, the reference's source
    and the torch version."""
    digest = hashlib.sha256(json.dumps(case.to_dict(), sort_keys=True).encode())
    digest.update(logits_precision.encode())
    for source in sorted(_REFERENCE_DIR.glob("*.py")):
        digest.update(source.read_bytes())
    digest.update(torch.__version__.encode())
    return digest.hexdigest()


def cache_path(case: PagedCase, cache_dir: Path, logits_precision: str = "float32") -> Path:
    """Where the truth of ``case`` is cached under ``cache_dir``."""
    return Path(cache_dir) / "truth" / f"{cache_key(case, logits_precision)[:32]}.npz"


def _load(path: Path, case: PagedCase, key: str) -> Expected:
    """The cached truth at ``path``; raises (ValueError, OSError, KeyError, ...) when the
    file is not exactly what :func:`_save` writes for ``case`` (a pickle is refused by
    ``allow_pickle=False`` before anything of it runs)."""
    shape = (case.total_q, case.num_q_heads, case.head_dim)
    with np.load(path, allow_pickle=False) as saved:
        stored_key = str(saved["key"])
        truth, naive = saved["truth"], saved["naive"]
    if stored_key != key:
        raise ValueError(f"stored key {stored_key[:12]}... is not this case's {key[:12]}...")
    if truth.dtype != np.float64 or naive.dtype != np.float32:
        raise ValueError(f"dtypes {truth.dtype}, {naive.dtype} are not float64, float32")
    if truth.shape != shape or naive.shape != shape:
        raise ValueError(f"shapes {truth.shape}, {naive.shape} are not {shape}")
    return Expected(torch.from_numpy(truth), torch.from_numpy(naive).to(case.torch_dtype))


def _save(path: Path, key: str, found: Expected) -> None:
    """Write ``found`` atomically (temporary file, then rename). The yardstick is stored
    as float32, which holds fp16 and bf16 values exactly."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.tmp.npz")
    np.savez(tmp, key=np.array(key), truth=found.truth.numpy(),
             naive=found.naive.float().numpy())
    os.replace(tmp, path)


def truth_for(case: PagedCase, cache_dir: Path, logits_precision: str = "float32") -> Expected:
    """The truth and yardstick of ``case``, from the cache when a valid file is there;
    otherwise computed and cached. A file that cannot be read as this case's truth is
    replaced, with a warning naming it."""
    key = cache_key(case, logits_precision)
    path = cache_path(case, cache_dir, logits_precision)
    if path.exists():
        try:
            return _load(path, case, key)
        except Exception as exc:  # any unreadable file is recomputed, never fatal
            warnings.warn(f"truth cache {path} is unusable ({type(exc).__name__}: {exc}); "
                          "recomputing it", stacklevel=2)
    found = compute_truth(case, logits_precision)
    _save(path, key, found)
    return found


__all__ = ["cache_key", "cache_path", "compute_truth", "truth_for"]
