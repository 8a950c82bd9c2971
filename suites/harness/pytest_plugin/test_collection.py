"""The plugin's collection: every object alive when it ends is frozen out of garbage
collection, and the session collects again while its tests run."""

from __future__ import annotations

import gc

import torch  # noqa: F401  (alive once this module is collected)

from ..conftest import TORCH_OBJECTS_AT_LEAST


def test_this_session_collected_frozen_and_collects_while_it_tests() -> None:
    assert gc.get_freeze_count() >= TORCH_OBJECTS_AT_LEAST
    assert gc.isenabled()
