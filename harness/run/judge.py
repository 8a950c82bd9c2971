"""The judge's side of a run: what crosses from an implementation's worker to the judging
process, and the state that process judges in.

The runner's worker (the implementation's process) only prepares, runs and times; the
truth, the yardstick and the comparison are computed in the parent, which never imports
a plug-in, from inputs it draws itself from the case's seed. Of what the worker sends,
only the output is used, and only as data: :func:`encode_output` turns it into a
descriptor (type, shape, dtype) and, when shape and dtype are the case's, its values as
float32 bytes (exact for float32, float16 and bfloat16); :func:`decode_output` rebuilds
it in the parent after checking the descriptor against the case, so that an output on
the ``meta`` device or a tensor subclass that raises is the implementation's ``error``
(raised while encoding, in its own process), never a fault of pagedbench.

Timed calls are spot-checked: one timed call in :data:`SPOT_EVERY` (the first included)
is on inputs drawn from :func:`spot_case` (same case, another seed), and the worker
returns the last output on each of the inputs, which the parent judges against their
truths; an output that is not computed from its call's inputs fails the timing (a
``fail`` of step ``timing``, without a time). Points with a device truth are not
spot-checked (a second pool on the device).

:func:`judging_state` sets the global torch state the truth and comparison depend on,
whatever the calling process had set.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pagedbench.reference import PagedCase

from pagedbench.harness.measure.timing import Timing
from pagedbench.harness.run import replay
from pagedbench.harness.run.protocol import Answer
from pagedbench.harness.verdict import conformance, tolerance
from pagedbench.harness.verdict.status import Status
from pagedbench.harness.verdict.truth import device_truth_for, truth_for

#: Added to a case's seed for the inputs of the spot-checked timed calls.
SPOT_SEED_OFFSET = 0x5EED
#: One timed call in this many (the first included) is on the fresh inputs: few enough
#: that the timing stays that of the judged inputs' working set.
SPOT_EVERY = 4
#: Verdicts whose reason ends with the command that replays the case (harness/run/replay.py).
REPLAYED = (Status.FAIL, Status.ERROR)
#: Longest type name of a non-tensor output kept in its descriptor.
TYPE_NAME_CHARS = 100


def spot_case(case: PagedCase) -> PagedCase:
    """``case`` with the seed of its spot-checked timed calls (fresh inputs, same shapes)."""
    return case.with_(seed=(case.seed + SPOT_SEED_OFFSET) % 2**31)


def output_shape(case: PagedCase) -> tuple[int, int, int]:
    """The shape of a correct output of ``case``: ``(total_q, num_q_heads, v_head_dim)``."""
    return (case.total_q, case.num_q_heads, case.v_head_dim)


def encode_output(out: object, case: PagedCase) -> tuple[dict[str, Any], bytes]:
    """The descriptor of ``out`` (``{"type", "shape", "dtype", "nbytes"}``) and, when it
    is a dense tensor of ``case``'s output shape and dtype, its values as C-order
    float32 bytes (otherwise none: the comparison refuses it on its shape or dtype).

    Raises
    ------
    Exception
        Whatever reading ``out`` raises (a ``meta`` tensor, a subclass that refuses):
        the implementation's fault.
    """
    if not isinstance(out, torch.Tensor):
        return {"type": type(out).__name__[:TYPE_NAME_CHARS]}, b""
    shape, dtype = [int(n) for n in out.shape], str(out.dtype).removeprefix("torch.")
    payload = b""
    if tuple(shape) == output_shape(case) and dtype == case.dtype:
        if out.layout != torch.strided:
            raise TypeError(f"output has layout {out.layout}, not a dense (strided) tensor")
        values = torch.Tensor.float(out.detach().as_subclass(torch.Tensor).cpu())
        payload = np.ascontiguousarray(values.numpy(), dtype=np.float32).tobytes()
    return {"type": "Tensor", "shape": shape, "dtype": dtype, "nbytes": len(payload)}, payload


def payload_bytes(case: PagedCase) -> int:
    """Bytes of the values :func:`encode_output` sends for a correct output of ``case``."""
    return math.prod(output_shape(case)) * 4


def decode_output(descriptor: object, payload: bytes, case: PagedCase) -> object:
    """The output :func:`encode_output` described, rebuilt for the comparison: a CPU
    tensor of the case dtype with the sent values, an empty ``meta`` tensor of the sent
    shape and dtype when they are not the case's, or a stand-in of the sent type name.

    Raises
    ------
    ValueError
        If the descriptor is not one :func:`encode_output` writes for ``case``, or the
        payload is not its size.
    """
    if not isinstance(descriptor, dict) or not isinstance(descriptor.get("type"), str):
        raise ValueError(f"an output descriptor must be an object with a type, got "
                         f"{descriptor!r:.200}")
    if descriptor["type"] != "Tensor":
        if payload:
            raise ValueError("a non-tensor output came with values")
        return type(descriptor["type"][:TYPE_NAME_CHARS], (), {})()
    shape, dtype = descriptor.get("shape"), descriptor.get("dtype")
    if (not isinstance(shape, list) or len(shape) > 8
            or not all(type(n) is int and 0 <= n < 2**40 for n in shape)):
        raise ValueError(f"output shape {shape!r:.200} is not a list of sizes")
    torch_dtype = getattr(torch, dtype, None) if isinstance(dtype, str) else None
    if not isinstance(torch_dtype, torch.dtype):
        raise ValueError(f"output dtype {dtype!r:.100} is not a torch dtype")
    if tuple(shape) != output_shape(case) or dtype != case.dtype:
        if payload:
            raise ValueError("an output of another shape or dtype came with values")
        return torch.empty(shape, dtype=torch_dtype, device="meta")
    if len(payload) != payload_bytes(case):
        raise ValueError(f"{len(payload)} bytes of values for an output of "
                         f"{payload_bytes(case)}")
    values = np.frombuffer(payload, dtype=np.float32).reshape(shape)
    return torch.from_numpy(values.copy()).to(case.torch_dtype)


#: One :func:`judging_state` at a time in this process: a judge thread left running past
#: its harness timeout still holds the state, so the next case's thread waits for it
#: (inside its own budget) instead of saving the first one's settings as "previous" and
#: restoring them over the caller's.
_JUDGING = threading.Lock()


@contextlib.contextmanager
def judging_state() -> Iterator[None]:
    """Judge with torch's defaults, whatever this process had set, restored after:
    ``float32`` matmul precision ``"highest"`` (no TF32), default dtype float32, denormals
    kept in the judging thread (no flush to zero; left so after), reduced-precision
    fp16/bf16 reductions at their defaults. Held by one thread at a time (:data:`_JUDGING`);
    what the caller sets while a judge thread runs past its harness timeout is overwritten
    when that thread ends (with what the caller had when it began).

    The intra-op thread count is left alone: ``torch.set_num_threads`` from a helper
    thread sets the count that every thread started later takes, the caller's own
    included in effect (a compiled function's ``GLOBAL_STATE`` guard then failed in the
    caller), and the truth does not depend on it (the yardstick's bits are the same at 1
    and 2 threads: suites/harness/test_yardstick_orders.py)."""
    with _JUDGING:
        matmul = torch.backends.cuda.matmul
        saved = (torch.get_float32_matmul_precision(), torch.get_default_dtype(),
                 matmul.allow_fp16_reduced_precision_reduction,
                 matmul.allow_bf16_reduced_precision_reduction, torch.backends.cudnn.allow_tf32)
        torch.set_flush_denormal(False)  # the previous mode cannot be read back: left off
        torch.set_float32_matmul_precision("highest")
        torch.set_default_dtype(torch.float32)
        matmul.allow_fp16_reduced_precision_reduction = True
        matmul.allow_bf16_reduced_precision_reduction = True
        torch.backends.cudnn.allow_tf32 = False
        try:
            yield
        finally:
            precision, dtype, fp16, bf16, cudnn_tf32 = saved
            torch.set_float32_matmul_precision(precision)
            torch.set_default_dtype(dtype)
            matmul.allow_fp16_reduced_precision_reduction = fp16
            matmul.allow_bf16_reduced_precision_reduction = bf16
            torch.backends.cudnn.allow_tf32 = cudnn_tf32


class Refused(Exception):
    """A worker's message the judge cannot accept (the implementation's fault)."""


@dataclass(frozen=True)
class Outcome:
    """What the judge concluded about one case: the verdict, the timing (of a pass that
    was timed and whose spot checks passed) and where the truth was (to be) computed."""

    verdict: conformance.Verdict
    timing: Timing | None = None
    truth: str | None = None


def _bounded(work: Callable[[], Any], seconds: float, what: str) -> Any:
    """``work()`` in a thread, given ``seconds``; raises TimeoutError past them (the
    thread is left to finish: pagedbench's own computation, never an implementation's)."""
    found: dict[str, Any] = {}

    def target() -> None:
        try:
            found["value"] = work()
        except BaseException as exc:  # re-raised in the caller
            found["error"] = exc

    thread = threading.Thread(target=target, name=f"judge-{what}", daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        raise TimeoutError(f"took longer than {seconds:g} s (--harness-timeout)")
    if "error" in found:
        raise found["error"]
    return found["value"]


class Judge:
    """The parent's side of one implementation's ``evaluate`` job: it answers the
    worker's messages for each case (see :func:`~.jobs.work`) and concludes an
    :class:`Outcome` per case, computing truths (cached under ``cache_dir``) and
    comparisons in this process under :func:`judging_state`, each case's within
    ``harness_timeout_s`` (past it: ``harness-error`` of step ``truth``).

    Messages, each for the case in flight: ``outcome`` (the implementation ended it
    first: ``unsupported`` or ``error``, anything else counts as ``error``), ``ready``
    (its declared tail poison and logits precision: the truth is computed, the reply says
    whether to go on), ``output`` (its output; the reply says whether to time it, with
    spot checks on fresh inputs for a host truth) and ``timed`` (the timing and the last
    output on each of the inputs).
    """

    def __init__(self, name: str, cases: list[PagedCase], sites: list[str], *, device: str,
                 timing: bool, cache_dir: Path, harness_timeout_s: float) -> None:
        self.name, self.cases, self.sites, self.device = name, cases, sites, device
        self.timing, self.harness_timeout_s = timing, harness_timeout_s
        self.truth = partial(truth_for, cache_dir=cache_dir)
        self.device_truth = partial(device_truth_for, cache_dir=cache_dir)
        self.reset()

    def reset(self) -> None:
        """Forget the case in flight (a fresh worker begins the next one)."""
        self._claimed: conformance.Attempt | None = None
        self._expected: tolerance.Expected | None = None
        self._spot: tuple[PagedCase, tolerance.Expected] | None = None
        self._passed: conformance.Verdict | None = None
        self._spent_s = 0.0

    def max_payload_bytes(self) -> int:
        """The largest payload a message of this job may carry (two outputs)."""
        return 2 * max((payload_bytes(c) for c in self.cases), default=0)

    def _judged(self, index: int, work: Callable[[], Any], what: str) -> Any:
        """``work()`` under :func:`judging_state`, within what is left of the case's
        harness budget."""
        def run() -> Any:
            with judging_state():
                return work()

        start = time.monotonic()
        try:
            return _bounded(run, self.harness_timeout_s - self._spent_s, what)
        finally:
            self._spent_s += time.monotonic() - start

    def _expected_of(self, index: int, case: PagedCase, site: str) -> tolerance.Expected:
        precision = self._claimed.logits_precision
        return self._judged(index, lambda: conformance.expected_for(
            case, self.device, precision, truth=self.truth, truth_site=site,
            device_truth=self.device_truth), "truth")

    def _verdict(self, index: int, case: PagedCase, out: object,
                 expected: tolerance.Expected) -> conformance.Verdict:
        try:
            return self._judged(index, lambda: conformance.verdict_of(
                case, self._claimed, out, expected, self.sites[index]), "compare")
        except TimeoutError as exc:
            return conformance.harness_fault("compare", exc)

    def _hinted(self, verdict: conformance.Verdict, case: PagedCase) -> conformance.Verdict:
        if verdict.status in REPLAYED:
            return replace(verdict, reason=f"{verdict.reason}; {replay.hint(case, self.name)}")
        return verdict

    def _done(self, verdict: conformance.Verdict, case: PagedCase, site: str | None,
              timing: Timing | None = None, reply: dict[str, Any] | None = None
              ) -> tuple[Answer, Outcome]:
        self.reset()
        return Answer(reply, item_done=True), Outcome(self._hinted(verdict, case), timing, site)

    def receive(self, index: int, message: dict[str, Any]) -> tuple[Answer, Outcome | None]:
        """Answer ``message`` about case ``index``: the reply for the worker and, once the
        case is concluded, its :class:`Outcome`.

        Raises
        ------
        Refused
            If the message is not one the case in flight can get now.
        """
        try:
            return self._receive(index, message)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise Refused(f"{type(exc).__name__}: {exc}") from exc

    def _receive(self, index: int, message: dict[str, Any]) -> tuple[Answer, Outcome | None]:
        case, site, kind = self.cases[index], self.sites[index], message["kind"]
        if kind == "outcome":
            if self._passed is not None:
                raise ValueError("an outcome after the output")
            status = Status(message["status"])
            step, reason = str(message["step"]), str(message["reason"])
            if status is not Status.UNSUPPORTED:
                status = Status.ERROR  # nothing else is the implementation's to claim
            truth = None if status is Status.UNSUPPORTED or step == "why_unsupported" else site
            return self._done(conformance.Verdict(status, reason, step), case, truth)
        if kind == "ready":
            if self._claimed is not None:
                raise ValueError("ready twice")
            poison, precision = message["tail_poison"], message["logits_precision"]
            if poison not in ("nan", "stale") or precision not in ("float32", "case"):
                raise ValueError(f"tail poison {poison!r:.40}, logits precision "
                                 f"{precision!r:.40}")
            self._claimed = conformance.Attempt(tail_poison=poison, logits_precision=precision)
            try:
                self._expected = self._expected_of(index, case, site)
            except Exception as exc:
                return self._done(conformance.harness_fault("truth", exc), case, site, reply={"go": False})
            return Answer({"go": True}), None
        if kind == "output":
            if self._expected is None or self._passed is not None:
                raise ValueError("an output before the truth or twice")
            (descriptor,) = message["outputs"]
            out = decode_output(descriptor, message.get("payload", b""), case)
            probe = message["nan_tail_output_finite"]
            if probe not in (None, True, False) or not isinstance(message["details"], dict):
                raise ValueError("details or NaN-tail probe of the wrong type")
            self._claimed = replace(self._claimed, details=message["details"],
                                    nan_tail_output_finite=probe)
            verdict = self._verdict(index, case, out, self._expected)
            if verdict.status is not Status.PASS or not self.timing:
                return self._done(verdict, case, site, reply={"time": False})
            self._passed = verdict
            spot = spot_case(case) if site == "host" else None
            if spot is not None:
                try:
                    self._spot = (spot, self._expected_of(index, spot, site))
                except Exception as exc:
                    return self._done(conformance.harness_fault("truth", exc), case, site,
                                      reply={"time": False})
            return Answer({"time": True, "spot": spot is not None}), None
        if kind == "timed":
            if self._passed is None:
                raise ValueError("a timing before a pass")
            if "error" in message:
                verdict = replace(self._passed, status=Status.ERROR, step="timing",
                                  reason=f"run raised while timing: {message['error']:.2000}")
                return self._done(verdict, case, site)
            timing = Timing(tuple(message["samples_ms"]), message["method"],
                            tuple(message["probe_ms"]))
            verdict, checked = self._spot_checked(index, case, message, timing)
            return self._done(verdict, case, site, checked)
        raise ValueError(f"a message of unknown kind {kind!r:.40}")

    def _spot_checked(self, index: int, case: PagedCase, message: dict[str, Any],
                      timing: Timing) -> tuple[conformance.Verdict, Timing | None]:
        """The pass with its timing, or a ``fail`` of step ``timing`` when a timed call's
        last output on the judged or the fresh inputs does not pass."""
        main, fresh = message["outputs"]
        payload = message.get("payload", b"")
        checks = [(main, case, self._expected, "the judged inputs")]
        if self._spot is not None:
            if fresh is None:
                raise ValueError("no output of the timed calls on fresh inputs")
            spot, expected = self._spot
            checks.append((fresh, spot, expected, f"fresh inputs (seed {spot.seed})"))
        for descriptor, checked, expected, label in checks:
            if descriptor is None:
                continue
            size = descriptor.get("nbytes", 0) if isinstance(descriptor, dict) else 0
            chunk, payload = payload[:size], payload[size:]
            verdict = self._verdict(index, checked, decode_output(descriptor, chunk, checked),
                                    expected)
            if verdict.status is not Status.PASS:
                return replace(self._passed, status=Status.FAIL, step="timing",
                               comparison=verdict.comparison, reason=(
                                   f"a timed call on {label} returned an output that fails "
                                   f"({verdict.status}): {verdict.reason}")), None
        if payload:
            raise ValueError("more values than the outputs described")
        return self._passed, timing


__all__ = ["REPLAYED", "SPOT_EVERY", "SPOT_SEED_OFFSET", "Judge", "Outcome", "Refused",
           "decode_output", "encode_output", "judging_state", "output_shape", "payload_bytes",
           "spot_case"]
