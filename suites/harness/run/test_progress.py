"""Progress of ``run`` and ``bench``: at 80 columns the bar keeps its count and ETA and
cuts the point's name; without a terminal a line per failure and per finished
implementation (an unavailable one once, with its reason), a resumed run's earlier
results counted in it; each result's wall time is JUnit's ``time=``."""

from __future__ import annotations

import io
import time

from junitparser import JUnitXml
from rich.console import Console

from pagedbench.harness.results.junit import junit_xml
from pagedbench.harness.run.progress import RunProgress
from pagedbench.reference import PagedCase

from ..conftest import result

#: Cases with the long ids a sweep's points have (more than 80 columns with the name).
CASES = [PagedCase(kv_lens=(64, 64), q_lens=(16, 1), num_q_heads=32, num_kv_heads=8,
                   head_dim=128, block_size=bs, dtype="float32",
                   name="mixed-gqa4-q16s64_q1s64-a-very-long-workload-name") for bs in (16, 32, 64)]
ORDER = [("sdpa-contiguous", c.case_id) for c in CASES]


def _records():
    return [result("sdpa-contiguous", case) for case in CASES]


def test_on_a_terminal_at_80_columns_count_and_eta_stay_and_the_name_is_cut() -> None:
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=80)
    with RunProgress(console, "bench", ORDER) as progress:
        progress.update(_records()[0])
        plain = Console(file=io.StringIO(), width=80, record=True)
        plain.print(progress._bar.make_tasks_table(progress._bar.tasks))
    (line,) = plain.export_text().strip().splitlines()
    assert len(line) <= 80
    assert line.startswith("bench") and "1/3" in line and "eta" in line
    assert line.endswith("…") and f"sdpa-contiguous {CASES[1].case_id}"[:20] in line


def test_without_a_terminal_a_line_per_failure_and_per_finished_implementation() -> None:
    out = io.StringIO()
    console = Console(file=out, force_terminal=False, width=80)
    order = [*ORDER, *(("absent", c.case_id) for c in CASES)]
    records = [*_records(), *(result("absent", c, "unavailable", reason="lib not installed")
                              for c in CASES)]
    records[1] = result("sdpa-contiguous", CASES[1], "fail", reason="max error 9 ulps")
    with RunProgress(console, "run", order) as progress:
        for record in records:
            progress.update(record)
    lines = out.getvalue().splitlines()
    assert [line.split("] ")[0] for line in lines] == ["[2/6 eta 0:00:00", "[3/6 eta 0:00:00",
                                                     "[6/6 eta 0:00:00"]
    assert lines[0].endswith(f"sdpa-contiguous {CASES[1].case_id} fail: max error 9 ulps")
    assert lines[1].endswith("sdpa-contiguous done: 2 pass, 1 fail")
    assert lines[2].endswith("absent: unavailable: lib not installed")


def test_a_resumed_run_counts_its_earlier_results_in_each_implementations_line() -> None:
    out = io.StringIO()
    console = Console(file=out, force_terminal=False, width=80)
    earlier, rest = _records()[:2], _records()[2:]
    with RunProgress(console, "run", ORDER[2:], earlier) as progress:
        for record in rest:
            progress.update(record)
    assert out.getvalue().splitlines()[-1].endswith("sdpa-contiguous done: 3 pass")


def test_each_result_carries_its_wall_time_into_junit() -> None:
    console = Console(file=io.StringIO(), force_terminal=False)
    records = _records()
    with RunProgress(console, "run", ORDER) as progress:
        for record, pause_s in zip(records, (0.05, 0.3, 0.0)):
            time.sleep(pause_s)
            progress.update(record)
    (suite,) = JUnitXml.fromstring(junit_xml(records, "s", progress.seconds))
    took = {case.name: case.time for case in suite}
    assert 0.05 <= took[CASES[0].case_id] < 0.3 <= took[CASES[1].case_id]
    assert took[CASES[2].case_id] < 0.3
    assert abs(suite.time - sum(took.values())) < 0.01
    (unknown,) = JUnitXml.fromstring(junit_xml(records, "s"))
    assert {case.time for case in unknown} == {0.0}
