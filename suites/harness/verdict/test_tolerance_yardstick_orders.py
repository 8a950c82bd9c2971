"""The yardstick is the same on every host, and correct kernels pass whatever order their
float32 sums take (``reference/yardstick.py``; README, "Tolerance").

- ``ordered_sum`` adds in exactly the order it names (checked against numpy float32 scalar
  loops written from the orders' definitions, bit for bit);
- the yardstick reaches no host reduction: no matmul, softmax, sum or float32 exp/tanh
  (every aten call it makes is recorded), and its bits do not move with the thread count or
  the chunking of query rows;
- reference implementations whose reductions are reordered (sequential, reversed, pairwise,
  blocked by 8 and 16, as scalar, AVX2 and AVX-512 loops sum) pass every edge and pinned
  probe and a sample of the calibration set, in a naive form and as a tiled online
  softmax; the self-test's catalogue (``suites/faults``) still catches every fault.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from pagedbench.adapters import Adapter, Availability, Capabilities
from pagedbench.adapters.base import FEATURES, Prepared

from pagedbench.harness.calibration.tolerance import near_correct, random_case
from pagedbench.harness.verdict import conformance
from pagedbench.harness.verdict.status import Status
from pagedbench.harness.verdict.tolerance import Expected
from pagedbench.reference import PagedCase, materialize, naive_attention, yardstick
from pagedbench.reference.axes import LAYOUTS
from pagedbench.reference.yardstick import SUM_ORDERS, ordered_sum, yardstick_attention

from ...conformance.cases import pinned_case
from ...conformance.test_edges import PROBES
from ...conformance.test_pinned_probes import LARGE_SM_SCALE, SPLIT_LENGTHS


def _numpy_sum(terms: np.ndarray, order: str) -> np.float32:
    """The orders' definitions, one float32 scalar addition at a time."""
    values = [np.float32(t) for t in terms]
    if order == "sequential":
        acc = values[0]
        for t in values[1:]:
            acc = np.float32(acc + t)
        return acc
    if order == "reversed":
        return _numpy_sum(terms[::-1], "sequential")
    if order == "pairwise":  # a balanced tree on the largest power of two, then the rest
        if len(values) == 1:
            return values[0]
        power = 1 << (len(values).bit_length() - 1)
        if power == len(values):
            half = power // 2
            return np.float32(_numpy_sum(terms[:half], order) + _numpy_sum(terms[half:], order))
        return np.float32(_numpy_sum(terms[:power], order) + _numpy_sum(terms[power:], order))
    lanes = 8 if order == "blocked8" else 16
    partial = [_numpy_sum(terms[lane::lanes], "sequential")
               for lane in range(min(lanes, len(values)))]
    while len(partial) > 1:
        half = (len(partial) + 1) // 2
        partial = [np.float32(partial[i] + partial[i + half]) if i + half < len(partial)
                   else partial[i] for i in range(half)]
    return partial[0]


@pytest.mark.parametrize("order", SUM_ORDERS)
@pytest.mark.parametrize("n", [1, 2, 3, 7, 16, 33, 64, 100])
def test_ordered_sum_adds_in_the_order_it_names(order: str, n: int) -> None:
    rng = np.random.default_rng(n)
    # Magnitudes over 8 decades, so that every order rounds differently.
    terms = (rng.standard_normal((n, 5)) * 10.0 ** rng.uniform(-4, 4, (n, 5))).astype(np.float32)
    got = ordered_sum(lambda j: torch.tensor(terms[j]), n, order).numpy()
    expected = np.array([_numpy_sum(terms[:, c], order) for c in range(5)], dtype=np.float32)
    np.testing.assert_array_equal(got, expected)


def test_the_orders_differ_on_an_outlier_channel() -> None:
    """The orders are really different sums: with 1e4 in channel 0 (``logit_offset``), a
    sequential sum rounds at 1e4 for every channel, a reversed one only once."""
    terms = np.array([1e4] + [0.3 + 0.001 * j for j in range(63)], dtype=np.float32)
    sums = {o: float(ordered_sum(lambda j: torch.tensor([terms[j]]), 64, o)) for o in SUM_ORDERS}
    exact = float(np.sum(terms.astype(np.float64)))
    assert abs(sums["sequential"] - exact) > abs(sums["reversed"] - exact)
    assert len(set(sums.values())) >= 3


#: A case with every feature the yardstick computes: GQA, prefill rows, soft cap, ALiBi,
#: sinks, a window, an fp8 cache.
FEATURED = PagedCase(kv_lens=(1, 17, 40), q_lens=(1, 5, 3), num_q_heads=8, num_kv_heads=2,
                     head_dim=64, block_size=16, dtype="bfloat16", logits_soft_cap=30.0,
                     alibi=True, sinks=True, sliding_window=24, kv_cache_dtype="fp8_e4m3",
                     k_scale=0.5, name="featured")
#: Host reductions and transcendental kernels (aten names): their float32 results depend
#: on the host's BLAS and vector width.
HOST_REDUCTIONS = ("mm", "bmm", "addmm", "baddbmm", "matmul", "dot", "mv", "addmv", "einsum",
                   "_softmax", "softmax", "log_softmax", "sum", "mean", "cumsum", "logsumexp",
                   "var", "std", "norm", "linalg_vector_norm")


class _Recorder(TorchDispatchMode):
    """Records ``(op name, dtypes of its tensor arguments)`` of every aten call."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, set[torch.dtype]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        dtypes = {a.dtype for a in torch.utils._pytree.tree_leaves((args, kwargs or {}))
                  if isinstance(a, torch.Tensor)}
        self.calls.append((func.overloadpacket.__name__, dtypes))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_yardstick_reaches_no_host_reduction(dtype: str) -> None:
    inputs = materialize(FEATURED.with_(dtype=dtype))
    truth = Expected.of(inputs).truth
    with _Recorder() as recorder:
        yardstick_attention(inputs, truth)
    names = [name for name, _ in recorder.calls]
    assert "add" in names and "mul" in names  # the explicit sums ran under the recorder
    assert not set(names) & set(HOST_REDUCTIONS), sorted(set(names) & set(HOST_REDUCTIONS))
    transcendental = [(n, d) for n, d in recorder.calls if n in ("exp", "tanh")]
    assert transcendental and all(d == {torch.float64} for _, d in transcendental)


def test_the_yardstick_bits_do_not_move_with_threads_or_chunks(monkeypatch) -> None:
    inputs = materialize(FEATURED.with_(dtype="float32", kv_cache_dtype="auto", k_scale=1.0))
    truth = Expected.of(inputs).truth
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = yardstick_attention(inputs, truth)
        torch.set_num_threads(2)
        two = yardstick_attention(inputs, truth)
    finally:
        torch.set_num_threads(threads)
    monkeypatch.setattr(yardstick, "_CHUNK_ELEMENTS", 1)  # one query row at a time
    chunked = yardstick_attention(inputs, truth)
    assert torch.equal(one, two) and torch.equal(one, chunked)


class Reordered(Adapter):
    """A correct reference implementation with its float32 channel sums in ``order``:
    ``naive`` (the yardstick's arithmetic, one order) or ``tiled`` (a tiled online
    softmax, the probabilities rounded before P.V as tensor-core kernels do)."""

    compiles_per_shape = False

    def __init__(self, order: str, form: str) -> None:
        self.order, self.form = order, form
        self.name = f"reordered-{form}-{order}"

    def capabilities(self, device: str) -> Capabilities:
        features = FEATURES if self.form == "naive" else FEATURES - {"empty_kv", "unseen_rows"}
        return Capabilities(devices=frozenset({"cpu"}),
                            dtypes=frozenset({"float32", "float16", "bfloat16"}),
                            modes=frozenset({"decode", "prefill"}), features=features,
                            kv_cache_dtypes=frozenset({"auto", "fp8_e4m3", "fp8_e5m2"}),
                            layouts=frozenset(LAYOUTS) - {"strided_out"})

    def available(self, device: str = "cpu") -> Availability:
        return Availability(True)

    def prepare(self, inputs) -> Prepared:
        if self.form == "naive":
            return Prepared(lambda: naive_attention(inputs, order=self.order))
        return Prepared(lambda: near_correct(inputs, "p_rounded", self.order))


REORDERED = [Reordered(order, form) for form in ("naive", "tiled") for order in SUM_ORDERS]


#: Probes the naive form is not a correct implementation of: its probabilities, rounded to
#: float16 one by one, sum past 1, so outputs near 65504 overflow (FlashAttention's
#: same-precision reference, which rounds them too, would); the yardstick of such a
#: sequence is not finite and the floor alone judges it (harness/verdict/tolerance.py).
NAIVE_OVERFLOWS = ("fp16-near-65504",)


def _probe_cases(adapter: Adapter) -> list[PagedCase]:
    """Every edge probe and the compiled-only pinned probes' shapes (split thresholds, large
    ``sm_scale``), as ``pinned_case`` builds them for ``adapter``; the unsupported skipped."""
    cases = []
    for probe, (kv_lens, num_q_heads, num_kv_heads, fields) in PROBES.items():
        if adapter.form == "naive" and probe in NAIVE_OVERFLOWS:
            continue
        try:
            cases.append(pinned_case(adapter, kv_lens, num_q_heads, num_kv_heads, probe,
                                     **dict(fields)))
        except pytest.skip.Exception:
            continue
    base = pinned_case(adapter, lambda bs: (1,), 4, 2, "pinned")
    cases.append(base.with_(kv_lens=SPLIT_LENGTHS, name="split-lengths"))
    cases.append(base.with_(kv_lens=(3, 40), sm_scale=LARGE_SM_SCALE, name="large-sm-scale"))
    return cases


#: The reordered references every run checks; the rest are ``nightly``.
EVERY_RUN = ("reordered-naive-sequential", "reordered-tiled-blocked16")


@pytest.mark.parametrize("adapter", [
    pytest.param(a, marks=() if a.name in EVERY_RUN else pytest.mark.nightly)
    for a in REORDERED], ids=lambda a: a.name)
def test_reordered_references_pass_every_probe(adapter: Reordered) -> None:
    cases = _probe_cases(adapter)
    # Every probe but strided_out (the stand-ins return their own output) and the two
    # pinned shapes; the tiled form declares no empty_kv and no unseen rows (the empty-kv,
    # unseen-rows and all-degenerate probes).
    left_out = 3 if adapter.form == "tiled" else len(NAIVE_OVERFLOWS)
    assert len(cases) == len(PROBES) + 1 - left_out
    failed = []
    for case in cases:
        verdict = conformance.check(adapter, case, "cpu", probe_nan_tail=False)
        if verdict.status is not Status.PASS:
            failed.append(f"{case.name}: {verdict.status} {verdict.reason}")
    assert not failed, failed


#: Calibration cases per dtype (``python -m pagedbench.harness.calibration.tolerance`` draws 1000).
CALIBRATION_SAMPLE = 12


@pytest.mark.parametrize("dtype", ["float32", pytest.param("float16", marks=pytest.mark.nightly),
                                   pytest.param("bfloat16", marks=pytest.mark.nightly)])
def test_reordered_references_pass_the_calibration_sample(dtype: str) -> None:
    rng = random.Random(f"reordered-{dtype}")
    for _ in range(CALIBRATION_SAMPLE):
        case = random_case(rng, dtype, (1, 2048), seed=rng.randrange(2**31))
        inputs = materialize(case)
        expected = Expected.of(inputs)
        for order in SUM_ORDERS:
            for variant in ("round_once", "p_rounded"):
                out = near_correct(inputs, variant, order)
                comparison = conformance.tolerance.compare(out, expected, dtype,
                                                           inputs.cu_seqlens_q)
                assert comparison.passed, (variant, order, case.to_dict(), comparison.reason)


def test_a_reordered_reference_still_fails_a_low_precision_accumulator() -> None:
    """Reordering widens nothing a fault hides behind: the faulty variant still fails its
    long context in every order."""
    case = random_case(random.Random("long"), "bfloat16", (4096, 8192), seed=7, spread=True)
    inputs = materialize(case)
    expected = Expected.of(inputs)
    for order in SUM_ORDERS:
        out = near_correct(inputs, "low_precision_accumulator", order)
        assert not conformance.tolerance.compare(out, expected, "bfloat16",
                                                 inputs.cu_seqlens_q).passed, order
