"""Shared pytest configuration: hypothesis profiles, markers, environment.

Hypothesis profiles (select with ``--hypothesis-profile NAME`` or ``HYPOTHESIS_PROFILE``;
the option wins). Example counts follow the profile in force (``suites/budget.py``):

- ``ci`` (default): bounded budgets (30 s of conformance search per implementation), no
  deadline (the Triton interpreter and the first ``torch.compile`` of a shape are slow),
  derandomized so CI is reproducible, no explain phase (it re-runs a failing case many
  times; the failure message already names the replay command);
- ``nightly``: 20 times the search, random seeds and the example database, for a nightly
  job or a developer hunting bugs.

On a machine without CUDA, Triton kernels run under the Triton interpreter: this file
sets ``TRITON_INTERPRET=1`` before any kernel module is imported. Compiler caches, the
temp folder and hypothesis's example database go under ``build/`` (unless the
environment already points them elsewhere, as the Makefile does).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from hypothesis import HealthCheck, Phase, settings
from hypothesis.configuration import set_hypothesis_home_dir

from pagedbench.harness.environment import apply_environment, cache_environment

_BUILD = Path(__file__).resolve().parent.parent / "build"
_env = cache_environment(_BUILD)
if not torch.cuda.is_available():
    _env["TRITON_INTERPRET"] = os.environ.get("TRITON_INTERPRET", "1")
apply_environment(_env)

set_hypothesis_home_dir(_BUILD / "hypothesis")  # nightly's example database, not ./.hypothesis
settings.register_profile(
    "ci",
    max_examples=20,
    deadline=None,
    derandomize=True,
    phases=[p for p in Phase if p is not Phase.explain],  # explaining re-runs a failure
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "nightly",
    max_examples=1000,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
# The variable's profile; hypothesis's plug-in loads --hypothesis-profile after this.
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_addoption(parser):
    parser.addoption(
        "--impl",
        action="append",
        default=[],
        help="run conformance tests only for these implementations (repeatable)",
    )


def pytest_collection_modifyitems(config, items):
    import pytest

    if not torch.cuda.is_available():
        skip_gpu = pytest.mark.skip(reason="needs a CUDA device; none is visible to torch")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip_gpu)
