"""Hypothesis example budgets: how many examples a property gets, per profile and, for
the conformance search, per implementation by its measured speed.

The profile is the one hypothesis loaded, from ``--hypothesis-profile NAME`` or else the
``HYPOTHESIS_PROFILE`` variable (suites/conftest.py), read with
``settings.get_current_profile_name()`` once the session is configured. (Budgets used to
be looked up in ``os.environ`` when a test module was imported, so the command-line
option changed the profile but not the example counts.)

:func:`examples_for` divides the profile's time budget per implementation
(:data:`SECONDS`) by the seconds one example of ``test_paged_matches_dense`` takes
there (``suites/conformance/example_seconds.json``, measured by ``python -m
pagedbench.suites.conformance.measure``), clamped to :data:`EXAMPLES`: a fast CPU op
gets hundreds of examples in ``ci``, an interpreted kernel tens.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path

from hypothesis import settings

#: Seconds of search per implementation, per profile with a time budget.
SECONDS = {"ci": 30.0, "nightly": 600.0}
#: Fewest and most examples per implementation, per profile.
EXAMPLES = {"ci": (8, 500), "nightly": (100, 20_000)}
#: Seconds per example assumed for an implementation the table does not list: about what
#: an interpreted kernel costs, so an unmeasured plug-in gets tens of examples, not
#: hundreds (one that compiles per shape is held to the floor once measured).
UNMEASURED_SECONDS = 2.0
#: The measured table.
TABLE = Path(__file__).resolve().parent / "conformance" / "example_seconds.json"


def profile() -> str:
    """The name of the hypothesis profile in force."""
    return settings.get_current_profile_name()


def by_profile(counts: Mapping[str, int]) -> int:
    """``counts[profile()]``, or the profile's own ``max_examples`` for a profile
    ``counts`` does not name (a user's own profile)."""
    return counts.get(profile(), settings().max_examples)


def seconds_per_example(table: Path = TABLE) -> dict[str, float]:
    """The measured seconds per example, by implementation name (empty without the
    table)."""
    if not table.is_file():
        return {}
    return {name: float(s) for name, s in json.loads(table.read_text())["seconds"].items()}


def examples_for(impl: str, seconds: Mapping[str, float]) -> int | None:
    """Examples for ``impl`` in the current profile: its time budget over ``impl``'s
    seconds per example (:data:`UNMEASURED_SECONDS` if unmeasured), clamped to
    :data:`EXAMPLES`; ``None`` for a profile without a time budget (its own
    ``max_examples`` applies)."""
    name = profile()
    if name not in SECONDS:
        return None
    low, high = EXAMPLES[name]
    per_example = seconds.get(impl, UNMEASURED_SECONDS)
    return max(low, min(high, math.floor(SECONDS[name] / max(per_example, 1e-6))))


__all__ = ["EXAMPLES", "SECONDS", "TABLE", "UNMEASURED_SECONDS", "by_profile",
           "examples_for", "profile", "seconds_per_example"]
