"""Shared pytest configuration: hypothesis profiles, markers, environment.

Hypothesis profiles (select with ``HYPOTHESIS_PROFILE=dev`` or ``--hypothesis-profile``):

- ``ci`` (default): bounded example counts, no deadline (the Triton interpreter and the
  first ``torch.compile`` of a shape are slow), derandomized so CI is reproducible;
- ``dev``: many more examples, random seeds, for a developer hunting bugs.

On a machine without CUDA, Triton kernels run under the Triton interpreter: this file
sets ``TRITON_INTERPRET=1`` before any kernel module is imported. Compiler caches, the
temp folder and hypothesis's example database go under ``build/`` (unless the
environment already points them elsewhere, as the Makefile does).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from hypothesis import HealthCheck, settings
from hypothesis.configuration import set_hypothesis_home_dir

from pagedbench.harness.environment import apply_environment, cache_environment

_BUILD = Path(__file__).resolve().parent.parent / "build"
_env = cache_environment(_BUILD)
if not torch.cuda.is_available():
    _env["TRITON_INTERPRET"] = os.environ.get("TRITON_INTERPRET", "1")
apply_environment(_env)

set_hypothesis_home_dir(_BUILD / "hypothesis")  # dev's example database, not ./.hypothesis
settings.register_profile(
    "ci",
    max_examples=20,
    deadline=None,
    derandomize=True,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "dev",
    max_examples=300,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
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
