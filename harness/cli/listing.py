"""``pagedbench list``: the implementations, whether each is available here (or why not),
its version and library build; ``list NAME...`` what each named one declares, ``--wide``
every implementation's declarations in one Markdown table, ``--json`` the rows as data
(its options: :mod:`.listing_options`).

The default table fits the terminal (:func:`~pagedbench.harness.run.summary.terminal`:
its width, ``$COLUMNS``, else 100 columns): the reason an implementation is unavailable
and its build are cut with an ellipsis to what the name and version leave; ``list NAME``
shows them whole.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import pandas as pd
from rich import box
from rich.markup import escape
from rich.table import Table

from pagedbench.adapters import entries
from pagedbench.reference import PagedValueError

from pagedbench.harness.results import report
from pagedbench.harness.results.report import CASE_LOGITS_MARK, STALE_TAIL_MARK
from pagedbench.harness.results.record import ListingRow
from pagedbench.harness.run import list_job
from pagedbench.harness.run.summary import fitted_table, terminal


def cmd_list(args: argparse.Namespace) -> int:
    found = entries()
    if args.names:
        known = [e.name for e in found]
        unknown = [n for n in args.names if n not in known]
        if unknown:
            raise PagedValueError("NAME", unknown, f"among {known}",
                                  f"no implementation named {', '.join(unknown)} (known: "
                                  f"{', '.join(known)})")
        found = [e for e in found if e.name in args.names]
    # Any device, even one this machine lacks: what each implementation declares for it
    # is worth seeing, and its availability there says why it cannot run here.
    rows = list_job.list_adapters(found, args.device, args.cache_dir, args.timeout)
    if args.json:
        print(json.dumps([row.model_dump(mode="json") for row in rows], indent=2))
    elif args.wide:
        print(capability_matrix(rows))
    else:
        console = terminal()
        if args.names:
            for row in rows:
                console.print(declared(row))
        else:
            console.print(compact(rows, console.width))
    return 0


def availability(row: ListingRow) -> str:
    """``yes``, ``yes (interp.)``, ``no: REASON``, or the status of a listing that failed
    (``crash: REASON``)."""
    if row.available:
        return "yes" + (" (interp.)" if row.interpreted else "")
    return f"no: {row.reason}" if row.status == "unavailable" else f"{row.status}: {row.reason}"


def build(row: ListingRow) -> str:
    """The library build and ISA paths an implementation names (``impl_details``), those
    this host cannot take, and where its kernel files came from; ``-`` for none."""
    named = (row.details.get(key) for key in ("library", "cpu_isa", "isa", "isa_not_here",
                                               "source"))
    return "; ".join(str(value) for value in named if value) or "-"


def _join(values: Any) -> str:
    if values is None:
        return "any"
    if not isinstance(values, list):
        return str(values)
    steps = {b - a for a, b in zip(values, values[1:])} if all(
        isinstance(v, int) for v in values) else set()
    if len(values) > 6 and len(steps) == 1:
        return f"{values[0]}..{values[-1]} step {steps.pop()}"
    return ", ".join(map(str, values)) or "-"


def axes(row: ListingRow) -> dict[str, str]:
    """What an implementation declares, one text per axis (empty when it could not say)."""
    caps = row.capabilities
    if caps is None:
        return {}
    return {
        "devices": _join(caps.get("devices")),
        "dtypes": _join(caps.get("dtypes")),
        "block sizes": _join(caps.get("block_sizes")),
        "head dims": _join(caps.get("head_dims")) + (
            "" if caps.get("v_head_dims") is None else f" (V {_join(caps['v_head_dims'])})"),
        "modes": _join(caps.get("modes")),
        "features": _join(caps.get("features")) + (
            "; latent cache only" if caps.get("needs_latent_cache") else ""),
        "kv cache": _join(caps.get("kv_cache_dtypes")),
        "NaN-safe tail": "yes" if caps.get("nan_safe_tail") else f"no ({STALE_TAIL_MARK})",
        "logits": ("float32" if caps.get("logits_precision", "float32") == "float32"
                   else f"case dtype ({CASE_LOGITS_MARK})"),
    }


def compact(rows: list[ListingRow], width: int) -> Table:
    """One row per implementation, within ``width`` columns: name, available (or why
    not), version, build; the last two columns' reasons cut to fit."""
    cells = [(escape(row.name),
              f"[{'green' if row.available else 'dim'}]{escape(availability(row))}[/]",
              escape(str(row.version or "")), escape(build(row))) for row in rows]
    return fitted_table("", ("implementation", "available", "version", "build"), cells,
                        width, shrink=(1, 3))


def declared(row: ListingRow) -> Table:
    """Everything ``pagedbench list`` knows of one implementation, one line per field,
    values whole (wrapped)."""
    table = Table(show_header=False, box=box.SIMPLE, title=escape(row.name),
                  title_justify="left", title_style="bold", pad_edge=False)
    table.add_column(style="dim", no_wrap=True)
    table.add_column(overflow="fold")
    caps = row.capabilities or {}
    fields = {"description": row.description, "target": row.target,
              "available": availability(row), "version": row.version or "",
              "build": build(row), **axes(row),
              "layouts": _join(caps.get("layouts")) if caps else "",
              "notes": "; ".join(f"{k}: {v}" for k, v in (caps.get("notes") or {}).items())}
    for name, value in fields.items():
        if value:
            table.add_row(name, escape(str(value)))
    return table


def capability_matrix(rows: list[ListingRow]) -> str:
    """Markdown table (``--wide``): implementations x (availability, version, library
    build and ISA paths with those this host cannot take, devices, dtypes, block sizes,
    head dims, modes, features), from ``pagedbench list`` rows."""
    table = pd.DataFrame([
        {"implementation": row.name, "available": availability(row),
         "version": row.version, "build, ISA paths": build(row), **axes(row)}
        for row in rows
    ])
    return report.escape_frame(table.fillna("?")).to_markdown(index=False)

