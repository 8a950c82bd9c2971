"""How a pagedbench process imports (``heavy_imports``): the collector off inside, what was
imported frozen after, the collector as it was; a worker and the console script import so,
a test session calling the CLI in-process does not."""

from __future__ import annotations

import gc
import subprocess
import sys

import pytest

from pagedbench.harness.results.record import Environment, ResultRecord
from pagedbench.harness.results.store import environment
from pagedbench.harness.run.environment import heavy_imports
from pagedbench.harness.run.runner import RunConfig, run_target
from pagedbench.harness.verdict.status import Status
from pagedbench.reference import PagedCase

from ..conftest import FAULTS, TORCH_OBJECTS_AT_LEAST


@pytest.fixture
def collector():
    """The collector on or off as before the test (what the session held when the test
    froze stays frozen, never freed)."""
    enabled = gc.isenabled()
    yield
    (gc.enable if enabled else gc.disable)()


@pytest.mark.parametrize("enabled", [True, False], ids=["collecting", "not-collecting"])
def test_inside_nothing_is_collected_after_it_is_frozen_and_the_collector_as_it_was(
        enabled, collector) -> None:
    (gc.enable if enabled else gc.disable)()
    before = gc.get_freeze_count()
    with heavy_imports():
        assert not gc.isenabled()
        made = [[] for _ in range(1000)]
    assert gc.get_freeze_count() >= before + len(made)
    assert gc.isenabled() is enabled


def test_the_collector_comes_back_when_the_import_fails(collector) -> None:
    gc.enable()
    before = gc.get_freeze_count()
    with pytest.raises(ModuleNotFoundError), heavy_imports():
        made = [[] for _ in range(1000)]
        import not_installed_mod  # noqa: F401
    assert gc.isenabled() and gc.get_freeze_count() >= before + len(made)


def test_a_worker_has_imported_frozen_and_collects_while_it_works(tmp_path) -> None:
    case = PagedCase(kv_lens=(5, 17), num_q_heads=4, num_kv_heads=2, head_dim=32,
                     block_size=16, dtype="float32", name="gc")
    records: list[ResultRecord] = []
    run_target("reports-collector", FAULTS["reports-collector"], [case],
               RunConfig(timing=False, cache_dir=tmp_path, threads=1), "t",
               Environment.model_validate(environment("cpu")), records.append)
    (record,) = records
    assert record.status is Status.PASS, record.reason
    assert record.impl_details["gc_enabled"] is True
    assert record.impl_details["frozen"] >= TORCH_OBJECTS_AT_LEAST


def test_the_console_script_imports_frozen_and_an_in_process_call_does_not() -> None:
    probe = ("import gc, io, contextlib\n"
             "from pagedbench.harness.cli import main\n"
             "with contextlib.redirect_stdout(io.StringIO()):\n"
             "    main(['schema'])\n"
             "print(gc.get_freeze_count(), gc.isenabled())\n"
             "with contextlib.redirect_stdout(io.StringIO()):\n"
             "    main(['schema'], console=True)\n"
             "print(gc.get_freeze_count(), gc.isenabled())\n")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    (plain_count, plain_on), (console_count, console_on) = (
        line.split() for line in done.stdout.splitlines())
    assert (int(plain_count), plain_on) == (0, "True")
    assert int(console_count) >= TORCH_OBJECTS_AT_LEAST and console_on == "True"
