"""The benchmark sweep: workloads (grid, vLLM batch specs, presets), the same batch at
every block size, filters, derived figures, result keys, and ``pagedbench bench`` end to
end with a broken implementation (checked first: it gets no speed)."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

from pagedbench.harness.cases.workloads import (BENCH_SUITE, CONTIGUOUS_TAG, format_batch_spec,
                                                grid_workload, parse_batch_spec, preset_workload,
                                                spec_workload)
from pagedbench.harness.results import report
from pagedbench.harness.results.derived import bench_frame, fast_p, group_scores
from pagedbench.harness.results.record import environment_key, result_key
from pagedbench.harness.results.store import read_lines
from pagedbench.harness.run.bench import CPU_SWEEP, QUICK_SWEEP, Sweep
from pagedbench.reference import PagedValueError, materialize

from ..conftest import BROKEN, ENV, register, result


def test_batch_specs_parse_as_vllm_writes_them() -> None:
    assert parse_batch_spec("8q1s1k") == ((1, 1024),) * 8
    assert parse_batch_spec("2q2k_32q1s1k") == ((2048, 2048),) * 2 + ((1, 1024),) * 32
    assert parse_batch_spec("q5s7") == ((5, 7),)
    for spec in ("8q1s1k", "2q2k_32q1s1k", "q5s7_3q1s7_q100"):
        assert format_batch_spec(parse_batch_spec(spec)) == spec
    workload = spec_workload("2q2k_32q1s1k", "gqa8")
    assert (workload.mode, workload.batch_size, workload.num_kv_heads) == ("mixed", 34, 4)
    assert workload.name == "mixed-gqa8-2q2k_32q1s1k"


@pytest.mark.parametrize("spec", ["", "8x1", "q0", "0q1", "q2s1", "8q1s1k_", "q1k1"])
def test_a_bad_batch_spec_is_refused_naming_it(spec) -> None:
    with pytest.raises(PagedValueError, match="batch_spec"):
        parse_batch_spec(spec)


@pytest.mark.parametrize("spec", [
    "999999999999q1s1k", "30000000q1s1k", "16385q1", "8192q1_8193q1", "q1025k",
    "q1s1025k", "16q1s1024k_q1", "q1s" + "9" * 5000, "9" * 5000 + "q1"])
def test_a_batch_no_gpu_could_hold_is_refused_before_it_is_built(spec) -> None:
    """Bounds are checked per segment, before a sequence list is built (peak allocation far
    below one of the refused batches' lists)."""
    import tracemalloc

    tracemalloc.start()
    try:
        with pytest.raises(PagedValueError, match=r"batch_spec .* is past the bounds of one "
                           r"batch \(at most 16384 sequences, each q_len and kv_len at most "
                           r"1048576 \(1024k\), at most 16777216 KV tokens in all"):
            parse_batch_spec(spec)
        assert tracemalloc.get_traced_memory()[1] < 2**20
    finally:
        tracemalloc.stop()


def test_the_largest_batches_inside_the_bounds_are_accepted() -> None:
    assert len(parse_batch_spec("16384q1s1k")) == 16384
    assert parse_batch_spec("q1s1024k_15q1s1024k") == ((1, 2**20),) * 16
    assert grid_workload("decode", "mqa", 16384, 1024).batch_size == 16384
    with pytest.raises(PagedValueError, match="batch_size 16384 x context 2048 is past"):
        grid_workload("decode", "mqa", 16384, 2048)
    with pytest.raises(PagedValueError, match=r"contexts must be ints <= 1048576"):
        CPU_SWEEP.with_(contexts=(2**20 + 1,))


@pytest.mark.parametrize("argv, option", [
    (["--batch-spec", "999999999999q1s1k"], "argument --batch-spec: batch_spec"),
    (["--batch-spec", "30000000q1s1k"], "argument --batch-spec: batch_spec"),
    (["--batch-size", "30000000"], "error: --batch-size: batch_sizes must be ints <= 16384"),
    (["--context", "2000000"], "error: --context: contexts must be ints <= 1048576"),
])
def test_bench_refuses_a_giant_batch_with_exit_2(argv, option, capsys) -> None:
    from pagedbench.harness.cli import main

    try:
        code = main(["bench", *argv, "--dry-run"])
    except SystemExit as exc:  # argparse's own refusal
        code = exc.code
    assert code == 2
    err = capsys.readouterr().err
    assert option in err and "Traceback" not in err


@pytest.mark.parametrize("dry_run", [True, False], ids=["dry-run", "run"])
@pytest.mark.parametrize("argv, named, listed", [
    (["--grid", "none"], "(--grid none)", 0),
    # the CPU sweep's three block sizes and the contiguous point, each above max_flops
    (["--mode", "decode", "--batch-size", "4", "--context", "1000000", "--grid", "axes",
      "--workload", "decode-gqa4*"],
     "--workload 'decode-gqa4*'; 4 left out, the first decode-gqa4-4q1s1000000-", 4),
    (["--preset", "llama3.1-70b-tp8", "--workload", "zzz*"],
     "(grid none; --preset llama3.1-70b-tp8; --workload 'zzz*')", 0),
    # what the user did not type is named without dashes: the sweep's defaults
    (["--workload", "zzz*"], "(grid axes; presets llama3.1-70b-tp8; --workload 'zzz*')", 0),
], ids=["no-grid-no-preset", "all-above-max-flops", "no-workload-matches",
        "defaults-named-as-such"])
def test_bench_with_no_point_exits_2_dry_run_or_not(argv, named, listed, dry_run, capsys,
                                                    tmp_path) -> None:
    """A selection that keeps no point is refused before anything runs; a dry run
    answers as the run would, after listing what was left out and why."""
    from pagedbench.harness.cli import main

    code = main(["bench", *argv, *(["--dry-run"] if dry_run else []), "--results-dir",
                 str(tmp_path / "results")])
    captured = capsys.readouterr()
    assert code == 2, captured.err
    assert "the options leave no point to time" in captured.err and named in captured.err, \
        captured.err
    left = [line for line in captured.out.splitlines() if line.startswith("left out: ")]
    assert len(left) == (listed if dry_run else 0), captured.out


@pytest.mark.parametrize("argv, said, dry_run_code", [
    (["--balance-from", "absent.jsonl"], "--balance-from balances the parts of --shard", 2),
    (["--balance-from", "absent.jsonl", "--shard", "1/2"],
     "--balance-from absent.jsonl: no such file or folder", 0),
    (["--peaks", "absent.json"], "--peaks absent.json: no such file", 0),
], ids=["balance-from-without-shard", "balance-from-absent", "peaks-absent"])
def test_input_options_are_refused_naming_them_and_a_dry_run_reads_no_file(
        argv, said, dry_run_code, capsys, tmp_path, monkeypatch) -> None:
    """--balance-from without --shard is refused by a dry run too (it exited 0); a file
    that is not there is refused by the run, naming its option, while a dry run plans
    without reading it (a command's input may be written later: the GPU lane's peaks)."""
    from pagedbench.harness.cli import main

    monkeypatch.chdir(tmp_path)
    for dry_run, code in ((True, dry_run_code), (False, 2)):
        assert main(["bench", "--quick", *argv, *(["--dry-run"] if dry_run else []),
                     "--results-dir", str(tmp_path / "results")]) == code, dry_run
        err = capsys.readouterr().err
        assert (said in err) is (code == 2), err


@pytest.mark.parametrize("workload", [
    grid_workload("mixed", "gqa4", 5, 300),
    preset_workload("llama3.1-70b-tp8", 6, 200),
], ids=lambda w: w.name)
def test_every_block_size_sees_the_same_batch(workload) -> None:
    sweep = Sweep(modes=("decode",), layouts=("gqa4",), batch_sizes=(1,), contexts=(1,),
                  block_sizes=(16, 32, 64), dtypes=("float32",), grid="none")
    cases = [workload.case(bs, "float32") for bs in sweep.block_sizes]
    cases.append(workload.case(workload.contiguous_block_size(), "float32", CONTIGUOUS_TAG))
    assert len({(c.kv_lens, c.q_lens_or_decode, c.seed) for c in cases}) == 1
    assert cases[-1].max_blocks_per_seq == 1
    # The logical K and V of every sequence, gathered through the block table by hand,
    # are the same tensors at every block size.
    logical = []
    for case in cases:
        inputs = materialize(case, "cpu")
        seqs = []
        for i, kv_len in enumerate(case.kv_lens):
            pos = torch.arange(kv_len)
            blocks = inputs.block_tables[i, pos // case.block_size].long()
            seqs.append(inputs.kv_cache[blocks, :, pos % case.block_size])  # [kv_len, 2, hkv, d]
        logical.append(seqs)
    for other in logical[1:]:
        assert all(torch.equal(a, b) for a, b in zip(logical[0], other))


def test_the_axes_grid_varies_one_axis_at_a_time_and_filters_apply() -> None:
    sweep = Sweep(modes=("decode", "prefill"), layouts=("gqa4", "mqa"), batch_sizes=(2, 3),
                  contexts=(64,), block_sizes=(16,), dtypes=("float32",), grid="axes")
    # Centre decode-gqa4-b2-kv64, then prefill, mqa, b3: four workloads.
    assert [w.name for w in sweep.workloads()] == [
        "decode-gqa4-2q1s64", "prefill-gqa4-2q64", "decode-mqa-2q1s64", "decode-gqa4-3q1s64"]
    assert len(sweep.with_(grid="full").workloads()) == 2 * 2 * 2
    only = sweep.with_(workload_patterns=("*-mqa-*",), batch_specs=("q3s9",))
    assert [w.name for w in only.workloads()] == ["decode-mqa-2q1s64", "chunked-mqa-q3s9"]
    cases = sweep.cases()  # every workload at bs16 and at its contiguous block size 256
    assert len(cases) == 8 and sum(c.tag == CONTIGUOUS_TAG for c in cases) == 4
    with pytest.raises(PagedValueError, match="layouts"):
        sweep.with_(layouts=("gqa3",))


def test_the_default_sweeps_cover_every_mode_and_layout() -> None:
    names = [w.name for w in CPU_SWEEP.workloads()]
    for part in ("decode-", "prefill-", "chunked-", "mixed-", "-mha-", "-gqa4-", "-gqa8-",
                 "-mqa-", "-llama3.1-70b-tp8-"):
        assert any(part in n for n in names), part
    assert not CPU_SWEEP.left_out() and len(QUICK_SWEEP.cases()) == 6



@pytest.mark.parametrize("changes", [
    {},  # the CPU default: the axes grid and a preset
    {"grid": "full", "presets": (), "modes": ("decode",), "layouts": ("llama3.1-70b-tp8",),
     "batch_sizes": (2,), "contexts": (64, 256), "block_sizes": (16,)},  # the lane's rehearsal
    {"grid": "none", "batch_specs": ("2q1s64", "q3s9"), "presets": (), "contiguous": False},
    {"workload_patterns": ("*-mqa-*",), "dtypes": ("float16", "bfloat16")},
])
def test_a_sweeps_arguments_give_its_points_back(changes) -> None:
    """``Sweep.arguments`` is the inverse of ``bench_sweep``: bench parses them back into a
    sweep with the very same points (in order), whatever its defaults would add."""
    from pagedbench.harness.cli import _parser
    from pagedbench.harness.cli.bench import bench_sweep

    sweep = CPU_SWEEP.with_(**changes)
    args = _parser().parse_args(["bench", "--device", "cpu", *sweep.arguments()])
    again = bench_sweep(args)
    assert [c.case_id for c in again.cases()] == [c.case_id for c in sweep.cases()]
    assert again.cases() and again.left_out() == sweep.left_out()

def _bench(impl, case, status="pass", ms=None, **changes):
    return result(impl, case, status, ms, suite=BENCH_SUITE, workload=case.name, **changes)


def test_paging_overhead_speedup_and_scores_follow_their_definitions() -> None:
    w = grid_workload("decode", "gqa4", 2, 64)
    paged, contig = w.case(16, "float32"), w.case(256, "float32", CONTIGUOUS_TAG)
    w2 = grid_workload("decode", "mqa", 2, 64)
    records = [
        _bench("base", paged, ms=2.0), _bench("base", contig, ms=1.0),
        _bench("fast", paged, ms=0.5), _bench("fast", contig, ms=0.4),
        _bench("slow", paged, ms=4.0),  # no contiguous run: against the baseline's
        _bench("base", w2.case(16, "float32"), ms=1.0),
        _bench("fast", w2.case(16, "float32"), status="fail"),
        _bench("slow", w2.case(16, "float32"), ms=0.5),
    ]
    df = bench_frame(records, baseline="base").set_index(["impl", "case_id"])
    assert df.loc[("base", paged.case_id), "paging_overhead"] == pytest.approx(1.0)
    assert df.loc[("fast", paged.case_id), "paging_overhead"] == pytest.approx(0.25)
    assert df.loc[("slow", paged.case_id), "paging_overhead"] == pytest.approx(3.0)
    assert df.loc[("slow", paged.case_id), "overhead_vs"] == "base"
    assert df.loc[("fast", paged.case_id), "speedup"] == pytest.approx(4.0)
    assert math.isnan(df.loc[("fast", w2.case(16, "float32").case_id), "speedup"])
    scores = group_scores(df.reset_index()).set_index(["workload", "impl"])
    # fast: sqrt(4 * 2.5) on the gqa4 group; 0 on the mqa group it fails.
    assert scores.loc[(w.name, "fast"), "score"] == pytest.approx(math.sqrt(4.0 * 2.5))
    assert scores.loc[(w2.name, "fast"), "score"] == 0.0
    assert not scores.loc[(w2.name, "fast"), "correct"]
    table = fast_p(scores.reset_index(), (0.0, 1.0, 1.5)).set_index("impl")
    assert table.loc["fast"].tolist()[2:] == [0.5, 0.5, 0.5]
    assert table.loc["slow"].tolist()[2:] == [1.0, 0.5, 0.5]  # 0.5x on gqa4, 2x on mqa
    assert table.loc["base"].tolist()[2:] == [1.0, 0.0, 0.0]


def test_two_devices_never_merge_in_keys_or_reports() -> None:
    case = grid_workload("decode", "gqa4", 2, 64).case(16, "float32")
    epyc = _bench("k", case, ms=3.0)
    xeon = _bench("k", case, ms=1.0, env=ENV | {"device": "Intel Xeon"})
    newer = _bench("k", case, ms=2.0, env=ENV | {"torch": "9"})
    assert len({result_key(r) for r in (epyc, xeon, newer)}) == 3
    assert environment_key(xeon) == ("Intel Xeon", environment_key(xeon)[1])
    text = report.markdown([epyc, xeon, newer])
    assert text.count("## cpu0 (torch 2;") == 1 and text.count("## Intel Xeon") == 1
    assert text.count("## cpu0 (torch 9;") == 1
    for ms in ("3 ms", "1 ms", "2 ms"):  # in its device's section and in the table across
        assert text.count(f"pass {ms}") == 2
    columns = report.leaderboard(report.frame([epyc, xeon, newer])).columns
    assert list(columns) == ["k@cpu0#1", "k@Intel Xeon", "k@cpu0#3"]


def test_the_table_across_devices_holds_the_cases_every_device_ran() -> None:
    shared, epyc_only = (grid_workload("decode", "gqa4", 2, 64).case(bs, "float32")
                         for bs in (16, 32))
    xeon = ENV | {"device": "Intel Xeon"}
    records = [_bench("k", shared, ms=3.0), _bench("k", epyc_only, ms=4.0),
               _bench("k", shared, ms=1.0, env=xeon), _bench("j", shared, ms=2.0, env=xeon)]
    table = report.across_devices(report.frame(records))
    assert list(table.index) == [shared.case_id]
    assert list(table.columns) == ["k@cpu0", "k@Intel Xeon", "j@Intel Xeon"]
    assert table.loc[shared.case_id, "k@cpu0"].startswith("pass 3 ms")
    assert table.loc[shared.case_id, "k@Intel Xeon"].startswith("**pass 1 ms")  # fastest there
    text = report.markdown(records)
    across = text.split("## Across devices", 1)[1].split("\n## ", 1)[0]
    assert shared.case_id in across and epyc_only.case_id not in across
    assert report.across_devices(report.frame(records[:2])).empty  # one device


def test_bench_checks_every_point_first_and_times_only_passes(tmp_path) -> None:
    env = register(tmp_path / "site", {"reads-past": f"{BROKEN}:ReadsPastKvLen"})
    argv = [sys.executable, "-m", "pagedbench.harness.cli", "bench", "--quick", "--impl",
            "reads-past", "--baseline", "torch-gather", "--workload", "decode-*",
            "--no-peaks", "--threads", "1", "--results-dir", str(tmp_path / "out"),
            "--cache-dir", str(tmp_path / "cache")]
    dry = subprocess.run([*argv, "--dry-run"], env=env, capture_output=True, text=True,
                         timeout=120)
    assert dry.returncode == 0, dry.stderr
    assert dry.stdout.splitlines()[:3] == [
        "decode-gqa4-2q1s64-fp32-d128-bs16-h32x8-b2-kv64",
        "decode-gqa4-2q1s64-fp32-d128-bs32-h32x8-b2-kv64",
        "decode-gqa4-2q1s64-fp32-d128-bs256-h32x8-b2-kv64-contig"]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 1, done.stdout + done.stderr  # a conformance failure
    summary = done.stdout.strip().splitlines()[-1]
    assert "6 results (3 pass, 3 fail), 3 timed" in summary, summary
    (jsonl,) = (tmp_path / "out").glob("*.jsonl")
    records = [r for r in read_lines([jsonl]) if getattr(r, "kind", "") == "result"]
    assert {(r.impl, str(r.status)) for r in records} == {("torch-gather", "pass"),
                                                          ("reads-past", "fail")}
    for r in records:
        assert r.suite == BENCH_SUITE and r.workload == "decode-gqa4-2q1s64"
        if r.impl == "reads-past":
            assert r.time_ms is None and r.bandwidth_gbps is None
        else:
            t = r.time_ms
            assert t.method == "torch_timer" and len(t.samples) == t.n >= 1
            assert len(t.probe) == t.n and all(p > 0 for p in t.probe)  # one probe per sample
            assert t.p10 <= t.median <= t.p90 and r.bandwidth_gbps > 0
    md = jsonl.with_suffix(".md").read_text()
    assert "0 (fails)" in md  # reads-past scores 0 for the group it failed
    data = json.loads(jsonl.read_text().splitlines()[0])
    assert data["kind"] == "run" and data["config"]["suite"] == BENCH_SUITE
