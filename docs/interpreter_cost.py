"""Measure what one interpreted call costs, to refit an adapter's ``InterpreterBudget``.

Usage (from the repository root, after ``make .venv/.installed``)::

    .venv/bin/python docs/interpreter_cost.py triton   # pagedbench-triton, bf16
    .venv/bin/python docs/interpreter_cost.py vllm     # the three vLLM kernels, fp16
    .venv/bin/python docs/interpreter_cost.py paged    # pagedbench-triton-split, -prefill
    .venv/bin/python docs/interpreter_cost.py sglang   # sglang-decode, fp16
    .venv/bin/python docs/interpreter_cost.py lmdeploy # lmdeploy-decode, fp16

For each default-job model preset case the adapter admits on the CPU (``triton`` and
``paged``: the bf16 cases of ``pagedbench run``; ``vllm``, ``sglang`` and ``lmdeploy``: their reduced
forms in float16, since the interpreter cannot run those kernels in bfloat16), it times one
``run()`` in process CPU time (the interpreter compiles nothing, so one untimed call per
adapter suffices), prints the launch's programs and key-loop steps, the time, the
budget's estimate and their ratio, then the least-squares fit of ``seconds = a *
programs + b * weighted steps``. Runs take 1-5 minutes on two cores; numbers from a
loaded machine are high. See docs/interpreter-budget.md.
"""

from __future__ import annotations

import os
import sys
import time

os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported

import numpy as np  # noqa: E402

from pagedbench.adapters.lmdeploy_triton import LmdeployDecode  # noqa: E402
from pagedbench.adapters.sglang_triton import SglangDecode  # noqa: E402
from pagedbench.adapters.triton_decode import TritonPagedDecode  # noqa: E402
from pagedbench.adapters.triton_paged import TritonPrefill, TritonSplitDecode  # noqa: E402
from pagedbench.adapters.vllm_triton import (  # noqa: E402
    VllmChunkedPrefill,
    VllmDecode,
    VllmUnified,
)
from pagedbench.harness.cases.presets import default_cases  # noqa: E402
from pagedbench.reference import materialize  # noqa: E402

REDUCED_FP16 = list(dict.fromkeys(c.with_(dtype="float16") for c in default_cases()
                                  if c.tag == "reduced"))
WORKLOADS = {
    "triton": ([TritonPagedDecode()], default_cases()),
    "paged": ([TritonSplitDecode(), TritonPrefill()], default_cases()),
    "vllm": ([VllmUnified(), VllmDecode(), VllmChunkedPrefill()], REDUCED_FP16),
    "sglang": ([SglangDecode()], REDUCED_FP16),
    "lmdeploy": ([LmdeployDecode()], REDUCED_FP16),
}


def main(which: str) -> None:
    adapters, cases = WORKLOADS[which]
    rows = []
    print(f"{'adapter':25} {'case':58} {'programs':>8} {'steps':>6} {'s':>6} "
          f"{'model s':>7} {'ratio':>5}")
    for adapter in adapters:
        availability = adapter.available("cpu")
        if not availability.ok:
            print(f"{adapter.name}: unavailable: {availability.reason}")
            continue
        admitted = [c for c in cases if not adapter.why_unsupported(c, "cpu")]
        adapter.run(adapter.prepare(materialize(admitted[0])))  # lazy imports, untimed
        for case in admitted:
            work = adapter.interpreter_work(case)
            prepared = adapter.prepare(materialize(case))
            start = time.process_time()
            adapter.run(prepared)
            seconds = time.process_time() - start
            model = adapter.interpreter_budget.seconds(work)
            rows.append((work.programs, work.steps * work.step_weight, seconds))
            print(f"{adapter.name:25} {case.case_id:58} {work.programs:8d} {work.steps:6d} "
                  f"{seconds:6.2f} {model:7.2f} {seconds / model if model else 0:5.2f}")
    if rows:
        data = np.array(rows)
        (per_program, per_step), *_ = np.linalg.lstsq(data[:, :2], data[:, 2], rcond=None)
        print(f"fit over {len(rows)} calls: {per_program * 1e3:.2f} ms per program, "
              f"{per_step * 1e3:.2f} ms per weighted step")


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] not in WORKLOADS:
        sys.exit(f"usage: {sys.argv[0]} {{{','.join(WORKLOADS)}}}")
    main(sys.argv[1])
