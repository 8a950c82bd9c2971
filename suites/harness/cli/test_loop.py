"""``pagedbench loop``'s output: one line per tick (a step or a lifecycle event), then the
summary counting the ticks and the forward steps among them."""

from __future__ import annotations

import re

from pagedbench.harness import cli


def test_each_line_is_a_tick_and_the_summary_counts_them_and_the_steps(tmp_path,
                                                                      capsys) -> None:
    # Seed 1 swaps a sequence out and in by its 12th tick: two ticks that are no step.
    code = cli.main(["loop", "--impl", "torch-gather", "--steps", "12", "--seed", "1",
                     "--dtype", "float32", "--cache-dir", str(tmp_path / "build")])
    out = capsys.readouterr().out
    assert code == 0, out
    lines = [line.split() for line in out.splitlines()]
    ticks = [words for words in lines if words and words[0] == "tick"]
    assert [int(words[1]) for words in ticks] == list(range(len(ticks))), out
    assert all(words[2] == "pass" for words in ticks), out
    steps = sum(":" in words[3] for words in ticks)  # a step prints its rows as "s:n"
    assert steps == 12 < len(ticks), out
    summary = re.search(r"torch-gather: (\d+) ticks \((\d+) pass\), (\d+) steps", out)
    assert summary and [int(n) for n in summary.groups()] == [len(ticks), len(ticks), 12], out
    assert not any(words and words[0] == "step" for words in lines), out
