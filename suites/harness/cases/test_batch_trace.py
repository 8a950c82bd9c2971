"""Batches like production in ``pagedbench bench``: vLLM's production-mix batch specs, and
batch traces (``--trace FILE``, harness/cases/batch_trace.py) as ``pagedbench simulate
--emit-batches`` writes them: each step timed, and the trace's total."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from pagedbench.harness.cases.batch_trace import trace_workloads
from pagedbench.harness.cases.workloads import BENCH_SUITE, parse_batch_spec
from pagedbench.harness.cli import main
from pagedbench.harness.results.derived import trace_times
from pagedbench.harness.results.store import read_lines
from pagedbench.reference import PagedValueError

from ..conftest import result

#: The two mixes of vLLM's benchmarks/attention_benchmarks/configs/
#: standard_attention_production_mix.yaml, and what they hold.
PRODUCTION_MIX = {
    "q257_7q1s1057_3q4s2051_2q129s4093":
        ((257, 257),) + ((1, 1057),) * 7 + ((4, 2051),) * 3 + ((129, 4093),) * 2,
    "q769_3q1s6143_2q8s3073_q257s8191":
        ((769, 769),) + ((1, 6143),) * 3 + ((8, 3073),) * 2 + ((257, 8191),),
}
#: Two requests, all at step 0, that fit at once: 5 prompt tokens and 3 out, 9 and 1.
REQUESTS = [{"prompt_len": 5, "output_len": 3}, {"prompt_len": 9, "output_len": 1}]


@pytest.mark.parametrize("spec", PRODUCTION_MIX)
def test_production_mix_specs_parse_to_their_ragged_batches(spec, capsys) -> None:
    assert parse_batch_spec(spec) == PRODUCTION_MIX[spec]
    assert main(["bench", "--batch-spec", spec, "--layout", "llama3.1-70b-tp8", "--dry-run",
                 "--block-size", "32", "--dtype", "bfloat16", "--no-contiguous"]) == 0
    (point,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith("mixed")]
    assert point.startswith(f"mixed-llama3.1-70b-tp8-{spec}-bf16-d128-bs32-h8x1-b"
                            f"{len(PRODUCTION_MIX[spec])}-")


def _simulated(tmp_path) -> tuple:
    requests = tmp_path / "requests.jsonl"
    requests.write_text("".join(json.dumps(r) + "\n" for r in REQUESTS))
    batches = tmp_path / "day.jsonl"
    assert main(["simulate", "--trace", str(requests), "--max-context", "64",
                 "--kv-budget-blocks", "64", "--block-sizes", "16", "--preset",
                 "llama3.1-70b-tp8", "--output-dir", str(tmp_path / "sim"),
                 "--emit-batches", str(batches)]) == 0
    return batches, [json.loads(line) for line in batches.read_text().splitlines()]


def test_simulate_emits_the_batch_of_every_decode_step(tmp_path) -> None:
    """Both prompts enter at step 0; each step then decodes one token of each running
    request: 6 and 10 tokens, after which the second holds 9 + 1 and finishes; then 7,
    then 8 (5 + 3), with the preset's heads on every line."""
    _, lines = _simulated(tmp_path)
    shapes = {"num_q_heads": 8, "num_kv_heads": 1, "head_dim": 128}
    assert lines == [{"step": 0, "kv_lens": [6, 10], **shapes},
                     {"step": 1, "kv_lens": [7], **shapes},
                     {"step": 2, "kv_lens": [8], **shapes}]


def test_bench_times_each_step_of_a_simulated_trace_and_their_total(tmp_path, capsys) -> None:
    batches, _ = _simulated(tmp_path)
    capsys.readouterr()
    out_dir = tmp_path / "bench"
    code = main(["bench", "--trace", str(batches), "--impl", "torch-gather", "--baseline",
                 "torch-gather", "--block-size", "16", "--dtype", "float32", "--quick",
                 "--no-peaks", "--results-dir", str(out_dir)])
    out = capsys.readouterr().out
    assert code == 0, out
    (path,) = out_dir.glob("*.jsonl")
    records = {r.workload: r for r in read_lines([path]) if r.kind == "result"}
    assert sorted(records) == [f"trace-day-{k}" for k in range(3)]  # no contiguous points
    medians = [records[f"trace-day-{k}"].time_ms.median for k in range(3)]
    table = [line.split("|") for line in out.splitlines() if line.startswith("| ")]
    rows = {cells[1].strip(): cells[2].strip() for cells in table if len(cells) == 4}
    assert [float(rows[f"trace-day-{k}"]) for k in range(3)] == pytest.approx(medians,
                                                                             rel=1e-3)
    assert float(rows["total"]) == pytest.approx(sum(medians), rel=1e-3)
    assert "## Trace" in path.with_suffix(".md").read_text()


def test_a_step_not_timed_leaves_no_total() -> None:
    steps = [result("x", name, "pass", ms, suite=BENCH_SUITE, workload=name)
             for name, ms in (("s0", 1.0), ("s1", 2.0))]
    failed = result("y", "s0", "fail", suite=BENCH_SUITE, workload="s0")
    timed = result("y", "s1", "pass", 5.0, suite=BENCH_SUITE, workload="s1")
    table = trace_times([*steps, failed, timed], ["s0", "s1"]).set_index("step")
    assert table.loc["total", "x"] == pytest.approx(3.0) and np.isnan(table.loc["total", "y"])
    assert np.isnan(table.loc["s0", "y"]) and table.loc["s1", "y"] == 5.0


@pytest.mark.parametrize("line, problem", [
    ('{"kv_lens": [4, 0]}', "every kv_len must be >= 1"),
    ('{"kv_lens": [4], "q_lens": [5]}', "q_lens[0] = 5 is not in 1..4"),
    ('{"kv_lens": [4], "q_lens": [1, 1]}', "one per sequence"),
    ('{"kv_lens": [4], "num_q_heads": 8}', "come together"),
    ('{"kv_lens": [4], "heads": 8}', "heads: Extra inputs are not permitted"),
    ('{"kv_lens": "4"}', "kv_lens"),
    ('[4, 5]', "a list, not an object"),
    ('{"kv_lens": [4]', "Expecting"),
    ('{"step": 0, "kv_lens": [4]}', "step 0 again (first at line 1)"),
])
def test_a_bad_trace_line_is_refused_naming_file_and_line(tmp_path, line, problem,
                                                         capsys) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text('{"step": 0, "kv_lens": [3]}\n' + line + "\n")
    with pytest.raises(PagedValueError, match=f"{path}:2: .*{problem}".replace("[", r"\[")
                       .replace("]", r"\]").replace("(", r"\(").replace(")", r"\)")):
        trace_workloads(path, "gqa4")
    assert main(["bench", "--trace", str(path), "--layout", "gqa4", "--dry-run"]) == 2
    assert f"{path}:2" in capsys.readouterr().err


def test_steps_without_shapes_take_the_layouts_heads(tmp_path, capsys) -> None:
    path = tmp_path / "log.jsonl"
    path.write_text('{"kv_lens": [1057, 4093], "q_lens": [1, 129]}\n{"kv_lens": [1058]}\n')
    (first, second) = trace_workloads(path, "llama3.1-70b-tp8")
    assert (first.num_q_heads, first.num_kv_heads, first.head_dim) == (8, 1, 128)
    assert (first.name, first.mode, first.q_lens) == ("trace-log-0", "mixed", (1, 129))
    assert (second.name, second.mode) == ("trace-log-1", "decode")
    assert main(["bench", "--trace", str(path), "--dry-run"]) == 2
    assert "--layout" in capsys.readouterr().err
    assert math.isclose(first.context, 4093)
