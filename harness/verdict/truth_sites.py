"""Where a case's truth may be computed (:data:`TRUTH_SITES`) and how much of the host a
host truth may take (:data:`HOST_TRUTH_FRACTION`); :func:`~.truth.truth_site` chooses.
Nothing heavy is imported here: ``pagedbench bench --help`` shows the fraction."""

from __future__ import annotations

TRUTH_SITES = ("host", "device")
#: Share of the host's physical memory a host truth may take: the parent, the worker
#: and whatever else runs there share the rest.
HOST_TRUTH_FRACTION = 0.25

__all__ = ["HOST_TRUTH_FRACTION", "TRUTH_SITES"]
