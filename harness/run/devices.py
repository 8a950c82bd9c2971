"""The GPUs a test session or run spreads over, one process per GPU, each pinned with
``CUDA_VISIBLE_DEVICES`` (the CUDA runtime reads it once, at its first call).

- :func:`visible_gpus`: the GPUs this process may use, as ``CUDA_VISIBLE_DEVICES``
  entries: that variable's own entries when it is set, else the indices ``nvidia-smi``
  lists, else none (no driver, or a machine without NVIDIA GPUs).
- :func:`nvidia_smi_uuids`: each GPU's UUID, recorded with its results.
- :func:`xdist_worker_gpu`: the GPU of pytest-xdist worker ``gwN``: entry ``N mod
  len(gpus)`` (two workers share a GPU only when there are more workers than GPUs).

Standard library only: the pytest plugin calls it before torch is imported.
"""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Callable, Mapping, Sequence

#: pytest-xdist's worker ids: ``gw0``, ``gw1``, ...
_WORKER_ID = re.compile(r"gw(\d+)")


def _nvidia_smi(fields: str) -> list[list[str]]:
    """The rows of ``nvidia-smi --query-gpu=<fields>`` (comma-separated values), or ``[]``
    without ``nvidia-smi`` or when it fails or takes over 30 s."""
    try:
        done = subprocess.run(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return []
    if done.returncode != 0:
        return []
    return [[v.strip() for v in line.split(",")] for line in done.stdout.splitlines()
            if line.strip()]


def nvidia_smi_indices() -> list[str]:
    """The indices ``nvidia-smi`` lists (``["0", "1"]``), or ``[]`` (see :func:`_nvidia_smi`)."""
    return [row[0] for row in _nvidia_smi("index")]


def nvidia_smi_uuids() -> dict[str, str]:
    """``{index: UUID}`` of the GPUs ``nvidia-smi`` lists (``{"0": "GPU-5b1e..."}``), or
    ``{}``. Its indices are in PCI bus order: a CUDA process's ordinals are the same only
    with ``CUDA_DEVICE_ORDER=PCI_BUS_ID``."""
    return {row[0]: row[1] for row in _nvidia_smi("index,uuid") if len(row) == 2}


def visible_gpus(environ: Mapping[str, str] | None = None,
                 query: Callable[[], list[str]] = nvidia_smi_indices) -> list[str]:
    """The GPUs this process may use, as ``CUDA_VISIBLE_DEVICES`` entries (indices or
    UUIDs): the entries of ``CUDA_VISIBLE_DEVICES`` in ``environ`` (default: this
    process's environment) when it is set (empty: none), else ``query()``."""
    environ = os.environ if environ is None else environ
    if "CUDA_VISIBLE_DEVICES" in environ:
        return [e.strip() for e in environ["CUDA_VISIBLE_DEVICES"].split(",") if e.strip()]
    return query()


def xdist_worker_gpu(worker_id: str, gpus: Sequence[str]) -> str | None:
    """The ``CUDA_VISIBLE_DEVICES`` value of pytest-xdist worker ``worker_id``
    (``"gw3"``): ``gpus[3 % len(gpus)]``; None without GPUs.

    Raises
    ------
    ValueError
        If ``worker_id`` is not ``gw`` followed by digits.
    """
    found = _WORKER_ID.fullmatch(worker_id)
    if found is None:
        raise ValueError(f"worker_id {worker_id!r}: expected gw<N>, as pytest-xdist names "
                         "its workers")
    return gpus[int(found.group(1)) % len(gpus)] if gpus else None


__all__ = ["nvidia_smi_indices", "nvidia_smi_uuids", "visible_gpus", "xdist_worker_gpu"]
