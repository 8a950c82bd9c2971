"""What the conformance and serving suites share about the implementations they check:
each imported once per session (only those a session selects, when their first test
runs), skipped with its reason when it cannot run here, and the tests of a built-in that
compiles each new shape marked ``nightly``."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

from pagedbench.adapters import Adapter, entries, load


@functools.cache
def adapter_of(impl: str) -> Adapter:
    """``impl``'s adapter, imported once per session."""
    target = next(e.target for e in entries() if e.name == impl)
    return load(target)


def available_adapter(impl: str, device: str) -> Adapter:
    """``impl``'s adapter; the test skips (with the reason) when it cannot run on
    ``device``."""
    instance = adapter_of(impl)
    availability = instance.available(device)
    if not availability.ok:
        pytest.skip(f"{impl} unavailable on {device}: {availability.reason}")
    return instance


@functools.cache
def compiles_per_shape(impl: str) -> bool:
    """For a built-in (a plug-in is imported only when its first test runs)."""
    builtin = next(e.builtin for e in entries() if e.name == impl)
    return builtin and adapter_of(impl).compiles_per_shape


def mark_compilers_nightly(items: list[pytest.Item], folder: Path) -> None:
    """Mark ``nightly`` the tests in ``folder`` of a built-in that compiles each new shape
    (seconds a case: FlexAttention's ``torch.compile``): ``make test`` leaves them out
    (``-m "not nightly"``); every other run keeps them."""
    for item in items:
        impl = getattr(item, "callspec", None) and item.callspec.params.get("impl")
        if impl and item.path.parent == folder and compiles_per_shape(impl):
            item.add_marker(pytest.mark.nightly)


__all__ = ["adapter_of", "available_adapter", "compiles_per_shape", "mark_compilers_nightly"]
