"""Request traces: reading CSV/JSONL files (and their errors), the generated distribution,
and the validation of requests and policies."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from pagedbench.harness.capacity.traces import generate_trace, read_trace
from pagedbench.reference.kv_policies import Policy
from pagedbench.reference.simulator import simulate
from pagedbench.reference.workload import Request, TraceError


def _write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_read_csv_with_optional_columns(tmp_path: Path) -> None:
    path = _write(
        tmp_path, "trace.csv",
        "prompt_len,output_len,arrival,prefix_id,prefix_len,n\n"
        "10,5,,,,\n"
        "20,3,4,sys,8,2\n"
        "7,1,2,sys,,\n",
    )
    assert read_trace(path, max_context=64) == [
        Request(prompt_len=10, output_len=5),
        Request(prompt_len=20, output_len=3, arrival=4, prefix_id="sys", prefix_len=8, n=2),
        # prefix_id without prefix_len: the whole prompt is the shared prefix.
        Request(prompt_len=7, output_len=1, arrival=2, prefix_id="sys", prefix_len=7),
    ]


def test_read_jsonl_skips_blank_lines(tmp_path: Path) -> None:
    path = _write(
        tmp_path, "trace.jsonl",
        '{"prompt_len": 3, "output_len": 4}\n'
        "\n"
        '{"prompt_len": 5, "output_len": 6, "prefix_id": 7, "n": null, "arrival": 1}\n',
    )
    trace = read_trace(path, max_context=16)
    assert trace == [
        Request(prompt_len=3, output_len=4),
        Request(prompt_len=5, output_len=6, arrival=1, prefix_id="7", prefix_len=5),
    ]


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        pytest.param("t.csv", "prompt_len,output_len,prompt_len\n10,5,5\n",
                     r"t\.csv:1: column\(s\) \['prompt_len'\] appear more than once",
                     id="repeated-column"),
        pytest.param("t.csv", "prompt_len,n\n3,1\n",
                     r"t\.csv:1: missing required column\(s\) \['output_len'\]",
                     id="missing-column"),
        pytest.param("t.jsonl", '{"prompt_len": 3}\n',
                     r"t\.jsonl:1: missing required column\(s\) \['output_len'\]",
                     id="missing-column-jsonl"),
        pytest.param("t.csv", "prompt_len,output_len,arival\n3,1,0\n",
                     r"unknown column\(s\) \['arival'\]; allowed columns are", id="unknown-column"),
        pytest.param("t.csv", "prompt_len,output_len\n3,1\n-2,4\n",
                     r"t\.csv:3: prompt_len must be an integer >= 1, got -2", id="negative-prompt"),
        pytest.param("t.jsonl", '{"prompt_len": 3, "output_len": 0}\n',
                     r"t\.jsonl:1: output_len must be an integer >= 1, got 0", id="zero-output"),
        pytest.param("t.csv", "prompt_len,output_len\n3,1\n40,30\n",
                     r"t\.csv:3: prompt_len \+ output_len = 40 \+ 30 = 70 exceeds max_context=64",
                     id="over-max-context"),
        pytest.param("t.csv", "prompt_len,output_len\n3.5,1\n",
                     r"t\.csv:2: column 'prompt_len' must be an integer, got '3\.5'",
                     id="not-integer"),
        pytest.param("t.jsonl", '{"prompt_len": 3.0, "output_len": 1}\n',
                     r"column 'prompt_len' must be an integer, got 3\.0", id="float-jsonl"),
        pytest.param("t.csv", "prompt_len,output_len\n,4\n",
                     r"t\.csv:2: column 'prompt_len' is empty; it is required", id="empty-cell"),
        pytest.param("t.csv", "prompt_len,output_len,prefix_id,prefix_len\n5,1,a,6\n",
                     r"prefix_len must be an integer in \[1, prompt_len=5\], got 6",
                     id="prefix-longer-than-prompt"),
        pytest.param("t.csv", "prompt_len,output_len,prefix_len\n5,1,3\n",
                     r"prefix_len must be empty or 0 when prefix_id is empty",
                     id="prefix-len-alone"),
        pytest.param("t.csv", "prompt_len,output_len,n\n5,1,0\n",
                     r"n must be an integer >= 1, got 0", id="zero-samples"),
        pytest.param("t.csv", "prompt_len,output_len,arrival\n5,1,-1\n",
                     r"arrival must be an integer step >= 0, got -1", id="negative-arrival"),
        pytest.param("t.csv", "prompt_len,output_len\n5,1,9\n",
                     r"t\.csv:2: more cells than header columns", id="extra-cell"),
        pytest.param("t.csv", "", r"the file is empty \(no header row\)", id="empty-csv"),
        pytest.param("t.csv", "prompt_len,output_len\n", "the file holds no requests",
                     id="header-only"),
        pytest.param("t.jsonl", '{"prompt_len": 3, "output_len": 1\n',
                     r"t\.jsonl:1: not valid JSON", id="bad-json"),
        pytest.param("t.jsonl", "[3, 1]\n", "each line must be a JSON object", id="json-array"),
        pytest.param("t.txt", "prompt_len,output_len\n3,1\n",
                     r"must end in \.csv, \.jsonl or \.ndjson, got '\.txt'", id="suffix"),
    ],
)
def test_read_trace_rejects_bad_files(tmp_path: Path, name: str, text: str, message: str) -> None:
    with pytest.raises(TraceError, match=message):
        read_trace(_write(tmp_path, name, text), max_context=64)


def test_read_trace_missing_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        read_trace(tmp_path / "absent.csv", max_context=64)


def test_simulate_rejects_request_over_max_context() -> None:
    with pytest.raises(TraceError, match=r"request 1: .* = 9 exceeds max_context=8"):
        simulate([Request(2, 2), Request(5, 4)], Policy("Max"), 64, max_context=8)


def test_generate_trace_is_seeded_and_within_bounds() -> None:
    trace = generate_trace(500, max_context=256, seed=7)
    assert trace == generate_trace(500, max_context=256, seed=7)
    assert trace != generate_trace(500, max_context=256, seed=8)
    assert all(1 <= r.prompt_len <= 128 and 1 <= r.output_len <= 128 for r in trace)
    assert all(r.arrival == 0 and r.n == 1 and r.prefix_id is None for r in trace)
    # Log-uniform on [1, 128]: half the draws fall below sqrt(128) = 11.3 (the median).
    below = sum(r.output_len <= 11 for r in trace) / len(trace)
    assert 0.4 < below < 0.6


def test_generate_trace_prefixes_samples_and_arrivals() -> None:
    trace = generate_trace(
        400, max_context=256, seed=1, arrival_rate=0.5, prefix_share=1.0, num_prefixes=3,
        shared_prefix_len=20, parallel_samples=4,
    )
    assert {r.prefix_id for r in trace} == {"p0", "p1", "p2"}
    assert all(r.prefix_len == 20 and 21 <= r.prompt_len <= 128 for r in trace)
    assert all(r.n == 4 for r in trace)
    arrivals = [r.arrival for r in trace]
    assert arrivals == sorted(arrivals)
    # Poisson at 0.5 per step: 400 arrivals span about 800 steps (sd about 40).
    assert 600 < arrivals[-1] < 1000
    half = generate_trace(2000, max_context=256, seed=2, prefix_share=0.25)
    share = sum(r.prefix_id is not None for r in half) / len(half)
    assert abs(share - 0.25) < 4 * math.sqrt(0.25 * 0.75 / 2000)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_requests": 0}, "num_requests must be >= 1, got 0"),
        ({"max_context": 1}, "max_context must be >= 2, got 1"),
        ({"arrival_rate": 0.0}, r"arrival_rate must be None or > 0"),
        ({"prefix_share": 1.5}, r"prefix_share must be in \[0, 1\], got 1.5"),
        ({"num_prefixes": 0}, "num_prefixes must be >= 1"),
        ({"parallel_samples": 0}, "parallel_samples must be >= 1"),
        ({"prefix_share": 0.5, "shared_prefix_len": 128},
         r"shared_prefix_len must be in \[1, max_context // 2 - 1 = 127\], got 128"),
    ],
)
def test_generate_trace_rejects_bad_parameters(kwargs: dict, message: str) -> None:
    args = {"num_requests": 10, "max_context": 256} | kwargs
    with pytest.raises(ValueError, match=message):
        generate_trace(**args)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("Orca",),
         r"policy name must be one of \['Max', 'Pow2', 'Oracle', 'Paged', 'Paged\+share', 'Radix'\]"),
        (("Paged",), "block_size must be an integer >= 1 for policy Paged, got None"),
        (("Paged+share", 0), "block_size must be an integer >= 1 for policy Paged\\+share, got 0"),
        (("Max", 16), "block_size must be None for contiguous policy Max"),
    ],
)
def test_policy_rejects_bad_fields(args: tuple, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Policy(*args)


def test_simulate_rejects_empty_trace_and_budget() -> None:
    with pytest.raises(TraceError, match="the trace has no requests"):
        simulate([], Policy("Max"), 64, max_context=8)
    with pytest.raises(ValueError, match="kv_budget_tokens must be >= 1, got 0"):
        simulate([Request(1, 1)], Policy("Max"), 0, max_context=8)
