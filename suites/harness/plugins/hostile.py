"""Test-only adapters that try to forge their verdict, their timing or another
implementation's verdict: each cheats in its own process, the only one it runs in. Unless
its docstring says otherwise, each returns all zeros (a wrong output), so a pass would be
the cheat working. The patches are made when the adapter is loaded (``__init__``, run at
import by the loader), so that each class cheats alone although they share this module.
"""

from __future__ import annotations

import ctypes
import gc
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

from pagedbench.adapters.torch_sdpa import TorchGather
from pagedbench.harness.run.confine import PR_SET_CHILD_SUBREAPER


class _Zeros(TorchGather):
    """All zeros of the right shape and dtype."""

    def run(self, prepared):
        out = super().run(prepared)
        return torch.zeros_like(out)


class PatchesCompare(_Zeros):
    """Replaces ``tolerance.compare`` (and the conformance module's reference to it) with
    one that passes everything."""

    name = "patches-compare"

    def __init__(self) -> None:
        from pagedbench.harness.verdict import conformance, tolerance

        real = tolerance.compare

        def always_passes(out, expected, dtype, cu_seqlens_q=None):
            return real(expected.naive, expected, dtype, cu_seqlens_q)

        tolerance.compare = always_passes
        conformance.tolerance.compare = always_passes


class PatchesExpectedOf(_Zeros):
    """Replaces ``Expected.of`` with one whose truth and yardstick are zeros."""

    name = "patches-expected-of"

    def __init__(self) -> None:
        from pagedbench.harness.verdict.tolerance import Expected

        real = Expected.of.__func__

        def zeros(cls, inputs, logits_precision="float32", **kwargs):
            found = real(cls, inputs, logits_precision, **kwargs)
            return cls(torch.zeros_like(found.truth), torch.zeros_like(found.naive))

        Expected.of = classmethod(zeros)


class PatchesResultRecord(_Zeros):
    """Replaces ``outcome.result_record`` with one that records every verdict as a pass."""

    name = "patches-result-record"

    def __init__(self) -> None:
        from pagedbench.harness.results import outcome
        from pagedbench.harness.verdict.status import Status

        real = outcome.result_record

        def passes(**fields):
            fields.update(status=Status.PASS, reason="", step=None)
            return real(**fields)

        outcome.result_record = passes


class ZeroesTheTruth(_Zeros):
    """In ``prepare``, zeroes every truth (``Expected``) and every float64 tensor of its
    output's size it finds through ``gc``."""

    name = "zeroes-the-truth"

    def prepare(self, inputs):
        from pagedbench.harness.verdict.tolerance import Expected

        size = inputs.q.shape[0] * inputs.q.shape[1] * inputs.case.v_head_dim
        for found in gc.get_objects():
            if isinstance(found, Expected):
                found.truth.zero_()
                found.naive.zero_()
            elif (isinstance(found, torch.Tensor) and found.dtype == torch.float64
                  and found.numel() == size):
                found.zero_()
        return super().prepare(inputs)


class ReturnsItsFirstOutput(TorchGather):
    """Correct on its first call; every later call returns that first output again at
    once (a timing 'faster' than any kernel)."""

    name = "returns-its-first-output"

    def __init__(self) -> None:
        self.first = None

    def run(self, prepared):
        if self.first is None:
            self.first = super().run(prepared)
        return self.first


def _forge(message: bytes) -> None:
    """Write ``message`` into the worker's message pipe (the fd its argv names)."""
    fd = int(sys.argv[sys.argv.index("--fd") + 1])
    os.write(fd, message)


class ForgesTheCompareStep(_Zeros):
    """In ``run``, claims to be in pagedbench's ``compare`` step of the case, then runs
    for an hour (once: the run looped forever, charged to pagedbench)."""

    name = "forges-the-compare-step"

    def __init__(self) -> None:
        self.item = 0

    def run(self, prepared):
        _forge(b'{"kind": "step", "item": %d, "step": "compare"}\n'
               % self.item)
        self.item += 1
        time.sleep(3600)
        return super().run(prepared)


class AlternatesItems(_Zeros):
    """In ``run``, announces the ``run`` step of two other items in turn, forever (once:
    each new item number reset its budget, and it never timed out)."""

    name = "alternates-items"
    ITEMS = (1000, 1001)

    def run(self, prepared):
        while True:
            for item in self.ITEMS:
                _forge(b'{"kind": "step", "item": %d, "step": "run"}\n'
                       % item)
                time.sleep(0.2)


class ChangesTorchState(_Zeros):
    """At load, sets float32 matmul precision ``"high"``, float64 as the default dtype and
    flush-to-zero of denormals (once: the yardstick, computed in its process, changed)."""

    name = "changes-torch-state"

    def __init__(self) -> None:
        torch.set_float32_matmul_precision("high")
        torch.set_default_dtype(torch.float64)
        torch.set_flush_denormal(True)

    def run(self, prepared):
        out = super().run(prepared)
        return torch.zeros(out.shape, dtype=out.dtype)


class PoisonsTheCache(_Zeros):
    """In ``prepare``, overwrites every truth-cache file in the cache folder
    ``$PAGEDBENCH_TEST_CACHE_DIR`` (an attacker that knows where it is) with zeros,
    keeping each file's key and HMAC field (once: a later implementation in the same run,
    and later runs, were judged against the zeros)."""

    name = "poisons-the-cache"

    def prepare(self, inputs):
        for path in (Path(os.environ["PAGEDBENCH_TEST_CACHE_DIR"]) / "truth").glob("*.npz"):
            with np.load(path, allow_pickle=False) as saved:
                data = dict(saved)
            data["truth"] = np.zeros_like(data["truth"])
            data["naive"] = np.zeros_like(data["naive"])
            with open(path, "wb") as f:
                np.savez(f, **data)
        return super().prepare(inputs)


class MetaOutput(TorchGather):
    """Returns a tensor on the ``meta`` device (right shape and dtype, no values)."""

    name = "meta-output"

    def run(self, prepared):
        out = super().run(prepared)
        return torch.empty(out.shape, dtype=out.dtype, device="meta")


class _Refuses(torch.Tensor):
    """A tensor subclass every operation of which raises (``.double()`` included)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in ("__get__", "shape", "dtype", "layout"):
            return super().__torch_function__(func, types, args, kwargs or {})
        raise RuntimeError(f"{getattr(func, '__name__', func)} refused")


class RefusingSubclassOutput(TorchGather):
    """Returns its (correct) output as a tensor subclass that raises on every operation."""

    name = "refusing-subclass-output"

    def run(self, prepared):
        return super().run(prepared).as_subclass(_Refuses)


class LeavesTheWorkerTree(_Zeros):
    """In ``prepare``, clears the worker's child-subreaper flag: the first step of moving a
    helper process out of the worker's tree, where its CPU would not count in a timing
    (then a double fork). The worker's filter refuses it, and the plug-in raises with the
    error; were it allowed, the zeros would fail."""

    name = "leaves-the-worker-tree"

    def prepare(self, inputs):
        if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0):
            raise PermissionError(ctypes.get_errno(), "clearing the worker's child-subreaper "
                                                      "flag was refused")
        return super().prepare(inputs)
