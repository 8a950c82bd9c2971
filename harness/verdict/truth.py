"""The truth of a case (float64 dense attention) and its naive yardstick
(:class:`~pagedbench.harness.verdict.tolerance.Expected`), cached; computed on the host or, for a
case the host cannot hold, on the run's device.

Computing the truth is the harness's work, done once per case and kept between workers and
runs in ``<cache_dir>/truth/<key>.npz``: plain numpy arrays, read with
``allow_pickle=False`` from a regular file only (a folder, FIFO or symlink there is
unusable, never waited on), so a planted file can never execute code (``torch.load`` is
not used, whatever ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD`` says). The key is a SHA-256 over
the case, the source of ``reference/`` and of the tolerance policy, and the torch
version; the file stores the key, the shapes and an HMAC-SHA256 of its arrays under a
secret of the cache folder (``<cache_dir>/truth/.key``, mode 0600, made by the judging
process, never named to a worker), so a file that is corrupt, truncated, of another case, of another reference or
written by anyone without the secret is detected, recomputed and replaced (atomically),
with a warning, never fatal; a file that cannot be replaced is left and the truth used
uncached.

Where (:func:`truth_site`): on the host (``"host"``, the inputs drawn there, the default)
when :func:`truth_bytes` fits :func:`host_budget_bytes`; otherwise on the run's device
(``"device"``): the inputs drawn there (``materialize(on_device=True)``), the reference
and the yardstick computed there sequence by sequence (``reference/dense.py`` works on any
device; memory: the pool plus one sequence's float64 K/V), only the per-row results
brought back (:func:`device_truth_for`). A device truth is cached under a key that adds
the device's name (a CUDA generator's draws depend on the GPU) and is used only when the
stored Q equals the inputs' Q (the draws are the same). A case that fits neither is
refused with the figures.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import os
import secrets
import stat
import tempfile
import threading
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pagedbench.reference import (PagedCase, PagedInputs, PagedValueError, materialize,
                                  resolve_device)
from pagedbench.reference.inputs import device_memory_bytes, footprint_bytes
from pagedbench.reference.refresh import TimedInputs

from pagedbench.harness.verdict.tolerance import Expected
from pagedbench.harness.verdict.truth_sites import HOST_TRUTH_FRACTION

_REFERENCE_DIR = Path(__file__).resolve().parents[2] / "reference"
#: What :meth:`Expected.of` computes is decided here, beside the reference.
_POLICY_SOURCE = Path(__file__).resolve().with_name("tolerance.py")
#: Bytes of the cache folder's HMAC secret.
KEY_BYTES = 32
#: The arrays a cached truth may hold (:class:`~.tolerance.Expected`'s fields).
_ARRAYS = ("truth", "naive", "logit_rounding", "lse", "lse_scale")


def truth_bytes(case: PagedCase) -> int:
    """Bytes computing the truth of ``case`` takes where it runs (bytes): the inputs
    (:func:`~pagedbench.reference.inputs.footprint_bytes`) and the float64 work of its
    longest sequence (K and V gathered, in float64, repeated to the query heads; four
    ``[num_q_heads, q_len, kv_len]`` float64 logit and probability arrays)."""
    kv, q = max(case.kv_lens), max(case.q_lens_or_decode)
    dims = case.head_dim + case.v_head_dim
    gathered = kv * case.num_kv_heads * dims * (case.kv_torch_dtype.itemsize + 8)
    repeated = kv * case.num_q_heads * dims * 8
    logits = 4 * case.num_q_heads * q * kv * 8
    return footprint_bytes(case) + gathered + repeated + logits


def host_budget_bytes() -> int | None:
    """:data:`HOST_TRUTH_FRACTION` of the host's physical memory (bytes); ``None`` when
    the host does not say."""
    total = device_memory_bytes(torch.device("cpu"))
    return None if total is None else int(HOST_TRUTH_FRACTION * total)


def fits_host(case: PagedCase, host_bytes: int | None = None) -> bool:
    """Whether the truth of ``case`` is computed on the host: :func:`truth_bytes` within
    ``host_bytes`` (``None``: :func:`host_budget_bytes`; a host that does not say takes
    every case)."""
    budget = host_budget_bytes() if host_bytes is None else host_bytes
    return budget is None or truth_bytes(case) <= budget


def truth_site(case: PagedCase, device: str, host_bytes: int | None = None) -> str:
    """Where the truth of ``case`` for a run on ``device`` is computed: ``"host"``
    (:func:`fits_host`) or ``"device"`` (:func:`truth_bytes` within the device's memory).

    Raises
    ------
    PagedValueError
        Naming ``kv_lens`` with the bytes needed, the host budget and the device's
        memory, when neither holds it.
    """
    if fits_host(case, host_bytes):
        return "host"
    resolved = resolve_device(device)
    total, need = device_memory_bytes(resolved), truth_bytes(case)
    if total is None or need <= total:
        return "device"
    budget = host_budget_bytes() if host_bytes is None else host_bytes
    raise PagedValueError(
        "kv_lens", f"{case.batch_size} sequences up to {max(case.kv_lens)}",
        "a case whose truth fits the host budget or the device",
        f"{case.case_id}: its truth needs {need / 1e9:.3g} GB, more than the host budget "
        f"({budget / 1e9:.3g} GB) and the {total / 1e9:.3g} GB of {resolved}")


#: ``(seed, call, kv_calls)`` of a timed call: its inputs are
#: :meth:`~pagedbench.reference.refresh.TimedInputs.rebuild` of freshly drawn ones.
TimedCall = tuple[int, int, tuple[int, ...]]


def compute_truth(case: PagedCase, logits_precision: str = "float32", *,
                  with_lse: bool = False, timed_call: TimedCall | None = None) -> Expected:
    """The truth and yardstick of ``case`` (logits of the yardstick in
    ``logits_precision``; ``with_lse``: the log-sum-exp's truth too), computed on the CPU
    (no cache); with ``timed_call``, of the inputs that timed call ran on."""
    inputs = materialize(case, "cpu")
    if timed_call is not None:
        seed, call, kv_calls = timed_call
        TimedInputs(case, seed, kv_calls).rebuild(inputs, call)
    return Expected.of(inputs, logits_precision, with_lse=with_lse)


def cache_key(case: PagedCase, logits_precision: str = "float32", *, with_lse: bool = False,
              timed_call: TimedCall | None = None) -> str:
    """SHA-256 (hex) of the case, the yardstick's logits precision, whether the LSE is
    held, the timed call, the source of the reference and of the tolerance policy, and the
    torch version."""
    digest = hashlib.sha256(json.dumps(case.to_dict(), sort_keys=True).encode())
    digest.update(logits_precision.encode())
    if with_lse:
        digest.update(b"lse")
    if timed_call is not None:
        digest.update(f"timed_call={timed_call[0]},{timed_call[1]},"
                      f"{sorted(timed_call[2])}".encode())
    for source in (*sorted(_REFERENCE_DIR.glob("*.py")), _POLICY_SOURCE):
        digest.update(source.read_bytes())
    digest.update(torch.__version__.encode())
    return digest.hexdigest()


def cache_path(case: PagedCase, cache_dir: Path, logits_precision: str = "float32",
               **variant: Any) -> Path:
    """Where the truth of ``case`` is cached under ``cache_dir`` (``variant``: the
    keywords of :func:`cache_key`)."""
    return Path(cache_dir) / "truth" / f"{cache_key(case, logits_precision, **variant)[:32]}.npz"


def _open_regular(path: Path):
    """``path`` opened for reading when it is a regular file (not followed if a symlink,
    never blocking on a FIFO); raises OSError or ValueError otherwise."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ValueError("it is not a regular file")
    return os.fdopen(fd, "rb")


def _write_atomically(path: Path, write: Callable[[object], None], *,
                      exclusive: bool = False) -> None:
    """``write(file)`` into a fresh temporary file beside ``path`` (mode 0600), then rename
    it over ``path`` (``exclusive``: link it there, raising FileExistsError when another
    process made ``path`` first); the temporary file is removed if anything fails (raises
    OSError)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
        if exclusive:
            os.link(tmp, path)
            Path(tmp).unlink()
        else:
            os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def cache_secret(cache_dir: Path) -> bytes:
    """The HMAC secret of ``cache_dir``'s truths (``<cache_dir>/truth/.key``, mode 0600),
    made on first use; a key file that is not :data:`KEY_BYTES` bytes in a regular file is
    replaced (the entries it signed are then recomputed)."""
    path = Path(cache_dir) / "truth" / ".key"
    missing = False
    try:
        with _open_regular(path) as f:
            key = f.read(KEY_BYTES + 1)
        if len(key) == KEY_BYTES:
            return key
    except FileNotFoundError:
        missing = True
    except (OSError, ValueError):
        pass
    key = secrets.token_bytes(KEY_BYTES)
    try:  # a missing key is made exclusively: processes sharing the folder share one key
        _write_atomically(path, lambda f: f.write(key), exclusive=missing)
    except FileExistsError:
        return cache_secret(cache_dir)
    return key


def _mac(secret: bytes, key: str, arrays: dict[str, np.ndarray]) -> str:
    """HMAC-SHA256 (hex) of the cache key and each array's name, dtype, shape and bytes."""
    mac = hmac.new(secret, key.encode(), hashlib.sha256)
    for name in sorted(arrays):
        array = np.ascontiguousarray(arrays[name])
        mac.update(f"{name}:{array.dtype.str}:{array.shape}".encode())
        mac.update(array.tobytes())
    return mac.hexdigest()


def _load(path: Path, case: PagedCase, key: str, secret: bytes,
          q: torch.Tensor | None = None, with_lse: bool = False) -> Expected:
    """The cached truth at ``path``; raises (ValueError, OSError, KeyError, ...) when the
    file is not exactly what :func:`_save` writes for ``case`` under ``secret`` (a pickle is
    refused by ``allow_pickle=False`` before anything of it runs), or, with ``q``, when its
    stored Q is not ``q``."""
    shape = (case.total_q, case.num_q_heads, case.v_head_dim)
    with _open_regular(path) as f, np.load(f, allow_pickle=False) as saved:
        stored_key, stored_mac = str(saved["key"]), str(saved["mac"])
        arrays = {name: saved[name] for name in (*_ARRAYS, "q") if name in saved}
    if q is not None and not np.array_equal(arrays.get("q"), q.float().cpu().numpy()):
        raise ValueError("its Q is not these inputs' (the device drew other values)")
    if stored_key != key:
        raise ValueError(f"stored key {stored_key[:12]}... is not this case's {key[:12]}...")
    if not hmac.compare_digest(stored_mac, _mac(secret, key, arrays)):
        raise ValueError("its HMAC does not match its values (not written by this cache)")
    wanted = dict.fromkeys(("truth", "logit_rounding"), (np.float64, shape))
    wanted["naive"] = (np.float32, shape)
    if with_lse:
        wanted |= dict.fromkeys(("lse", "lse_scale"), (np.float64, shape[:2]))
    if set(arrays) - {"q"} != set(wanted):
        raise ValueError(f"arrays {sorted(arrays)} are not {sorted(wanted)} (and q)")
    for name, (dtype, want) in wanted.items():
        if arrays[name].dtype != dtype or arrays[name].shape != want:
            raise ValueError(f"{name} is {arrays[name].dtype} {arrays[name].shape}, not "
                             f"{np.dtype(dtype)} {want}")
    tensors = {name: torch.from_numpy(array) for name, array in arrays.items() if name != "q"}
    tensors["naive"] = tensors["naive"].to(case.torch_dtype)
    return Expected(**tensors)


def _save(path: Path, key: str, secret: bytes, found: Expected,
          q: torch.Tensor | None = None) -> None:
    """Write ``found`` (and ``q``, when given), signed with ``secret``, atomically. The
    yardstick and Q are stored as float32, which holds fp16 and bf16 values exactly."""
    arrays = {"truth": found.truth.numpy(), "naive": found.naive.float().numpy()}
    for name in ("logit_rounding", "lse", "lse_scale"):
        if getattr(found, name) is not None:
            arrays[name] = getattr(found, name).double().numpy()
    if q is not None:
        arrays["q"] = q.float().cpu().numpy()
    mac = _mac(secret, key, arrays)
    _write_atomically(path, lambda f: np.savez(f, key=np.array(key), mac=np.array(mac),
                                               **arrays))


def _cached(path: Path, case: PagedCase, key: str, compute: Callable[[], Expected],
            q: torch.Tensor | None = None, with_lse: bool = False) -> Expected:
    """The truth stored at ``path`` when it is ``case``'s under ``key`` (and of ``q``) and
    signed by this cache's secret; otherwise ``compute()``, stored there. A file that
    cannot be read as this case's truth is replaced, with a warning naming it; one that
    cannot be replaced (a folder there) is left, with a warning."""
    secret = cache_secret(path.parent.parent)
    if os.path.lexists(path):
        try:
            return _load(path, case, key, secret, q, with_lse)
        except Exception as exc:  # any unusable file is recomputed, never fatal
            warnings.warn(f"truth cache {path} is unusable ({type(exc).__name__}: {exc}); "
                          "recomputing it", stacklevel=3)
    found = compute()
    try:
        _save(path, key, secret, found, q)
    except OSError as exc:
        warnings.warn(f"truth cache {path} cannot be written ({type(exc).__name__}: {exc}); "
                      "using the truth uncached", stacklevel=3)
    return found


def truth_for(case: PagedCase, cache_dir: Path, logits_precision: str = "float32", *,
              with_lse: bool = False, timed_call: TimedCall | None = None) -> Expected:
    """:func:`compute_truth`, from the cache when a valid file is there; otherwise
    computed and cached (:func:`_cached`). The truth of a timed call is never cached: its
    seed is drawn afresh for each timing, so a file of it would never be read again."""
    if timed_call is not None:
        return compute_truth(case, logits_precision, with_lse=with_lse, timed_call=timed_call)
    return _cached(cache_path(case, cache_dir, logits_precision, with_lse=with_lse), case,
                   cache_key(case, logits_precision, with_lse=with_lse),
                   lambda: compute_truth(case, logits_precision, with_lse=with_lse),
                   with_lse=with_lse)


def compute_device_truth(inputs: PagedInputs, logits_precision: str = "float32", *,
                         with_lse: bool = False) -> Expected:
    """The truth and yardstick of ``inputs`` computed on their device, sequence by
    sequence, brought back to the host (``[total_q, num_q_heads, head_dim]`` each)."""
    return Expected.of(inputs, logits_precision, where_they_are=True, with_lse=with_lse)


def device_name(device: torch.device) -> str:
    """``"cpu"``, or ``"cuda:<GPU name>"`` (what a device truth's draws depend on)."""
    if device.type != "cuda":
        return device.type
    index = device.index if device.index is not None else torch.cuda.current_device()
    return f"cuda:{torch.cuda.get_device_name(index)}"


def device_truth_for(inputs: PagedInputs, cache_dir: Path,
                     logits_precision: str = "float32", *, with_lse: bool = False) -> Expected:
    """:func:`compute_device_truth` of ``inputs`` (drawn with ``on_device=True``), cached
    under ``cache_dir`` by case, logits precision, reference, torch and device name; a
    stored file is used only when its Q equals ``inputs.q``."""
    case = inputs.case
    digest = hashlib.sha256(cache_key(case, logits_precision, with_lse=with_lse).encode())
    digest.update(device_name(inputs.device).encode())
    key = digest.hexdigest()
    path = Path(cache_dir) / "truth" / f"device-{key[:32]}.npz"
    return _cached(path, case, key,
                   lambda: compute_device_truth(inputs, logits_precision, with_lse=with_lse),
                   inputs.q, with_lse)


#: One :func:`judging_state` at a time in this process: a judge thread left running past
#: its harness timeout still holds the state, so the next case's thread waits for it
#: (inside its own budget) instead of saving the first one's settings as "previous" and
#: restoring them over the caller's.
_JUDGING = threading.Lock()


@contextlib.contextmanager
def judging_state() -> Iterator[None]:
    """Judge with torch's defaults, whatever this process had set, restored after:
    ``float32`` matmul precision ``"highest"`` (no TF32), default dtype float32, denormals
    kept in the judging thread (no flush to zero; left so after), reduced-precision
    fp16/bf16 reductions at their defaults. Held by one thread at a time.

    The intra-op thread count is left alone: ``torch.set_num_threads`` from a helper
    thread sets the count every thread started later takes, and the truth does not
    depend on it (the yardstick's bits are the same at 1 and 2 threads:
    suites/harness/verdict/test_tolerance_yardstick_orders.py)."""
    with _JUDGING:
        matmul = torch.backends.cuda.matmul
        saved = (torch.get_float32_matmul_precision(), torch.get_default_dtype(),
                 matmul.allow_fp16_reduced_precision_reduction,
                 matmul.allow_bf16_reduced_precision_reduction, torch.backends.cudnn.allow_tf32)
        torch.set_flush_denormal(False)  # the previous mode cannot be read back: left off
        torch.set_float32_matmul_precision("highest")
        torch.set_default_dtype(torch.float32)
        matmul.allow_fp16_reduced_precision_reduction = True
        matmul.allow_bf16_reduced_precision_reduction = True
        torch.backends.cudnn.allow_tf32 = False
        try:
            yield
        finally:
            precision, dtype, fp16, bf16, cudnn_tf32 = saved
            torch.set_float32_matmul_precision(precision)
            torch.set_default_dtype(dtype)
            matmul.allow_fp16_reduced_precision_reduction = fp16
            matmul.allow_bf16_reduced_precision_reduction = bf16
            torch.backends.cudnn.allow_tf32 = cudnn_tf32


__all__ = ["KEY_BYTES", "cache_key", "cache_path", "cache_secret", "compute_device_truth",
           "compute_truth", "device_name", "device_truth_for", "fits_host", "host_budget_bytes",
           "judging_state", "truth_bytes", "truth_for", "truth_site"]
