"""``pagedbench tune``: the combination of simulated decode batches and measured kernel
times against a case worked out by hand, the refusal to extrapolate, the refusal to mix
devices, and the command line."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from pagedbench.harness.capacity import prediction, tune
from pagedbench.harness.cases.presets import MODEL_PRESETS
from pagedbench.harness.cli import main
from pagedbench.harness.results.store import ResultsFile
from pagedbench.reference import PagedValueError
from pagedbench.reference.workload import Request

from ..conftest import ENV, result

# The hand case. Three requests, each prompt 3 and output 2 (final length 5), all at
# step 0, on a KV budget of 16 token slots; block sizes 4 (4 blocks) and 8 (2 blocks).
# A request admitted at step a decodes at steps a+1 and a+2, holding 4 then 5 tokens.
#
# block_size 4 (a 3-token prompt takes 1 block, the 5th token a 2nd):
#   step 0: admit R0, R1, R2 (3 blocks, 1 free)
#   step 1: decode R0, R1, R2 to 4 tokens (no new block)          -> batch (3, 12)
#   step 2: R0 to 5 takes the free block; R1 finds none: the newest, R2, is preempted
#           (its block freed, 1 generated token to recompute); R1 to 5  -> batch (2, 10)
#           no admission in a step that preempted; R0 and R1 finish
#   step 3: nothing decodes; R2 readmitted with 3 + 1 = 4 tokens
#   step 4: R2 to 5                                                 -> batch (1, 5)
#   5 steps, running 3, 3, 2, 1, 1: mean concurrency 10 / 5 = 2.0, peak 3.
# block_size 8 (a request needs 1 block of the 2):
#   step 0: admit R0, R1; R2 waits          steps 1, 2: batches (2, 8), (2, 10)
#   step 3: R2 admitted                     steps 4, 5: batches (1, 4), (1, 5)
#   6 steps, running 2, 2, 2, 1, 1, 1: mean concurrency 9 / 6 = 1.5, peak 2.
HAND_TRACE = [Request(prompt_len=3, output_len=2) for _ in range(3)]
HAND_BUDGET = 16
STEPS = {4: [(3, 12), (2, 10), (1, 5)], 8: [(2, 8), (2, 10), (1, 4), (1, 5)]}
# Fixed kernel times, ms per call, planes in (sequences B, KV tokens T), so that any
# triangulation of the measured corners interpolates them exactly:
#   block_size 4: t = 0.4 B + 0.2 T      block_size 8: t = 0.3 B + 0.15 T
# p10 = 0.9 t and p90 = 1.1 t. Measured at the corners of B in [1, 3], T in [4, 16].
PLANES = {4: (0.4, 0.2), 8: (0.3, 0.15)}
CORNERS = [(1, 4), (3, 4), (1, 16), (3, 16)]
LAYERS = 2
# Per step times, ms: bs 4: (3,12) 1.2 + 2.4 = 3.6; (2,10) 0.8 + 2.0 = 2.8; (1,5) 0.4 + 1.0
# = 1.4; sum 7.8 ms, x 2 layers = 15.6 ms for 6 decoded tokens: 6 / 0.0156 s = 384.615
# tokens/s (p90 times: 6 / (0.0156 * 1.1) = 349.65; p10 times: 6 / (0.0156 * 0.9) = 427.35).
# bs 8: (2,8) 0.6 + 1.2 = 1.8; (2,10) 0.6 + 1.5 = 2.1; (1,4) 0.3 + 0.6 = 0.9; (1,5) 0.3 +
# 0.75 = 1.05; sum 5.85 ms, x 2 = 11.7 ms: 6 / 0.0117 = 512.82 tokens/s (p90: 466.20,
# p10: 569.80). bs 8 wins by 15.6 / 11.7 - 1 = 33.33 %, and holds: 466.20 >= 427.35.
HAND = {4: {"ms": 15.6, "conc": 2.0, "peak": 3, "steps": 5},
        8: {"ms": 11.7, "conc": 1.5, "peak": 2, "steps": 6}}


def _points(block_size: int) -> list[prediction.KernelPoint]:
    b_coef, t_coef = PLANES[block_size]
    return [prediction.KernelPoint(block_size=block_size, sequences=b, kv_tokens=t,
                                   median_ms=b_coef * b + t_coef * t,
                                   p10_ms=0.9 * (b_coef * b + t_coef * t),
                                   p90_ms=1.1 * (b_coef * b + t_coef * t), case_id=f"p{b}-{t}")
            for b, t in CORNERS]


def _hand_rows(other_ms: float = 0.0) -> list[prediction.TuneRow]:
    rows = []
    for bs in (4, 8):
        sim, steps = prediction.simulate_decode(HAND_TRACE, bs, HAND_BUDGET, max_context=5)
        model = prediction.KernelModel(bs, _points(bs))
        rows.append(prediction.predict("hand", sim, steps, model, LAYERS, other_ms))
    return rows


def test_tune_simulated_batches_match_hand_trace() -> None:
    for bs, expected in STEPS.items():
        sim, steps = prediction.simulate_decode(HAND_TRACE, bs, HAND_BUDGET, max_context=5)
        assert [(s.sequences, s.kv_tokens) for s in steps] == expected
        assert (sim.mean_concurrency, sim.peak_concurrency, sim.steps) == (
            HAND[bs]["conc"], HAND[bs]["peak"], HAND[bs]["steps"])


def test_tune_combines_kernel_times_and_capacity_by_hand() -> None:
    rows = _hand_rows()
    for row in rows:
        hand = HAND[row.block_size]
        assert row.decode_tokens == 6
        assert row.throughput_tok_s == pytest.approx(6 / (hand["ms"] / 1000), rel=1e-9)
        assert row.throughput_low_tok_s == pytest.approx(6 / (1.1 * hand["ms"] / 1000), rel=1e-9)
        assert row.throughput_high_tok_s == pytest.approx(6 / (0.9 * hand["ms"] / 1000), rel=1e-9)
        assert row.refused is None
    assert [round(r.throughput_tok_s, 2) for r in rows] == [384.62, 512.82]
    best = prediction.recommend(rows, "cpu")
    assert (best.block_size, best.runner_up_block_size) == (8, 4)
    assert best.margin_pct == pytest.approx(100 * (15.6 / 11.7 - 1), rel=1e-9)  # 33.33 %
    assert best.holds is True
    assert "CPU serving" in best.text


def test_tune_other_step_time_favours_concurrency_by_hand() -> None:
    # 10 ms per decode step for the rest of the model: bs 4: 15.6 + 3 x 10 = 45.6 ms ->
    # 6 / 0.0456 = 131.58 tokens/s; bs 8: 11.7 + 4 x 10 = 51.7 ms -> 116.05 tokens/s.
    # p10 times: bs 4 6 / (14.04 + 30) ms = 136.24; p90 times: bs 4 6 / (17.16 + 30) =
    # 127.23, bs 8 6 / (12.87 + 40) = 113.49, p10 bs 8 6 / (10.53 + 40) = 118.74.
    rows = _hand_rows(other_ms=10.0)
    assert [round(r.throughput_tok_s, 2) for r in rows] == [131.58, 116.05]
    assert [round(r.throughput_high_tok_s, 2) for r in rows] == [136.24, 118.74]
    best = prediction.recommend(rows, "cpu")
    assert (best.block_size, best.holds) == (4, True)  # 127.23 >= 118.74
    assert best.margin_pct == pytest.approx(100 * (51.7 / 45.6 - 1), rel=1e-9)


def test_tune_refuses_batches_outside_measured_points() -> None:
    model = prediction.KernelModel(4, _points(4))
    inside = model.times_ms(np.array([2, 1, 3]), np.array([10, 4, 16]))
    assert inside[:, 0] == pytest.approx([0.8 + 2.0, 0.4 + 0.8, 1.2 + 3.2], rel=1e-9)
    for outside in ((4, 12), (2, 17), (1, 3), (0, 8)):
        with pytest.raises(prediction.OutOfMeasuredRange, match="outside the measured points"):
            model.times_ms(np.array([outside[0]]), np.array([outside[1]]))
    # A row with one step past the measured batch sizes is refused, not extrapolated.
    sim, steps = prediction.simulate_decode(HAND_TRACE, 4, HAND_BUDGET, max_context=5)
    up_to_two = [p.model_copy(update={"sequences": min(p.sequences, 2)}) for p in _points(4)]
    row = prediction.predict("hand", sim, steps, prediction.KernelModel(4, up_to_two), LAYERS, 0.0)
    assert row.throughput_tok_s is None and "3 sequences, 12 KV tokens" in row.refused
    assert prediction.recommend([row], "cpu").block_size is None


def test_tune_refuses_points_spanning_no_area() -> None:
    line = [p for p in _points(4) if p.sequences == 1]  # one batch size: a line
    with pytest.raises(PagedValueError, match="span no area"):
        prediction.KernelModel(4, line)


def test_tune_benched_batches_cover_every_simulated_step() -> None:
    steps = {}
    for name in ("short-instructions", "parallel-sampling"):
        trace = tune.WORKLOADS[name].trace(30, 0)
        max_context = tune.WORKLOADS[name].max_context
        steps[name] = prediction.simulate_decode(trace, 16, 4096, max_context)[1]
    batches = tune.bench_batches(steps)
    points = [prediction.KernelPoint(block_size=16, sequences=b, kv_tokens=t, median_ms=1.0 + t,
                                     p10_ms=1.0 + t, p90_ms=1.0 + t, case_id=str(i))
              for i, (b, t) in enumerate(batches)]
    every = [s for ss in steps.values() for s in ss]
    times = prediction.KernelModel(16, points).times_ms(np.array([s.sequences for s in every]),
                                                        np.array([s.kv_tokens for s in every]))
    assert times[:, 0] == pytest.approx([1.0 + s.kv_tokens for s in every], rel=1e-9)
    assert len(batches) <= 6  # five corners and the median step
    assert all(t >= b for b, t in batches)


# The command line on the hand case: records at llama3.1-8b's heads (128 KiB of K/V per
# token in bf16), so a KV budget of 16 tokens is 16 * 128 KiB = 2 MiB = 1/512 GiB.
PRESET = MODEL_PRESETS["llama3.1-8b"]


def _records(env: dict | None = None, block_sizes=(4, 8)) -> list:
    out = []
    for bs in block_sizes:
        for point in _points(bs):
            case = tune.batch_case(PRESET, point.sequences, point.kv_tokens, bs, "bfloat16")
            record = result("vllm-cpu", case, "pass", point.median_ms, env=env)
            stats = record.time_ms.model_copy(update={"p10": point.p10_ms, "p90": point.p90_ms})
            out.append(record.model_copy(update={"time_ms": stats}))
    return out


def _write(folder: Path, records: list) -> Path:
    store = ResultsFile(folder / "r.jsonl")
    for record in records:
        store.append(record)
    return folder


def _tune(tmp_path: Path, results: Path, *extra: str) -> int:
    trace = tmp_path / "three.csv"
    trace.write_text("prompt_len,output_len\n3,2\n3,2\n3,2\n")
    # --num-layers comes from the preset (32): step times scale by 32 / LAYERS = 16.
    return main(["tune", "--preset", "llama3.1-8b", "--impl", "vllm-cpu", "--trace", str(trace),
                 "--max-context", "5", "--kv-budget-gib", str(1 / 512), "--results-dir",
                 str(results), "--output-dir", str(tmp_path / "out"),
                 "--cache-dir", str(tmp_path / "cache"), *extra])


def test_tune_cli_prints_table_and_writes_plot_and_json(tmp_path: Path, capsys) -> None:
    results = _write(tmp_path / "res", _records())
    assert _tune(tmp_path, results) == 0
    out = capsys.readouterr().out
    assert "| three.csv" in out and "block_size 8 for CPU serving" in out
    assert "33.3% over block_size 4" in out
    report = json.loads((tmp_path / "out" / "tune.json").read_text())
    prediction.TuneReport.model_validate_json((tmp_path / "out" / "tune.json").read_text())
    by_bs = {r["block_size"]: r for r in report["rows"]}
    # 32 layers: bs 4 7.8 ms x 32 = 249.6 ms for 6 tokens = 24.04 tokens/s; bs 8 5.85 x 32
    # = 187.2 ms: 32.05 tokens/s.
    assert by_bs[4]["throughput_tok_s"] == pytest.approx(6 / 0.2496, rel=1e-9)
    assert by_bs[8]["throughput_tok_s"] == pytest.approx(6 / 0.1872, rel=1e-9)
    assert report["serving"] == "cpu" and report["recommendations"][0]["block_size"] == 8
    png = (tmp_path / "out" / "tune.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000


def test_tune_cli_never_mixes_devices(tmp_path: Path, capsys) -> None:
    cpu = _write(tmp_path / "cpu", _records())
    assert _tune(tmp_path, cpu, "--device", "cuda") == 2
    assert "never comes from CPU timings" in capsys.readouterr().err
    gpu_env = {**ENV, "device": "NVIDIA H200", "device_type": "cuda"}
    mixed = _write(tmp_path / "mixed", _records(block_sizes=(4,)) + _records(gpu_env, (8,)))
    assert _tune(tmp_path, mixed) == 2
    assert "mixes results of several devices" in capsys.readouterr().err
    assert not (tmp_path / "out" / "tune.json").exists()


def test_tune_cli_refuses_results_outside_the_trace(tmp_path: Path, capsys) -> None:
    # Points measured only up to 2 sequences: the bs 4 step (3, 12) and bs 8's none
    # (bs 8 reaches 2 sequences at most) -> bs 4 refused, bs 8 recommended alone.
    records = [r for r in _records() if r.paged_case().batch_size == 1 or
               r.paged_case().block_size == 8]
    for r in _records(block_sizes=(4,)):
        if r.paged_case().batch_size == 3:
            case = tune.batch_case(PRESET, 2, sum(r.paged_case().kv_lens), 4, "bfloat16")
            records.append(r.model_copy(update={"case": case.to_dict(), "case_id": case.case_id}))
    assert _tune(tmp_path, _write(tmp_path / "res", records)) == 0
    out = capsys.readouterr().out
    assert "refused" in out and "3 sequences, 12 KV tokens" in out
    assert "(the only block size predicted)" in out


def test_tune_weighs_prefix_reuse_against_the_radix_tree(tmp_path: Path, capsys) -> None:
    """A two-turn conversation (turn 2's 9-token prompt holds turn 1's 7 tokens): the radix
    tree reuses all 7, block_size 4 one block (4), block_size 8 none; with a prefill
    cost per token the blocks' recomputed tokens count against their throughput."""
    trace = tmp_path / "chat.csv"
    trace.write_text("prompt_len,output_len,parent\n4,3,\n9,2,0\n")
    results = _write(tmp_path / "res", _records())
    argv = ["tune", "--preset", "llama3.1-8b", "--impl", "vllm-cpu", "--trace", str(trace),
            "--max-context", "16", "--kv-budget-gib", str(1 / 512), "--results-dir",
            str(results), "--output-dir", str(tmp_path / "out"), "--cache-dir",
            str(tmp_path / "cache"), "--prefill-ms-per-token", "10"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    report = json.loads((tmp_path / "out" / "tune.json").read_text())
    rows = {r["block_size"]: r for r in report["rows"]}
    assert (rows[4]["prefix_hit_tokens"], rows[4]["prefill_tokens"]) == (4, 4 + 9 - 4)
    assert (rows[8]["prefix_hit_tokens"], rows[8]["prefill_tokens"]) == (0, 4 + 9)
    [reuse] = report["prefix_reuse"]
    chosen = report["recommendations"][0]["block_size"]
    assert reuse["block_size"] == chosen and reuse["tree_prefix_hit_tokens"] == 7
    assert reuse["tree_prefill_tokens"] == 4 + 9 - 7
    assert reuse["prefill_saved_tokens"] == rows[chosen]["prefill_tokens"] - (4 + 9 - 7)
    assert f"the radix tree (page 1) beats block_size {chosen}" in out
    # Without the prefill cost: the time per decoded token drops by exactly the prefill
    # tokens' 10 ms each spread over the 5 decoded tokens.
    argv[argv.index("--output-dir") + 1] = str(tmp_path / "plain")
    assert main(argv[:-2]) == 0
    plain = {r["block_size"]: r for r in
             json.loads((tmp_path / "plain" / "tune.json").read_text())["rows"]}
    for bs, row in rows.items():
        assert row["decode_tokens"] == 5
        assert 1 / row["throughput_tok_s"] == pytest.approx(
            1 / plain[bs]["throughput_tok_s"] + row["prefill_tokens"] * 0.010 / 5, rel=1e-9)
