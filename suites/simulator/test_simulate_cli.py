"""``pagedbench simulate`` through :func:`harness.capacity.simulate.run`: JSON schema, values, files
and exit codes."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pandas as pd
import pytest

from pagedbench.harness.capacity import simulate as cli
from pagedbench.harness.cli import main

REQUIRED_FIELDS = {
    "policy": str,
    "block_size": (int, type(None)),
    "waste_pct": float,
    "reservation_waste_pct": float,
    "fragmentation_pct": float,
    "peak_concurrency": int,
    "mean_concurrency": float,
}

# The two-request trace of test_simulator_hand_traces.py: A (5, 4) and B (10, 6), whose
# per-step sums are worked out there: 126 stored tokens over 7 steps with room for both.
TWO_CSV = "prompt_len,output_len\n5,4\n10,6\n"


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    code = cli.run(parser.parse_args(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def two_trace(tmp_path: Path) -> Path:
    path = tmp_path / "two.csv"
    path.write_text(TWO_CSV)
    return path


def test_simulate_json_schema_and_values(
    two_trace: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_dir = tmp_path / "out"
    code, out, _ = _run(
        ["--trace", str(two_trace), "--max-context", "32", "--kv-budget-blocks", "4",
         "--block-sizes", "4", "--output-dir", str(out_dir), "--json"],
        capsys,
    )
    assert code == 0
    records = json.loads(out)
    assert [(r["policy"], r["block_size"]) for r in records] == [
        ("Max", None), ("Pow2", None), ("Oracle", None), ("Paged", 4),
    ]
    for record in records:
        for name, kind in REQUIRED_FIELDS.items():
            assert isinstance(record[name], kind), (name, record[name])
    by_policy = {r["policy"]: r for r in records}
    # 4 blocks of 16 = 64 slots: both requests fit under every policy. Reserved slots
    # summed over the 7 steps: Max 384, Pow2 192, Oracle 157, Paged bs4 144; never-used
    # slots: 227, 35, 0, 18 (derivations in test_simulator_hand_traces.py).
    for name, reserved, never_used in (("Max", 384, 227), ("Pow2", 192, 35),
                                       ("Oracle", 157, 0), ("Paged", 144, 18)):
        record = by_policy[name]
        assert record["waste_pct"] == pytest.approx(100 * (reserved - 126) / reserved)
        assert record["fragmentation_pct"] == pytest.approx(100 * never_used / reserved)
        assert record["reservation_waste_pct"] == pytest.approx(
            100 * (reserved - 126 - never_used) / reserved
        )
        assert record["peak_concurrency"] == 2
        assert record["mean_concurrency"] == pytest.approx(12 / 7)
        assert record["concurrency_ratio"] == pytest.approx(1.0)
    png = (out_dir / cli.PLOT_NAME).read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    table = pd.read_csv(out_dir / cli.TABLE_NAME)
    assert list(table["policy"]) == ["Max", "Pow2", "Oracle", "Paged"]
    assert table["waste_pct"].tolist() == pytest.approx([r["waste_pct"] for r in records])


@pytest.mark.parametrize(
    ("dtype", "max_steps"),
    [
        # llama3.1-8b: 2 (K, V) x 32 layers x 8 kv heads x 128 dims x 2 bytes = 131072 B
        # per token; 4 MiB / 131072 = 32 tokens: one Max reservation of 32 at a time, so B
        # waits for A: 12 steps (test_budget_of_one_max_request_serialises_max_but_not_oracle).
        ("bfloat16", 12),
        # fp8 halves the bytes: 64 tokens hold both requests: 7 steps.
        ("fp8", 7),
    ],
)
def test_simulate_budget_from_gib(
    two_trace: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], dtype: str, max_steps: int
) -> None:
    code, out, _ = _run(
        ["--trace", str(two_trace), "--max-context", "32", "--kv-budget-gib", str(4 / 1024),
         "--preset", "llama3.1-8b", "--kv-cache-dtype", dtype, "--block-sizes", "16",
         "--output-dir", str(tmp_path), "--json"],
        capsys,
    )
    assert code == 0
    assert json.loads(out)[0]["steps"] == max_steps


def test_simulate_text_table_and_sharing_rows(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A generated trace with parallel samples adds the Paged+share rows.
    code, out, _ = _run(
        ["--num-requests", "30", "--max-context", "256", "--kv-budget-blocks", "64",
         "--parallel-samples", "2", "--block-sizes", "16,32", "--output-dir", str(tmp_path)],
        capsys,
    )
    assert code == 0
    lines = out.splitlines()
    assert lines[0].startswith("llama3.1-8b (128 KiB/token), KV budget 0.12 GiB = 1024 tokens")
    policies = [line.split()[0] for line in lines[2:-1]]
    assert policies == ["Max", "Pow2", "Oracle", "Paged", "Paged", "Paged+share", "Paged+share",
                        "Radix"]
    assert lines[-1] == f"wrote {tmp_path / cli.PLOT_NAME} and {tmp_path / cli.TABLE_NAME}"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--trace", "{bad}"], "missing required column(s) ['output_len']"),
        (["--trace", "{two}", "--parallel-samples", "2"],
         "--parallel-samples shape(s) the generated trace only"),
        (["--kv-budget-gib", "0"], "--kv-budget-gib must be a finite number > 0, got 0.0"),
        (["--kv-budget-blocks", "0"], "--kv-budget-blocks must be >= 1, got 0"),
        # 1 block of 16 = 16 slots cannot hold one 32-token Max reservation.
        (["--trace", "{two}", "--max-context", "32", "--kv-budget-blocks", "1"],
         "cannot run alone under policy Max with kv_budget_tokens=16"),
        (["--trace", "{two}", "--max-context", "8"], "exceeds max_context=8"),
        (["--num-requests", "0"], "num_requests must be >= 1, got 0"),
    ],
    ids=["bad-trace", "samples-with-file", "gib-zero", "blocks-zero", "budget-too-small",
         "over-max-context", "no-requests"],
)
def test_simulate_bad_input_exits_2(
    argv: list[str], message: str, two_trace: Path, tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    bad = tmp_path / "bad.csv"
    bad.write_text("prompt_len\n3\n")
    argv = [a.format(bad=bad, two=two_trace) for a in argv] + ["--output-dir", str(tmp_path)]
    code, out, err = _run(argv, capsys)
    assert code == 2
    assert out == ""
    assert err.startswith("pagedbench simulate: error: ")
    assert message in err


def test_simulate_block_sizes_must_be_positive_integers(
    capsys: pytest.CaptureFixture[str],
) -> None:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    for text in ("16,x", "0,16"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--block-sizes", text])
        assert "--block-sizes must" in capsys.readouterr().err


def test_pagedbench_main_routes_simulate(
    two_trace: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["simulate", "--trace", str(two_trace), "--max-context", "32",
                 "--kv-budget-blocks", "2", "--block-sizes", "4", "--output-dir", str(tmp_path),
                 "--json"])
    assert code == 0
    records = json.loads(capsys.readouterr().out)
    # 32 slots: Max serialises the two requests (12 steps), paged bs4 runs both (7 steps).
    assert [(r["policy"], r["steps"]) for r in records] == [
        ("Max", 12), ("Pow2", 7), ("Oracle", 7), ("Paged", 7),
    ]


def test_simulate_rejects_unusable_paths_and_budgets(tmp_path: Path, capsys) -> None:
    folder = tmp_path / "trace.csv"
    folder.mkdir()
    a_file = tmp_path / "out"
    a_file.write_text("")
    for argv, message in [
        (["--trace", str(folder)], "Is a directory"),
        (["--kv-budget-gib", "inf"], "--kv-budget-gib must be a finite number > 0"),
        (["--num-requests", "5", "--output-dir", str(a_file)], "is a file, not a folder"),
    ]:
        code, _, err = _run(argv, capsys)
        assert code == 2 and message in err, (argv, err)
