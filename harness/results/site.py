"""The leaderboard as a static site: ``pagedbench report DIR... --format site --output DIR``.

``index.html`` lists the environments (a device with its library versions, driver and
threads: :func:`~.record.environment_key`) and the runs read; each environment has a page
(:func:`environment_page`) with its conditions (device, versions, commit, measured
peaks), the board, the plots of :mod:`.plots` and the bench tables of :mod:`.report`,
the reasons of every non-pass and the replay commands. ``--format html`` is one such
page holding every environment (:func:`single_page`).

The board has a row per case, its parameters in columns (model or workload, dtype, block
size, batch, context, mode), and a column per implementation in the implementation's
colour (:func:`~.plots.colour_of`). A timed pass shows its median and spread, shaded by
its speed against the row's fastest (:func:`shade`: darkest for the fastest, pale at 10x
slower or more) and its speedup over the baseline; a fail is red with its largest error
in ulps; ``error``, ``crash`` and ``timeout`` red with the status; an interpreted pass
blue-grey and never ranked; ``unsupported`` and ``unavailable`` grey, and hidden, with
the columns and rows made only of them, until the checkbox shows them. Each cell links to
its case's replay commands, whose case file the page carries as a download. Every page is
self-contained (CSS, script and plots inline, :mod:`.site_assets`): it opens from disk and
on any static host. Every text from a results file is escaped.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from html import escape
from pathlib import Path
from urllib.parse import quote

import pandas as pd

from pagedbench.harness.cases.workloads import DEFAULT_BASELINE
from pagedbench.harness.results import plots, report
from pagedbench.harness.results.derived import RANKED_METHODS
from pagedbench.harness.results.record import (VERSION_FIELDS, ResultRecord, RunRecord,
                                               environment_key, latest)
from pagedbench.harness.results.site_assets import CSS, JS, one_line
from pagedbench.harness.results.store import results_of, run_states, write_output
from pagedbench.harness.verdict.status import Status

#: The stylesheet and script as every page carries them.
_STYLE, _SCRIPT = one_line(CSS), one_line(JS)
#: Speed ratio to the row's fastest at which a pass's shade is palest.
PALEST_RATIO = 10.0
_DTYPE = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}
_FAILED = {Status.FAIL: "fail", Status.ERROR: "bad", Status.CRASH: "bad",
           Status.TIMEOUT: "bad", Status.HARNESS_ERROR: "herr"}


def shade(ratio: float) -> tuple[str, str]:
    """Background and text colour of a pass ``ratio`` times slower than its row's
    fastest (>= 1): green from dark (1) to pale (:data:`PALEST_RATIO` and beyond), its
    darkness the square of ``1 - log ratio / log PALEST_RATIO`` (so 1.5x slower is
    already clearly lighter than the fastest)."""
    speed = (1 - min(1.0, math.log(max(ratio, 1.0)) / math.log(PALEST_RATIO))) ** 2
    lightness = 94 - 52 * speed
    return f"hsl(140,{38 + 22 * speed:.0f}%,{lightness:.0f}%)", (
        "#fff" if lightness < 62 else "#14361d")


def ranked(record: ResultRecord) -> bool:
    """A pass timed by a ranked method, never an interpreter."""
    t = record.time_ms
    return (record.status is Status.PASS and t is not None and t.method in RANKED_METHODS
            and not record.interpreted)


def _time(ms: float) -> str:
    for factor, unit in ((1e-3, "s"), (1.0, "ms"), (1e3, "\u00b5s")):
        if ms * factor >= 1 or factor == 1e3:
            return f"{ms * factor:.3g} {unit}"
    raise AssertionError("unreachable")


def _span(values) -> str:
    low, high = min(values), max(values)
    return f"{low}" if low == high else f"{low}..{high}"


def slug(text: str) -> str:
    """A file-name-safe form of ``text`` (lower case, ``-`` between words)."""
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "x"


def page_name(device: str, versions: str) -> str:
    """The file of an environment's page: the device's slug and a hash of the rest."""
    return f"{slug(device)}-{hashlib.sha256(versions.encode()).hexdigest()[:8]}.html"


def case_file(record: ResultRecord) -> str:
    """The name a case's JSON downloads as: its id and a hash of its fields."""
    digest = hashlib.sha256(json.dumps(record.case, sort_keys=True).encode()).hexdigest()
    return f"{record.case_id}-{digest[:8]}.json"


def environments(lines: list[ResultRecord | RunRecord]) -> list[dict]:
    """Per environment, in order of appearance: ``device``, ``versions``, ``records``
    (the one measured last of each result key: :func:`~.record.latest`) and ``section``
    (:func:`~.report.sections`' entry)."""
    grouped: dict[tuple[str, str], list[ResultRecord]] = {}
    for record in latest(results_of(lines)).values():
        grouped.setdefault(environment_key(record), []).append(record)
    return [{"device": device, "versions": versions, "records": records}
            for (device, versions), records in grouped.items()]


def _cell(record: ResultRecord, best: float | None, base: float | None, anchor: str,
          baseline: str) -> str:
    """One board cell (``<td>``): ``best`` the row's fastest median, ``base`` the
    baseline's (ms, None when untimed)."""
    status, t = record.status, record.time_ms
    link = f"<a class='rp' href='#{anchor}' title='replay commands'>&#8635;</a>"
    reason = escape(record.reason, quote=True)
    if status is Status.PASS:
        mark = report.cell_text(record).split(" ")[0][len("pass"):]
        if not ranked(record):
            note = "interp." if record.interpreted else "untimed"
            return (f"<td class='cell interp' data-sort='1e12' title='pass; "
                    f"{'ran under an interpreter: never ranked' if record.interpreted else 'not timed'}'>"
                    f"<span class='t'>pass{escape(mark)}{link}</span>"
                    f"<span class='s'>{note}</span></td>")
        ratio = t.median / best if best else 1.0
        background, ink = shade(ratio)
        speedup = (f" &middot; {base / t.median:.2f}&times;" if base and
                   record.impl != baseline else "")
        classes = "cell pass best" if ratio <= 1.0 else "cell pass"
        spread = (t.p90 - t.p10) / (2 * t.median)
        title = (f"median {t.median:.4g} ms, p10 {t.p10:.4g}, p90 {t.p90:.4g}, n={t.n}"
                 + (", noisy" if t.noisy else "") + (f"; {ratio:.2f}x the row's fastest"
                                                      if ratio > 1 else "; fastest"))
        return (f"<td class='{classes}' data-sort='{t.median:.6g}' "
                f"style='background:{background};color:{ink}' title='{escape(title)}'>"
                f"<span class='t'>{escape(_time(t.median))}{escape(mark)}{link}</span>"
                f"<span class='s'>&plusmn;{spread:.0%}{speedup}</span></td>")
    if status in _FAILED:
        ulps = record.max_err_ulps
        detail = (f"{ulps:.3g} ulps" if status is Status.FAIL and ulps is not None
                  and math.isfinite(ulps) else escape(record.reason.split(";")[0][:28]))
        return (f"<td class='cell {_FAILED[status]}' data-sort='1e13' title='{reason}'>"
                f"<span class='t'>{status}{link}</span><span class='s'>{detail}</span></td>")
    return f"<td class='cell na' title='{reason}'>{status}</td>"


def board(records: list[ResultRecord], baseline: str, key: str) -> tuple[str, str]:
    """The board of one environment's records and its replay section, as HTML; ``key``
    makes the element ids unique on a page."""
    impls = list(dict.fromkeys(r.impl for r in records))
    cases: dict[str, dict[str, ResultRecord]] = {}
    for record in records:
        cases.setdefault(record.case_id, {})[record.impl] = record
    grey = (Status.UNSUPPORTED, Status.UNAVAILABLE)
    na_impls = {impl for impl in impls
                if all(row[impl].status in grey for row in cases.values() if impl in row)}
    head = "".join(f"<th>{h}</th>" for h in ("model / workload", "dtype", "block size",
                                               "batch", "context", "mode"))
    head += "".join(
        f"<th class='impl{' na-col' if impl in na_impls else ''}' title='{escape(impl)}'>"
        f"<span class='chip' style='background:{plots.colour_of(impl)}'></span> "
        f"{escape(impl)}{' (baseline)' if impl == baseline else ''}</th>" for impl in impls)
    body, replays = [], []
    for index, (case_id, row) in enumerate(cases.items()):
        first = next(iter(row.values()))
        case = first.paged_case()
        anchor = f"{key}-case-{index}"
        timed = [r.time_ms.median for r in row.values() if ranked(r)]
        best = min(timed) if timed else None
        base = row[baseline].time_ms.median if baseline in row and ranked(row[baseline]) \
            else None
        mode = (first.bench_mode or case.mode) + (" latent" if case.latent_cache else "")
        group = first.workload or case.name or case_id
        params = [(group, group), (_DTYPE.get(case.dtype, case.dtype), case.dtype),
                  (case.block_size, case.block_size), (case.batch_size, case.batch_size),
                  (_span(case.kv_lens), max(case.kv_lens)), (mode, mode)]
        cells = "".join(
            f"<td class='param{' group' if i == 0 else ''}' data-sort='{escape(str(sort))}'"
            + (f" title='{escape(case_id, quote=True)}'" if i == 0 else "")
            + f">{escape(str(text))}</td>" for i, (text, sort) in enumerate(params))
        for impl in impls:
            record = row.get(impl)
            if record is None:
                cells += f"<td class='cell na{' na-col' if impl in na_impls else ''}'></td>"
                continue
            cell = _cell(record, best, base, anchor, baseline)
            if impl in na_impls:
                cell = cell.replace("class='cell na'", "class='cell na na-col'", 1)
            cells += cell
        na_row = all(r.status in grey for r in row.values())
        body.append(f"<tr{' class=na-row' if na_row else ''} "
                    f"data-text='{escape(case_id + ' ' + ' '.join(row), quote=True)}'>"
                    f"{cells}</tr>")
        replays.append(_replay_row(anchor, case_id, row, grey))
    table = (f"<div class='scroll'><table class='board' id='{key}-board'><thead><tr>{head}"
             f"</tr></thead><tbody>{''.join(body)}</tbody></table></div>")
    replay = (f"<details class='replay'><summary>Replay commands ({len(cases)} cases)"
              "</summary><p class='note'>Download a case's file, then run the command: "
              "<code>pagedbench replay</code> checks that implementation on that case again, "
              "in a worker, and prints the verdict and its figures.</p>"
              f"<table class='data'><thead><tr><th>case</th><th>case file</th>"
              f"<th>commands</th></tr></thead><tbody>{''.join(replays)}</tbody></table>"
              "</details>")
    return table, replay


def _replay_row(anchor: str, case_id: str, row: dict[str, ResultRecord], grey) -> str:
    first = next(iter(row.values()))
    name = case_file(first)
    data = "data:application/json," + quote(json.dumps(first.case, indent=1) + "\n")
    commands = "<br>".join(
        f"<code>pagedbench replay {escape(name)} --impl {escape(impl)}</code> "
        f"<span class='note'>({escape(str(record.status))})</span>"
        for impl, record in row.items() if record.status not in grey) or "-"
    return (f"<tr id='{anchor}'><td>{escape(case_id)}</td><td><a download='{escape(name)}' "
            f"href='{escape(data, quote=True)}'>{escape(name)}</a></td><td>{commands}</td></tr>")


def conditions(records: list[ResultRecord], lines: list) -> str:
    """The environment of ``records`` as a definition list: device, versions, driver,
    threads, commit, runs, measured peaks."""
    env = records[0].env
    runs = sorted({r.run_id for r in records})
    shas = sorted({(r.env.git_sha or "?")[:12] + (" (dirty)" if r.env.dirty else "")
                   for r in records})
    peaks = report.measured_peaks(records)
    items = [("device", f"{env.device} ({env.device_type})"), ("threads", env.threads),
             ("compute capability", env.cc), ("driver", env.driver), ("python", env.python),
             *((name, getattr(env, name)) for name in VERSION_FIELDS),
             ("commit", ", ".join(shas)), ("runs", ", ".join(runs))]
    if peaks is not None:
        items += [("copy bandwidth", f"{peaks.copy_gbps:.3g} GB/s (measured)"),
                  ("bf16 matmul", f"{peaks.bf16_tflops:.3g} TFLOP/s (measured)")]
    return "<dl class='env'>" + "".join(
        f"<div><dt>{escape(name)}</dt><dd>{escape(str(value))}</dd></div>"
        for name, value in items if value not in (None, "")) + "</dl>"


_LEGEND = (
    "<div class='legend'><span><span class='sw' style='background:{fast}'></span>fastest "
    "pass of the row</span><span><span class='sw' style='background:{slow}'></span>"
    "{palest:g}x slower or more</span><span><span class='sw' style='background:#fdecea'>"
    "</span>fail (largest error in ulps), error, crash, timeout</span><span>"
    "<span class='sw' style='background:#eef3fb'></span>pass under an interpreter (not "
    "ranked)</span><span><span class='sw' style='background:#eef0f3'></span>unsupported, "
    "unavailable</span></div>")


def environment_section(env: dict, lines: list, baseline: str, key: str) -> str:
    """One environment's content: conditions, board, plots, bench tables, reasons."""
    records, device, versions = env["records"], env["device"], env["versions"]
    section = next(s for s in report.sections(
        [*[line for line in lines if not isinstance(line, ResultRecord)], *records], baseline)
        if s["title"] == f"{device} ({versions})")
    table, replay = board(records, baseline, key)
    passed = sum(r.status is Status.PASS for r in records)
    failed = sum(r.status.failing for r in records)
    legend = _LEGEND.format(fast=shade(1.0)[0], slow=shade(PALEST_RATIO)[0],
                            palest=PALEST_RATIO)
    parts = [f"<section class='card'><h2>Conditions</h2>{conditions(records, lines)}"
             "</section>",
             f"<section class='card'><h2>Leaderboard</h2><p class='note'>{len(records)} "
             f"results: {passed} pass, {failed} fail, error, crash or timeout. Each cell: "
             "the median time per call, then &plusmn; half its p10-p90 spread and the "
             f"speedup over the baseline <b>{escape(baseline)}</b> on that case (hover: "
             "p10, p90, samples). Click a header to sort, type to filter; &#8635; links to "
             "the case's replay command.</p>"
             f"<div class='controls'><input type='search' class='filter' data-table="
             f"'{key}-board' placeholder='filter: model, dtype, implementation...'>"
             f"<label><input type='checkbox' class='show-na'> show unsupported and "
             f"unavailable</label>{legend}</div>{table}"
             f"<p class='note'>Outlined: the fastest pass of the row. Marks: "
             f"{escape(report.MARKS.replace('`', ''))}</p>"
             f"{replay}</section>"]
    peaks = report.measured_peaks(records)
    copy_gbps = None if peaks is None else peaks.copy_gbps
    figures = plots.figures(section["bench"], section["scores"], copy_gbps,
                            plots.case_frame(records))
    if figures:
        parts.append("<section class='card'><h2>Plots</h2>" + "".join(
            f"<figure><img alt='{escape(plots.TITLES[name])}' loading='lazy' "
            f"src='data:image/png;base64,{plots.png_base64(fig)}'><figcaption>"
            f"{escape(plots.TITLES[name])}"
            + (f"; dashed: the measured copy bandwidth, {copy_gbps:.3g} GB/s"
               if copy_gbps and "gbps" in name else "") + "</figcaption></figure>"
            for name, fig in figures.items()) + "</section>")
    bench = [t for t in section["tables"] if t[0] not in ("Leaderboard",)]
    parts.append("<section class='card'><h2>Tables</h2>" + "".join(
        f"<h3>{escape(title)}</h3>" + (f"<p class='note'>{escape(note)}</p>" if note else "")
        + "<div class='scroll'>" + _data_table(frame) + "</div>"
        for title, note, frame in bench) + "</section>")
    if section["reasons"]:
        parts.append("<section class='card'><details><summary>Reasons of every non-pass ("
                     f"{len(section['reasons'])})</summary><ul class='reasons'>" + "".join(
                         f"<li>{escape(n)}</li>" for n in section["reasons"])
                     + "</ul></details></section>")
    return "".join(parts)


def _data_table(frame: pd.DataFrame) -> str:
    """A sortable table of a report frame (index as the first column), cells escaped."""
    frame = frame.reset_index()
    head = "".join(f"<th>{escape(str(c))}</th>" for c in frame.columns)
    rows = "".join("<tr>" + "".join(f"<td>{escape(str(v))}</td>" for v in row) + "</tr>"
                   for row in frame.itertuples(index=False))
    return f"<table class='data'><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table>"


def _page(title: str, subtitle: str, body: str, home: str | None) -> str:
    nav = f"<a href='{home}'>&larr; all devices</a>" if home else ""
    return (f"<!doctype html><html lang='en'><head><meta charset='utf-8'>"
            f"<meta name='viewport' content='width=device-width,initial-scale=1'>"
            f"<title>{escape(title)}</title><style>{_STYLE}</style></head><body>"
            f"<header class='top'>{nav}<h1>{escape(title)}</h1><span class='sub'>"
            f"{escape(subtitle)}</span></header><main>{body}</main>"
            f"<script>{_SCRIPT}</script></body></html>\n")


def _unfinished(lines: list) -> str:
    return "".join(f"<p class='warn'>{escape(n)}</p>" for n in report.unfinished(lines))


def environment_page(env: dict, lines: list, baseline: str, title: str) -> str:
    """The page of one environment (:func:`environments`)."""
    return _page(f"{title}: {env['device']}", env["versions"],
                 _unfinished(lines) + environment_section(env, lines, baseline, "e"),
                 "index.html")


def index_page(envs: list[dict], lines: list, title: str) -> str:
    """The list of environments (a link each) and of the runs read."""
    rows = []
    for env in envs:
        records = env["records"]
        ranked_impls = sorted({r.impl for r in records if ranked(r)})
        rows.append(
            f"<tr><td><a href='{page_name(env['device'], env['versions'])}'>"
            f"{escape(env['device'])}</a></td><td>{escape(env['versions'])}</td>"
            f"<td>{len({r.case_id for r in records})}</td><td>{len(ranked_impls)}</td>"
            f"<td>{escape(', '.join(sorted({r.run_id for r in records})))}</td></tr>")
    runs = []
    for state in run_states(lines).values():
        start, end = state.started, state.finished
        mine = [r for r in results_of(lines) if r.run_id == state.run_id]
        runs.append(
            f"<tr><td>{escape(state.run_id)}</td>"
            f"<td>{escape(', '.join(sorted({r.env.device for r in mine})))}</td>"
            f"<td>{escape(', '.join(sorted({r.suite for r in mine})))}</td>"
            f"<td>{state.results}</td><td>{escape(str(start.timestamp) if start else '')}"
            f"</td><td>{escape('finished, exit %s' % end.exit_code if end else 'unfinished')}"
            f"</td><td>{escape(', '.join(sorted({(r.env.git_sha or '?')[:12] for r in mine})))}"
            "</td></tr>")
    body = (_unfinished(lines) + "<section class='card'><h2>Devices</h2><p class='note'>One "
            "page per device and set of library versions, driver and thread count: results "
            "of two such environments are never ranked together.</p><table class='index'>"
            "<thead><tr><th>device</th><th>environment</th><th>cases</th><th>ranked "
            "implementations</th><th>runs</th></tr></thead><tbody>" + "".join(rows)
            + "</tbody></table></section><section class='card'><h2>Runs</h2>"
            "<table class='index'><thead><tr><th>run</th><th>device</th><th>suite</th>"
            "<th>results</th><th>started</th><th>end</th><th>commit</th></tr></thead>"
            "<tbody>" + "".join(runs) + "</tbody></table></section>")
    return _page(title, f"{_count(len(envs), 'environment')}, {_count(len(runs), 'run')}",
                 body, None)


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def build(lines: list[ResultRecord | RunRecord], output: Path, baseline: str = DEFAULT_BASELINE,
          title: str = "pagedbench leaderboard") -> list[Path]:
    """Write the site of ``lines`` into the folder ``output`` (created): ``index.html``
    and one page per environment; returns the paths written."""
    output.mkdir(parents=True, exist_ok=True)
    envs = environments(lines)
    written = []
    for env in envs:
        path = output / page_name(env["device"], env["versions"])
        write_output(path, environment_page(env, lines, baseline, title))
        written.append(path)
    write_output(output / "index.html", index_page(envs, lines, title))
    return [output / "index.html", *written]


def single_page(lines: list[ResultRecord | RunRecord], baseline: str = DEFAULT_BASELINE,
                title: str = "pagedbench leaderboard") -> str:
    """Every environment of ``lines`` on one self-contained page (``--format html``)."""
    envs = environments(lines)
    body = _unfinished(lines) + "".join(
        f"<h2 class='env'>{escape(env['device'])}</h2>"
        + environment_section(env, lines, baseline, f"e{k}") for k, env in enumerate(envs))
    return _page(title, _count(len(envs), "environment"), body or "<p>No results.</p>", None)
