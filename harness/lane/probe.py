"""The GPU lane's first two steps: ``env`` (``env.json``: the machine measured, every
peer's version, the selection) and ``list`` (``list.json``: ``pagedbench list --json`` of
the selection), and what the later steps read back of them."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

from pagedbench.harness.lane import BUILD
from pagedbench.harness.results.record import VERSION_FIELDS

#: Modules whose distributions env.json records beside every result's libraries
#: (:data:`~pagedbench.harness.results.record.VERSION_FIELDS`): FlashAttention 3, and
#: what the lane's own steps run on.
LANE_PACKAGES = ("flash_attn_3", "pydantic", "hypothesis", "pytest", "xdist", "pytest_timeout",
                 "numpy")
#: ``nvidia-smi --query-gpu`` fields recorded in env.json.
NVIDIA_SMI_FIELDS = ("name", "driver_version", "memory.total", "compute_cap", "clocks.sm",
                     "clocks.mem", "clocks.max.sm", "clocks.max.mem", "power.limit",
                     "pstate")


def _nvidia_smi() -> dict[str, Any]:
    """``nvidia-smi --query-gpu`` of :data:`NVIDIA_SMI_FIELDS` (first GPU), or why not."""
    try:
        done = subprocess.run(["nvidia-smi", f"--query-gpu={','.join(NVIDIA_SMI_FIELDS)}",
                               "--format=csv,noheader"], capture_output=True, text=True,
                              timeout=30)
    except (OSError, subprocess.SubprocessError) as exc:
        return {"error": f"nvidia-smi not run: {exc}"}
    if done.returncode != 0 or not done.stdout.strip():
        return {"error": f"nvidia-smi exit {done.returncode}: {done.stderr.strip()}"}
    values = [v.strip() for v in done.stdout.splitlines()[0].split(",")]
    return dict(zip(NVIDIA_SMI_FIELDS, values))


def measure_device(device: str) -> dict[str, Any]:
    """The copy bandwidth and bf16 matrix-product rate measured on ``device``
    (:func:`~pagedbench.harness.measure.timing.measure_peaks`, what ``pagedbench bench`` measures),
    the figures the sweep's fractions are taken of (``bench --peaks env.json``).

    ``peaks``: the :class:`~pagedbench.harness.results.record.DevicePeaks` fields (the
    in-cache copy rate among them, which the physical floor judges warm timings by);
    ``copy_bandwidth_gbps``: a device-to-device ``copy_`` of
    :data:`~pagedbench.harness.measure.timing.COPY_BYTES` (1 GiB on CUDA), bytes read plus written
    per second (1e9 B/s); ``bf16_tflops``: a bf16 matrix product of
    :data:`~pagedbench.harness.measure.timing.MATMUL_N` (8192 on CUDA), 2 n^3 FLOP. Medians of
    ``time_cuda`` (CUDA events, L2 flushed, after a pre-roll) on CUDA, of
    ``torch.utils.benchmark`` on the CPU (rehearsal).
    """
    from pagedbench.harness.measure.timing import COPY_BYTES, MATMUL_N, measure_peaks

    kind = "cuda" if device == "cuda" else "cpu"
    peaks = measure_peaks(device, os.cpu_count() or 1)
    return {"peaks": peaks.to_dict(),
            "copy_bandwidth_gbps": round(peaks.copy_gbps, 1), "copy_bytes": COPY_BYTES[kind],
            "bf16_tflops": round(peaks.bf16_tflops, 1), "matmul_n": MATMUL_N[kind],
            "method": peaks.method}


def environment_record(device: str, selection: dict[str, Any],
                       measure: bool = True) -> dict[str, Any]:
    """What ``env.json`` holds: the selection (``Selection.to_dict()``); :func:`pagedbench.harness.results.store.environment`
    (with the given commit); where ``pagedbench`` was imported from; torch's CUDA build;
    the GPU's SM count, L2 and memory; ``nvidia-smi`` (driver, clocks, power limit); every
    peer's installed version; the FlashInfer modules compiled ahead of time that its
    package holds; :func:`measure_device` (``measured`` and ``peaks`` None without
    ``measure``: the env step writes that record first, so a step stopped while measuring
    still leaves one)."""
    import torch

    import pagedbench
    from pagedbench.adapters.cuda_probe import installed_distribution

    from pagedbench.harness.results.store import environment

    gpu = None
    if device == "cuda" and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        gpu = {"name": props.name, "sm_count": props.multi_processor_count,
               "l2_cache_bytes": getattr(props, "L2_cache_size", None),
               "total_memory_bytes": props.total_memory,
               "cc": f"{props.major}.{props.minor}", "device_count": torch.cuda.device_count()}
    measured = measure_device(device) if measure else None
    packages = {}
    for module in (*VERSION_FIELDS, *LANE_PACKAGES):
        found = installed_distribution(module)
        packages[module] = None if found is None else {"distribution": found[0],
                                                       "version": found[1]}
    return {
        "selection": selection,
        "environment": environment(device),
        "pagedbench_path": [str(Path(p).resolve()) for p in pagedbench.__path__],
        "torch_cuda_build": torch.version.cuda,
        "gpu": gpu,
        "nvidia_smi": _nvidia_smi() if device == "cuda" else {"skipped": "device is not CUDA"},
        "measured": measured,
        "peaks": measured["peaks"] if measured else None,
        "packages": packages,
        "flashinfer_aot": flashinfer_aot_modules(),
    }


def flashinfer_aot_modules() -> list[str]:
    """The modules FlashInfer's package holds compiled ahead of time (``flashinfer/data/
    aot/<name>/<name>.so``, where the lane puts the carry's), without importing it."""
    from importlib.util import find_spec

    spec = find_spec("flashinfer")
    if spec is None or not spec.submodule_search_locations:
        return []
    aot = Path(list(spec.submodule_search_locations)[0]) / "data" / "aot"
    return sorted(p.parent.name for p in aot.glob("*/*.so") if p.stem == p.parent.name)


def write_listing(device: str, impls: tuple[str, ...], path: Path) -> int:
    """Write ``pagedbench list --json``'s rows for ``impls`` (every implementation when
    empty) on ``device`` to ``path``; returns how many are available.

    Raises
    ------
    ValueError
        If a name in ``impls`` is not an implementation's.
    """
    from pagedbench.adapters import entries

    from pagedbench.harness.run.list_job import list_adapters

    found = entries()
    unknown = sorted(set(impls) - {e.name for e in found})
    if unknown:
        raise ValueError(f"--impl {', '.join(unknown)}: unknown; choose from "
                         f"{', '.join(e.name for e in found)}")
    rows = list_adapters([e for e in found if not impls or e.name in impls], device, BUILD)
    path.write_text(json.dumps([row.model_dump(mode="json") for row in rows], indent=2) + "\n")
    return sum(row.available for row in rows)


def available_impls(list_json: Path) -> tuple[str, ...]:
    """Names ``pagedbench list --json`` found available, in its order; empty when the
    file is missing or unreadable."""
    try:
        rows = json.loads(list_json.read_text())
    except (OSError, ValueError):
        return ()
    return tuple(row["name"] for row in rows if isinstance(row, dict) and row.get("available"))
