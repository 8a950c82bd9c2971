"""``cached_load``: the Triton peers' loaders call the peer's loading once per process and
turn the failures they know into a reason; anything else is a bug and propagates."""

from __future__ import annotations

import pytest

from pagedbench.adapters.triton_peer import cached_load

REASONS = ((ImportError, "not importable"),
           ((RuntimeError, AssertionError), "could not be enabled"))


def _raising(exc: BaseException):
    calls = []

    def load():
        calls.append(1)
        raise exc

    return load, calls


@pytest.mark.parametrize(("exc", "reason"), [
    (ModuleNotFoundError("no module named 'vllm'"), "not importable: no module named 'vllm'"),
    (RuntimeError("disabled"), "could not be enabled: disabled"),
    (AssertionError("triton off"), "could not be enabled: triton off"),
])
def test_a_known_failure_is_a_reason_given_once(exc, reason) -> None:
    load, calls = _raising(exc)
    loaded = cached_load(load, REASONS)
    assert loaded() == (None, reason)
    assert loaded() == (None, reason) and len(calls) == 1


def test_an_unknown_failure_propagates_and_a_success_is_kept() -> None:
    load, _ = _raising(KeyError("stray"))
    with pytest.raises(KeyError):
        cached_load(load, REASONS)()
    kernels = object()
    calls = []
    loaded = cached_load(lambda: calls.append(1) or kernels, REASONS)
    assert loaded() == (kernels, "") and loaded() == (kernels, "") and len(calls) == 1
