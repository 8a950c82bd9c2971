"""What each built-in adapter records about itself (``Availability.details``, copied into
every result's ``impl_details``) is JSON data of JSON's own types: a boolean is ``true``
or ``false``, never the string ``"true"`` or ``"True"`` (both appear in leaderboards
written before the adapters recorded booleans as such).
"""

from __future__ import annotations

import json

import pytest
import torch

from pagedbench.adapters import BUILTIN, load

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BOOLEAN_SPELLINGS = {"true", "True", "false", "False"}


@pytest.mark.parametrize("name", list(BUILTIN))
def test_details_are_json_scalars_and_booleans_are_booleans(name: str) -> None:
    availability = load(BUILTIN[name]).available(DEVICE)
    if not availability.ok:
        pytest.skip(f"{name} unavailable on {DEVICE}: {availability.reason}")
    details = availability.details
    assert json.loads(json.dumps(details)) == details
    for key, value in details.items():
        assert type(value) in (str, int, float, bool), (key, value)
        assert not (isinstance(value, str) and value in BOOLEAN_SPELLINGS), (
            f"{name}: details[{key!r}] = {value!r} spells a boolean as a string")
