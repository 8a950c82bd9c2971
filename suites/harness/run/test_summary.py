"""The summary ``run``, ``bench`` and ``gate`` end with: within the terminal's width, the
fastest passing implementation per preset (as the records say), verdicts per
implementation, an unavailable implementation on one line, each failure with the command
that replays it."""

from __future__ import annotations

import io
import re
from pathlib import Path

import pytest
from rich.console import Console

from pagedbench.harness.results.store import read_lines, results_of
from pagedbench.harness.run import summary
from pagedbench.harness.run.replay import REPLAY_DIR_VARIABLE
from pagedbench.harness.verdict.status import Status

from ..conftest import ENV, result

ROOT = Path(__file__).resolve().parents[3]
#: A committed ``make run`` of every built-in on the CPU: 21 implementations x 36 cases.
DEFAULT_JOB = sorted((ROOT / "results" / "leaderboards").glob("*.jsonl"))


def _printed(records, width: int, **options) -> list[str]:
    out = io.StringIO()
    console = Console(file=out, width=width, force_terminal=False, highlight=False)
    summary.print_summary(console, records, "pagedbench run r1 (cpu)", **options)
    return out.getvalue().splitlines()


@pytest.fixture(scope="module")
def default_job():
    return results_of(list(read_lines(DEFAULT_JOB)))


@pytest.mark.parametrize("width", [120, 100, 80])
def test_the_default_jobs_summary_fits_and_names_each_cases_fastest(default_job, width) -> None:
    lines = _printed(default_job, width, files=[("report", Path("results/runs/r1.md"))])
    assert max(map(len, lines)) <= width
    assert len(lines) < 90  # the Markdown report it replaces: 100 lines of up to 1,776
    if width < 120:
        return
    fastest: dict[str, tuple[float, str]] = {}
    for r in default_job:  # computed here from the records, not by the summary's code
        if r.status is Status.PASS and r.time_ms is not None and not r.interpreted:
            fastest[r.case_id] = min(fastest.get(r.case_id, (float("inf"), "")),
                                     (r.time_ms.median, r.impl))
    assert len(fastest) == 36
    rows = [line for line in lines if " kv1.." in line]
    assert len(rows) == 36
    for line, (case_id, (_, impl)) in zip(rows, fastest.items()):
        label = summary.case_label(next(r for r in default_job if r.case_id == case_id))
        cells = re.split(r"\s{2,}", line.strip())
        assert cells[-4:-2] == [label, impl], (case_id, line)
    presets = [line.split()[0] for line in rows if not line.startswith("   ")]
    assert presets == ["llama3.1-8b", "llama3.1-70b-tp8", "mistral-7b", "qwen2.5-7b",
                       "phi3-mini", "gemma2-9b", "deepseek-v3-mla-tp8"]
    unavailable = [line for line in lines if ": unavailable: " in line]
    assert [line.split(":")[0] for line in unavailable] == [
        "flashinfer-nhd", "flashinfer-hnd", "flash-attn2", "flash-attn3", "xformers",
        "vllm-cuda-flash-attn"]
    verdicts = lines[lines.index(next(x for x in lines if x.startswith("Verdicts"))):]
    torch_gather = next(x for x in verdicts if x.startswith(" torch-gather "))
    assert torch_gather.split() == ["torch-gather", "36", "-", "4"]  # 36 pass, fastest on 4


@pytest.mark.parametrize("width", [40, 60, 100])
def test_a_fitted_table_cuts_only_the_columns_it_may_shrink(width) -> None:
    rows = [("x" * 40, "y" * 40, "+205.2%*")]
    out = io.StringIO()
    Console(file=out, width=width, force_terminal=False).print(
        summary.fitted_table("", ("name", "case", "change"), rows, width, shrink=(0, 1)))
    lines = out.getvalue().splitlines()
    assert max(map(len, lines)) <= width
    (row,) = [line for line in lines if "x" in line]
    assert row.split()[-1] == "+205.2%*", lines
    assert ("x" * 40 in row) is (width == 100), lines


def test_each_failure_has_its_replay_command_whole(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(REPLAY_DIR_VARIABLE, str(tmp_path / "replay"))
    command = "pagedbench replay build/replay/" + "x" * 90 + ".json --impl bad"
    records = [result("good", "c1", ms=1.0), result("good", "c2", ms=2.0),
               result("bad", "c1", "fail", reason=f"max error 9 ulps; replay: {command}"),
               result("bad", "c2", "crash", reason="worker died (SIGSEGV)"),
               result("gone", "c1", "unavailable", reason="not installed"),
               result("gone", "c2", "unavailable", reason="not installed")]
    lines = _printed(records, 80)
    assert command in [line.strip() for line in lines]  # longer than 80, never cut
    assert f"fail bad {records[2].case_id}: max error 9 ulps" in lines
    (crash,) = (i for i, line in enumerate(lines) if line.startswith("crash bad c2-"))
    (written,) = (tmp_path / "replay").glob("c2-*.json")
    assert lines[crash + 1].strip() == f"pagedbench replay {written} --impl bad"
    assert lines.count("gone: unavailable: not installed") == 1
    assert max(len(line) for line in lines if "pagedbench replay" not in line) <= 80
    assert len(_printed(records, 80, max_failures=1)) == len(lines) - 1  # one more: counted


@pytest.mark.parametrize("environ, width", [({}, summary.DEFAULT_WIDTH),
                                            ({"COLUMNS": "120"}, 120)])
def test_without_a_terminal_the_width_is_columns_or_100(environ, width, monkeypatch) -> None:
    monkeypatch.delenv("COLUMNS", raising=False)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    assert summary.terminal(file=io.StringIO()).width == width


def test_two_devices_are_ranked_apart() -> None:
    h100, h200 = ({**ENV, "device": name} for name in ("NVIDIA H100", "NVIDIA H200"))
    records = [result("a", "c1", ms=1.0, env=h100), result("b", "c1", ms=2.0, env=h100),
               result("a", "c1", ms=4.0, env=h200), result("b", "c1", ms=3.0, env=h200)]
    lines = _printed(records, 100)
    rows = [re.split(r"\s{2,}", line.strip()) for line in lines if " fp32 bs4 " in line]
    assert [(row[0], row[2]) for row in rows] == [("c1 (NVIDIA H100)", "a"),
                                                  ("c1 (NVIDIA H200)", "b")]
