"""``pagedbench report --format site`` and ``--format html``: self-contained pages whose
board is colour-coded, sortable, filterable and hides unsupported cells behind a toggle,
with every plot inline in each implementation's colour; checked in headless Chromium
(skipped without ``chromium``): the page renders, sorting, filtering and the toggle work,
and no script error is raised."""

from __future__ import annotations

import base64
import io
import json
import re
import shutil
import subprocess
from colorsys import hls_to_rgb

import numpy as np
import pytest
from matplotlib.colors import to_rgb
from matplotlib.image import imread

from pagedbench.harness.cases.workloads import BENCH_SUITE, CONTIGUOUS_TAG, grid_workload
from pagedbench.harness.cli import main
from pagedbench.harness.results.plots import colour_of
from pagedbench.harness.results.site import shade
from pagedbench.harness.results.site_assets import CSS, JS, one_line
from pagedbench.harness.results.store import ResultsFile

from ..conftest import result

IMPLS = ("base", "fast", "broken", "absent")


def _records():
    out = []
    for batch in (1, 2, 4):
        w = grid_workload("decode", "gqa4", batch, 64)
        for bs, tag in ((16, ""), (32, ""), (256, CONTIGUOUS_TAG)):
            case = w.case(bs, "float32", tag)
            bench = {"suite": BENCH_SUITE, "workload": w.name, "bench_mode": "decode"}
            for impl, ms in (("base", 1.0 * batch), ("fast", 0.5 * batch * (1 + bs / 64))):
                out.append(result(impl, case, "pass", ms, **bench))
            out.append(result("broken", case, "fail", reason="max error 12.5 ulps",
                              max_err_ulps=12.5, **bench))
            out.append(result("absent", case, "unavailable", reason="absent not installed",
                              **bench))
    return out


def _has_colour(pixels: np.ndarray, colour, at_least: int) -> bool:
    close = np.abs(pixels[..., :3] - np.asarray(colour)).max(axis=-1) < 0.06
    return int(close.sum()) >= at_least


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The site and the single page of :func:`_records` (baseline ``base``), rendered
    once: (site folder, page, plots folder)."""
    folder = tmp_path_factory.mktemp("board")
    store = ResultsFile(folder / "r.jsonl")
    for record in _records():
        store.append(record)
    assert main(["report", str(store.path), "--format", "site", "--output",
                 str(folder / "site"), "--baseline-impl", "base"]) == 0
    page = folder / "board.html"
    assert main(["report", str(store.path), "--format", "html", "--baseline", "base",
                 "--output", str(page), "--plots-dir", str(folder / "plots")]) == 0
    return folder / "site", page, folder / "plots"


def test_a_page_carries_the_script_and_stylesheet_on_one_line_each(built) -> None:
    site, page, _ = built
    # Joining is safe only while every line of the script ends a statement or opens or
    # closes a block, and no line comment would swallow what follows it.
    lines = [line.strip() for line in JS.splitlines() if line.strip()]
    assert all(line.endswith((";", "{", "}")) for line in lines), [
        line for line in lines if not line.endswith((";", "{", "}"))]
    assert not any(re.search(r"(^|[^:\\])//", line) for line in lines)
    assert one_line("  a {\n\n    b;\n  }\n") == "a { b; }"
    for text in (page.read_text(), (site / "index.html").read_text()):
        assert f"<style>{one_line(CSS)}</style>" in text
        assert f"<script>{one_line(JS)}</script>" in text
        assert text.count("\n") == 1  # the whole page is one line


def test_the_site_and_the_page_are_self_contained_with_every_plot(built) -> None:
    site, page, plots = built
    (device,) = [p for p in site.iterdir() if p.name != "index.html"]
    assert f"href='{device.name}'" in (site / "index.html").read_text()
    for text in (device.read_text(), page.read_text()):
        assert not re.search(r"(src|href)=['\"]?(https?:)?//", text)  # nothing fetched
        images = re.findall(r"data:image/png;base64,([A-Za-z0-9+/=]+)", text)
        assert len(images) == 4  # latency vs batch, GB/s and overhead vs block size, fast_p
        for data in images:  # each draws both timed implementations in their colours
            pixels = imread(io.BytesIO(base64.b64decode(data)), format="png")
            assert all(_has_colour(pixels, to_rgb(colour_of(i)), 50) for i in ("base", "fast"))
        # fast at bs16: 0.5 x (1 + 16/64) = 0.625 of base's time: 1.6x faster; at bs256
        # 2.5x slower, its cell the palest green.
        assert "1.60&times;" in text and "0.40&times;" in text
        assert text.count("<td class='cell fail'") == 9 and "12.5 ulps" in text
        assert "+0% [+0%, +0%]" in text and "-75% [-75%, -75%]" in text  # paging overhead
    assert sorted(p.name for p in plots.iterdir()) == [
        "fast_p.png", "gbps_vs_block_size.png", "latency_vs_batch.png",
        "overhead_vs_block_size.png"]


#: Run in the page after its own script: sort, filter and toggle as a reader would, and
#: write what the page then shows into an element that --dump-dom prints.
PROBE = """<script>
(function () {
  var out = {errors: window.__errors};
  var board = document.querySelector('table.board');
  var heads = board.tHead.rows[0].cells;
  function column(i) {
    return Array.prototype.map.call(board.tBodies[0].rows, function (r) {
      return r.cells[i].getAttribute('data-sort'); });
  }
  function visible(selector) {
    return Array.prototype.filter.call(document.querySelectorAll(selector), function (e) {
      return e.offsetParent !== null; }).length;
  }
  heads[2].click(); out.blockUp = column(2);
  heads[2].click(); out.blockDown = column(2);
  var fast = Array.prototype.findIndex.call(heads, function (h) {
    return h.textContent.trim() === 'fast'; });
  heads[fast].click(); out.fast = column(fast);
  out.hiddenBefore = visible('.na-col');
  var box = document.querySelector('input.show-na');
  box.checked = true; box.dispatchEvent(new Event('change'));
  out.hiddenAfter = visible('.na-col');
  var filter = document.querySelector('input.filter');
  filter.value = 'bs32'; filter.dispatchEvent(new Event('input'));
  out.filtered = visible('table.board tbody tr');
  var pre = document.createElement('pre'); pre.id = 'probe';
  pre.textContent = JSON.stringify(out); document.body.appendChild(pre);
})();
</script>"""
CATCH = ("<script>window.__errors = []; window.addEventListener('error', function (e) {"
         " window.__errors.push(String(e.message)); }); var _e = console.error;"
         " console.error = function () { window.__errors.push([].join.call(arguments, ' '));"
         " _e.apply(console, arguments); };</script>")


def _chromium(tmp_path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
         f"--user-data-dir={tmp_path / 'profile'}", *args],
        capture_output=True, text=True, timeout=120,
        env={"HOME": str(tmp_path), "PATH": "/usr/bin:/bin"})


@pytest.mark.skipif(shutil.which("chromium") is None,
                    reason="Debian's chromium is not installed (apt-get install chromium; "
                           ".ci/run installs it when it can)")
def test_in_chromium_the_board_renders_sorts_filters_and_toggles(built, tmp_path) -> None:
    site, _, _ = built
    (device,) = [p for p in site.iterdir() if p.name != "index.html"]
    probed = tmp_path / "probed.html"
    text = device.read_text()
    probed.write_text(text.replace("<head>", "<head>" + CATCH, 1)
                      .replace("</body>", PROBE + "</body>", 1))
    done = _chromium(tmp_path, "--virtual-time-budget=5000", "--dump-dom", probed.as_uri())
    found = re.search(r"<pre id=\"probe\">(.*?)</pre>", done.stdout, re.S)
    assert found, done.stderr[-2000:]
    probe = json.loads(found.group(1).replace("&quot;", '"').replace("&amp;", "&"))
    assert probe["errors"] == []
    assert probe["blockUp"] == sorted(probe["blockUp"], key=int)
    assert probe["blockDown"] == sorted(probe["blockUp"], key=int, reverse=True)
    assert probe["fast"] == sorted(probe["fast"], key=float)  # by median, fastest first
    assert probe["hiddenBefore"] == 0 and probe["hiddenAfter"] == 1 + 9  # absent's column
    assert probe["filtered"] == 3  # the bs32 point of each batch size
    # The page as a reader sees it: the board's shades, the failures' red, the plots.
    shot = tmp_path / "shot.png"
    _chromium(tmp_path, f"--screenshot={shot}", "--window-size=1400,3000", device.as_uri())
    pixels = imread(shot)[..., :3]
    fastest = [int(v) / 100 for v in re.findall(r"\d+", shade(1.0)[0])]
    assert _has_colour(pixels, hls_to_rgb(fastest[0] * 100 / 360, fastest[2], fastest[1]), 500)
    assert _has_colour(pixels, to_rgb("#fdecea"), 2000)  # fail cells
    assert _has_colour(pixels, to_rgb(colour_of("fast")), 300)  # its plot lines
