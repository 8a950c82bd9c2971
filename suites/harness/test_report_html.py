"""``pagedbench report --format html``: one standalone page whose tables and plots show
in a real browser (headless Chromium screenshots it; skipped without ``chromium``)."""

from __future__ import annotations

import base64
import io
import re
import shutil
import subprocess

import numpy as np
import pytest
from matplotlib.image import imread

from pagedbench.harness.cli import main
from pagedbench.harness.store import ResultsFile
from pagedbench.harness.workloads import BENCH_SUITE, CONTIGUOUS_TAG, grid_workload

from .conftest import result

#: matplotlib's first two line colours (C0, C1), as RGB in [0, 1].
C0, C1 = np.array([0x1F, 0x77, 0xB4]) / 255, np.array([0xFF, 0x7F, 0x0E]) / 255


def _records():
    out = []
    for batch in (1, 2, 4):
        w = grid_workload("decode", "gqa4", batch, 64)
        for bs, tag in ((16, ""), (32, ""), (256, CONTIGUOUS_TAG)):
            case = w.case(bs, "float32", tag)
            for impl, ms in (("base", 1.0 * batch), ("fast", 0.5 * batch * (1 + bs / 64))):
                out.append(result(impl, case, "pass", ms, suite=BENCH_SUITE,
                                  workload=w.name, bench_mode="decode"))
    return out


def _has_colour(pixels: np.ndarray, colour: np.ndarray, at_least: int) -> bool:
    close = np.abs(pixels[..., :3] - colour).max(axis=-1) < 0.06
    return int(close.sum()) >= at_least


@pytest.fixture(scope="module")
def board(tmp_path_factory):
    """``pagedbench report --format html --plots-dir`` of :func:`_records`, rendered once:
    (the page's path, the plots folder)."""
    folder = tmp_path_factory.mktemp("board")
    store = ResultsFile(folder / "r.jsonl")
    for record in _records():
        store.append(record)
    out = folder / "board.html"
    assert main(["report", str(folder / "r.jsonl"), "--format", "html", "--baseline", "base",
                 "--output", str(out), "--plots-dir", str(folder / "plots")]) == 0
    return out, folder / "plots"


def test_html_is_standalone_with_tables_and_every_plot(board) -> None:
    out, plots = board
    page = out.read_text()
    assert "<table" in page and "Paging overhead vs block size" in page
    assert not re.search(r"(src|href)=['\"]https?:", page)  # nothing fetched
    images = re.findall(r"data:image/png;base64,([A-Za-z0-9+/=]+)", page)
    assert len(images) == 4  # latency vs batch, GB/s and overhead vs block size, fast_p
    for data in images:  # each plot draws both implementations' lines
        pixels = imread(io.BytesIO(base64.b64decode(data)), format="png")
        assert _has_colour(pixels, C0, 50) and _has_colour(pixels, C1, 50)
    assert sorted(p.name for p in plots.iterdir()) == [
        "fast_p.png", "gbps_vs_block_size.png", "latency_vs_batch.png",
        "overhead_vs_block_size.png"]
    # base takes the same time at every block size: no paging overhead; fast takes
    # 0.5 x batch x (1 + bs / 64) ms: at bs16 1.25 / 5 - 1 = -75% against its bs256 run.
    assert "+0% [+0%, +0%]" in page and "-75% [-75%, -75%]" in page


@pytest.mark.skipif(shutil.which("chromium") is None,
                    reason="Debian's chromium is not installed (apt-get install chromium; "
                           ".ci/run installs it when it can)")
def test_headless_chromium_shows_the_table_and_the_plots(board, tmp_path) -> None:
    page, _ = board
    shot = tmp_path / "shot.png"
    done = subprocess.run(
        ["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
         f"--user-data-dir={tmp_path / 'profile'}", f"--screenshot={shot}",
         "--window-size=1400,6000", page.as_uri()],
        capture_output=True, text=True, timeout=120,
        env={"HOME": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert shot.exists(), done.stderr[-2000:]
    pixels = imread(shot)[..., :3]
    # The table: header cells' background (#dde6f0) and dark text on white.
    assert _has_colour(pixels, np.array([0xDD, 0xE6, 0xF0]) / 255, 2000)
    # The plots: both implementations' line colours, over many pixels.
    assert _has_colour(pixels, C0, 500) and _has_colour(pixels, C1, 500)
    assert (pixels.max(axis=-1) < 0.5).sum() > 5000  # text and axes drawn
