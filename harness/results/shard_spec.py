"""Which shard of a plan this machine runs: ``--shard K/N`` (:func:`parse_spec`), or
``auto`` (``auto/N`` where the CI gives no count, :func:`resolve`): the index and count of
Buildkite's parallel jobs, a Slurm job array, a Kubernetes indexed Job or pagedbench's own
``PAGEDBENCH_SHARD`` (a GitHub matrix value passed through), refusing an incomplete set
with the variable it lacks (:data:`CI_VARIABLES`). Which pairs the shard holds is
:mod:`.shard`'s; this module imports nothing heavy, so ``--shard`` is parsed (and a bad
one refused) before torch is imported.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

from pagedbench.reference import PagedValueError

_SPEC = re.compile(r"(\d+)/(\d+)")


@dataclass(frozen=True)
class ShardSpec:
    """``--shard K/N``: the K-th (from 1) of N shards."""

    index: int
    count: int

    def __post_init__(self) -> None:
        if not 1 <= self.index <= self.count:
            raise PagedValueError("--shard", f"{self.index}/{self.count}",
                                  "K/N with 1 <= K <= N")

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"


#: The CI variables ``--shard auto`` reads, in this order: (system, index variable, its
#: first index, count variables). Slurm's count is ``SLURM_ARRAY_TASK_COUNT``, or
#: ``SLURM_ARRAY_TASK_MAX`` - ``SLURM_ARRAY_TASK_MIN`` + 1 (over ``SLURM_ARRAY_TASK_STEP``),
#: and its index counts from ``SLURM_ARRAY_TASK_MIN``; a Kubernetes indexed Job has no
#: count variable (``auto/N`` gives it); ``PAGEDBENCH_SHARD`` is ``K/N`` itself.
CI_VARIABLES = (
    ("Buildkite", "BUILDKITE_PARALLEL_JOB", 0, ("BUILDKITE_PARALLEL_JOB_COUNT",)),
    ("Slurm", "SLURM_ARRAY_TASK_ID", None, ("SLURM_ARRAY_TASK_COUNT", "SLURM_ARRAY_TASK_MIN",
                                            "SLURM_ARRAY_TASK_MAX")),
    ("Kubernetes", "JOB_COMPLETION_INDEX", 0, ()),
    ("pagedbench", "PAGEDBENCH_SHARD", 1, ()),
)
_AUTO = re.compile(r"auto(?:/(\d+))?")


def _integer(environ: Mapping[str, str], name: str) -> int:
    value = environ[name].strip()
    if not value.isdigit():
        raise PagedValueError("--shard", "auto", f"{name} an integer >= 0",
                              f"--shard auto: {name}={environ[name]!r} is not an integer >= 0")
    return int(value)


def _slurm(environ: Mapping[str, str]) -> tuple[int, int]:
    """``(index from 0, count)`` of a Slurm array task."""
    task = _integer(environ, "SLURM_ARRAY_TASK_ID")
    lacking = [n for n in ("SLURM_ARRAY_TASK_MIN", "SLURM_ARRAY_TASK_MAX") if n not in environ]
    if "SLURM_ARRAY_TASK_COUNT" not in environ and lacking:
        raise PagedValueError("--shard", "auto", "SLURM_ARRAY_TASK_COUNT, or "
                              "SLURM_ARRAY_TASK_MIN and SLURM_ARRAY_TASK_MAX",
                              f"--shard auto: SLURM_ARRAY_TASK_ID is set but not "
                              f"SLURM_ARRAY_TASK_COUNT, nor {' and '.join(lacking)}")
    low = _integer(environ, "SLURM_ARRAY_TASK_MIN") if "SLURM_ARRAY_TASK_MIN" in environ else 0
    step = _integer(environ, "SLURM_ARRAY_TASK_STEP") if "SLURM_ARRAY_TASK_STEP" in environ else 1
    count = (_integer(environ, "SLURM_ARRAY_TASK_COUNT") if "SLURM_ARRAY_TASK_COUNT" in environ
             else (_integer(environ, "SLURM_ARRAY_TASK_MAX") - low) // max(step, 1) + 1)
    if step < 1 or (task - low) % step:
        raise PagedValueError("--shard", "auto", "a task of the array",
                              f"--shard auto: SLURM_ARRAY_TASK_ID {task} is not a task of the "
                              f"array from {low} in steps of {step}")
    return (task - low) // step, count


def resolve(text: str, environ: Mapping[str, str] | None = None) -> ShardSpec:
    """``--shard``'s value: ``K/N`` (:func:`parse_spec`), or ``auto``/``auto/N`` read from
    the CI's variables in ``environ`` (default ``os.environ``; :data:`CI_VARIABLES`).

    Raises
    ------
    PagedValueError
        Naming ``--shard``: no CI variable set, those of two systems set, a count variable
        (or ``auto/N``'s count) lacking, a count that differs from ``auto/N``'s, a value
        that is not an integer, or an index past the count.
    """
    found = _AUTO.fullmatch(text.strip())
    if found is None:
        return parse_spec(text)
    environ = os.environ if environ is None else environ
    given = int(found.group(1)) if found.group(1) else None
    systems = [entry for entry in CI_VARIABLES if entry[1] in environ]
    if not systems:
        raise PagedValueError("--shard", text, "a CI's index variable", (
            f"--shard {text}: no CI index variable is set (looked for "
            f"{', '.join(entry[1] for entry in CI_VARIABLES)}); give --shard K/N"))
    if len(systems) > 1:
        raise PagedValueError("--shard", text, "the variables of one CI", (
            f"--shard {text}: both {systems[0][1]} ({systems[0][0]}) and {systems[1][1]} "
            f"({systems[1][0]}) are set; give --shard K/N"))
    system, index_name, first, counts = systems[0]
    if system == "Slurm":
        index, count = _slurm(environ)
    elif system == "pagedbench":
        spec = parse_spec(environ[index_name])
        index, count = spec.index - 1, spec.count
    else:
        index = _integer(environ, index_name) - first
        if counts and counts[0] not in environ:
            raise PagedValueError("--shard", text, f"{counts[0]} beside {index_name}",
                                  f"--shard {text}: {index_name} is set but not {counts[0]}")
        if not counts and given is None:
            raise PagedValueError("--shard", text, "auto/N", (
                f"--shard {text}: {index_name} ({system}) gives the index but no count: "
                "give it as --shard auto/N (a Kubernetes indexed Job's completions)"))
        count = _integer(environ, counts[0]) if counts else given
    if given is not None and given != count:
        raise PagedValueError("--shard", text, f"auto/{count}", (
            f"--shard {text}: {system} says {count} shards"))
    if not 0 <= index < count:
        raise PagedValueError("--shard", text, f"an index below the count {count}", (
            f"--shard {text}: {system}'s index {index} (from {index_name}) is not below its "
            f"count {count}"))
    return ShardSpec(index + 1, count)


def parse_spec(text: str) -> ShardSpec:
    """``"K/N"`` as a :class:`ShardSpec` (argparse's ``type=``).

    Raises
    ------
    PagedValueError
        Naming ``--shard`` for anything but ``K/N`` with ``1 <= K <= N``.
    """
    found = _SPEC.fullmatch(text.strip())
    if found is None:
        raise PagedValueError("--shard", text, "K/N with 1 <= K <= N, e.g. 1/4")
    return ShardSpec(int(found.group(1)), int(found.group(2)))


__all__ = ["CI_VARIABLES", "ShardSpec", "parse_spec", "resolve"]
