"""The gate's golden files: ``results/baselines/<device>/baseline.jsonl``, one folder per
device (:func:`device_folder`), found for the devices of the current results
(:func:`baseline_paths`; read with the current ones,
:func:`~pagedbench.harness.results.shard.merged_lines`) and rewritten from current results
(:func:`write_baseline`, ``pagedbench gate --update-baseline``). Finding them imports
nothing heavy (``pagedbench gate --help`` shows :data:`BASELINES_DIR`); writing imports
the results' records when called."""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from pagedbench.reference import PagedValueError

if TYPE_CHECKING:
    from pagedbench.harness.results.record import ResultRecord

#: Where ``pagedbench gate`` and ``make`` keep the golden results, one folder per device.
BASELINES_DIR = Path("results/baselines")
#: The file a device folder's golden is written to.
BASELINE_FILE = "baseline.jsonl"


def device_folder(device: str) -> str:
    """The folder name of a device under :data:`BASELINES_DIR`: its name in lower case,
    every run of other characters than letters and digits one ``-``
    (``"NVIDIA H200"`` -> ``nvidia-h200``)."""
    return re.sub(r"[^a-z0-9]+", "-", device.lower()).strip("-") or "unknown-device"


def _is_root(path: Path) -> bool:
    """Whether ``path`` is a folder of device folders (or will be one): a folder without
    ``.jsonl`` files of its own, or a path that does not exist and is not a ``.jsonl``."""
    if path.is_dir():
        return not any(path.glob("*.jsonl"))
    return not path.exists() and path.suffix != ".jsonl"


def baseline_paths(path: Path, devices: Iterable[str]) -> list[Path]:
    """The baseline files or folders to read for results of ``devices``: ``path`` itself
    when it is a ``.jsonl`` file or a folder of them, else its device folders
    (:func:`device_folder`) that exist.

    Raises
    ------
    PagedValueError
        If ``path`` is a file that is not ``.jsonl``.
    """
    if path.is_file() and path.suffix != ".jsonl":
        raise PagedValueError("--baseline", str(path), "a .jsonl file or a folder")
    if not _is_root(path):
        return [path]
    return [path / name for name in sorted({device_folder(d) for d in devices})
            if (path / name).is_dir()]


def write_baseline(records: Iterable[ResultRecord], path: Path) -> list[Path]:
    """Write ``records`` (one per point, the one measured last of each) as the new golden:
    to ``path`` when it is a ``.jsonl`` file, to ``path/baseline.jsonl`` when it is a
    folder of them, else to ``path/<device>/baseline.jsonl`` per device. Each file is
    replaced atomically (written beside it, then renamed). Returns the files written.

    Raises
    ------
    PagedValueError
        If there is no record to write.
    """
    from pagedbench.harness.gate.compare import points

    by_point = points(records)
    if not by_point:
        raise PagedValueError("--current", "no results", "at least one result to write")
    if not _is_root(path):
        groups = {path if path.suffix == ".jsonl" else path / BASELINE_FILE: by_point}
    else:
        groups = {}
        for key, record in by_point.items():
            target = path / device_folder(key.device) / BASELINE_FILE
            groups.setdefault(target, {})[key] = record
    for target, group in groups.items():
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        tmp.write_text("".join(r.model_dump_json() + "\n" for r in group.values()))
        os.replace(tmp, target)
    return list(groups)


__all__ = ["BASELINES_DIR", "BASELINE_FILE", "baseline_paths", "device_folder",
           "write_baseline"]
