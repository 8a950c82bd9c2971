"""Measure the seconds one example of ``test_paged_matches_dense`` takes per
implementation, and write the table that sizes the first run of each search
(``example_seconds.json`` beside this file; ``suites/budget.py`` reads it as a first
guess, and the search then fills its seconds at the speed it measures).

    python -m pagedbench.suites.conformance.measure [--impl NAME ...] [--examples N]

Each implementation available here runs the search's own case strategy
(:func:`~.cases.case_strategy`) for ``N`` derandomized examples,
timing what one example of the test does: draw, ``why_unsupported`` and the conformance
check. With ``--catalogue`` the fault catalogue's control is measured too, and every
fault gets its figure: the faults run the control's kernel, so separate measurements
would only record the noise of a shared machine as budgets 8 times apart. Implementations not measured keep their old figure;
those unavailable here are listed with the reason. The table records the command, the
host's CPU, torch's thread count and the date; on a shared machine the figures are noisy.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from datetime import datetime, timezone

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

# The test session's environment first (caches; the Triton interpreter on a CPU-only
# host, before any kernel imports Triton), so examples cost here what they cost there.
from pagedbench.suites import conftest as _session  # noqa: F401  isort: skip
from pagedbench.adapters import entries, load
from pagedbench.harness.results.store import environment
from pagedbench.harness.run.config import DEFAULT_CATALOGUE
from pagedbench.harness.run.selftest import CONTROL, catalogue_entries, register_catalogue
from pagedbench.harness.verdict import conformance
from pagedbench.suites.budget import TABLE

from .conftest import DEVICE
from .cases import case_strategy


def seconds_per_example(adapter, examples: int) -> float:
    """Mean seconds of one example of the conformance search on ``adapter``."""
    strategy = case_strategy(adapter)
    durations: list[float] = []

    @settings(max_examples=examples, derandomize=True, database=None, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(data=st.data())
    def one(data) -> None:
        start = time.perf_counter()
        case = data.draw(strategy)
        if not adapter.why_unsupported(case, DEVICE):
            conformance.check(adapter, case, DEVICE)
        durations.append(time.perf_counter() - start)

    one()
    return sum(durations) / len(durations)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pagedbench.suites.conformance.measure",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--impl", action="append", default=[], metavar="NAME",
                        help="measure only these (repeatable; default: every one available)")
    parser.add_argument("--examples", type=int, default=20, help="examples each (default 20)")
    parser.add_argument("--catalogue", action="store_true",
                        help="also measure the fault catalogue (suites/faults)")
    args = parser.parse_args(argv)
    faults: set[str] = set()
    if args.catalogue:
        register_catalogue()
        faults = {e.name for e in catalogue_entries(DEFAULT_CATALOGUE)} - {CONTROL}
        args.impl = args.impl and [*args.impl, CONTROL]
    table = json.loads(TABLE.read_text()) if TABLE.is_file() else {"seconds": {}}
    table.setdefault("unavailable", {})
    for entry in entries():
        if (args.impl and entry.name not in args.impl) or entry.name in faults:
            continue
        adapter = load(entry.target)
        availability = adapter.available(DEVICE)
        if not availability.ok:
            table["unavailable"][entry.name] = availability.reason
            continue
        table["unavailable"].pop(entry.name, None)
        table["seconds"][entry.name] = round(seconds_per_example(adapter, args.examples), 4)
        print(f"{entry.name}: {table['seconds'][entry.name]:.4f} s per example", flush=True)
    if faults and CONTROL in table["seconds"]:
        table["seconds"] |= {name: table["seconds"][CONTROL] for name in faults}
    table["command"] = " ".join(["python -m pagedbench.suites.conformance.measure",
                                 *(argv if argv is not None else sys.argv[1:])])
    table["host"] = {"cpu": environment(DEVICE)["device"], "machine": platform.machine(),
                     "torch_threads": torch.get_num_threads(),
                     "date": datetime.now(timezone.utc).date().isoformat()}
    TABLE.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
