"""A harness timing as pytest-benchmark's own: one timing per benchmark item."""

from __future__ import annotations

from pagedbench.harness.measure.timing import Timing

#: How pytest-benchmark names the mode of a fixture whose rounds the harness timed.
HARNESS_MODE = "pagedbench harness timing"


def record_timing(benchmark, timing: Timing) -> None:
    """Make ``timing`` the item's only pytest-benchmark timing: one round per harness
    sample (``samples_ms`` / 1000 s, one iteration each), so ``stats.median`` is
    ``timing.median_ms`` (the board's number) and ``--benchmark-compare-fail`` judges it.

    pytest-benchmark has no public call for rounds timed elsewhere; this uses its fixture's
    own recording (``_make_stats``, then ``update`` per round, as its ``pedantic`` does;
    pytest-benchmark 4 and 5), which suites/harness/pytest_plugin/test_benchmark_json.py
    pins. With ``--benchmark-disable`` nothing is recorded.

    Raises
    ------
    pytest_benchmark.fixture.FixtureAlreadyUsed
        If the item already timed something with ``benchmark``.
    """
    from pytest_benchmark.fixture import FixtureAlreadyUsed

    if benchmark._mode:
        raise FixtureAlreadyUsed(f"Fixture can only be used once. Previously it was used "
                                 f"in {benchmark._mode} mode.")
    benchmark._mode = HARNESS_MODE
    if benchmark.disabled:
        return
    stats = benchmark._make_stats(1)
    for sample_ms in timing.samples_ms:
        stats.update(sample_ms / 1e3)
