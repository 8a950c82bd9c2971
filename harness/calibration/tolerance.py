"""Calibration of the tolerance policy with near-correct implementations written for it.

Each variant computes attention the way some real kernel does, tile by tile with an online
softmax (:data:`TILE` keys at a time), and differs only in where it rounds:

- ``round_once``: float32 math, the output rounded once to nearest (what a careful kernel
  does; for float32 cases the float32 math itself is the variant);
- ``truncate``: float32 math, the output truncated toward zero (vLLM's CPU builds without
  AVX512-BF16 convert float32 to bfloat16 by dropping the low 16 bits);
- ``p_rounded``: the probabilities rounded to the case dtype before they weight V, the sum
  and accumulator in float32 (FlashAttention-style kernels feed P to a tensor-core MMA);
- ``low_precision_accumulator``: the running sum and accumulator kept in the case dtype: a
  fault, which the policy must catch on long contexts.

``python -m pagedbench.harness.calibration.tolerance [--cases N] [--long-cases M] [--seed S]``
draws N random cases per dtype (kv_len log-uniform in 1..8192, every feature, explicit ``sm_scale``
from 1e-3 to 1e3, fp8 caches) and M long-context cases per length band (attention spread over the
context: :func:`random_case` with ``spread=True``), and prints the table docs/tolerance.md quotes.
``suites/harness/calibration/test_tolerance.py`` runs a sample.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pandas as pd
import torch

from pagedbench.reference import DTYPES, PagedCase, PagedInputs, gather_kv, materialize
from pagedbench.reference.dense import dequantize
from pagedbench.reference.yardstick import SUM_ORDERS, naive_logits

from pagedbench.harness.results.store import environment, write_output
from pagedbench.harness.verdict.tolerance import Expected, compare

#: Keys per online-softmax step (vLLM's and pagedbench's Triton decode tiles are 16-64).
TILE = 32
#: Variants that must pass every case, and the one that must fail long contexts.
CORRECT = ("round_once", "truncate", "p_rounded")
FAULTY = "low_precision_accumulator"
VARIANTS = (*CORRECT, FAULTY)
#: kv_len bands of the long-context check (inclusive bounds).
LONG_BANDS = ((1024, 2047), (2048, 4095), (4096, 8192))
MAX_KV_LEN = 8192


def truncate_toward_zero(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` (float32) converted to ``dtype`` rounding toward zero, elementwise.

    Rounds to nearest first, then steps one ulp toward zero where that overshot ``|x|``
    (16-bit formats are sign-magnitude, so one less in the bit pattern is one ulp nearer
    zero). float32 input to float32 is returned unchanged.
    """
    nearest = x.to(dtype)
    if dtype == x.dtype:
        return nearest
    overshot = nearest.to(x.dtype).abs() > x.abs()
    bits = nearest.view(torch.int16)
    return torch.where(overshot, bits - 1, bits).view(dtype)


def _online_softmax(scores: torch.Tensor, v: torch.Tensor, sink: torch.Tensor | None,
                    dtype: torch.dtype, variant: str) -> torch.Tensor:
    """One sequence, ``scores [hq, q_len, kv_len]`` and ``v [kv_len, hq, d]`` in float32,
    tile by tile; returns ``[q_len, hq, d]`` float32 before the final rounding."""
    hq, q_len, kv_len = scores.shape
    keep = dtype if variant == FAULTY else torch.float32  # running sum and accumulator
    p_dtype = dtype if variant in ("p_rounded", FAULTY) else torch.float32
    m = torch.full((hq, q_len, 1), float("-inf")) if sink is None else sink.expand(hq, q_len, 1)
    l = torch.zeros(hq, q_len, 1) if sink is None else torch.ones(hq, q_len, 1)
    acc = torch.zeros(hq, q_len, v.shape[-1])
    for start in range(0, kv_len, TILE):
        s = scores[..., start : start + TILE]  # [hq, q_len, tile]
        m_new = torch.maximum(m, s.amax(-1, keepdim=True))
        alpha = torch.exp(m - m_new).nan_to_num(0.0)  # -inf - -inf: nothing seen yet
        p = torch.exp(s - m_new).nan_to_num(0.0)  # [hq, q_len, tile]
        tile_v = v[start : start + TILE].transpose(0, 1).float()  # [hq, tile, d]
        l = (l * alpha + p.sum(-1, keepdim=True)).to(keep).float()
        acc = (acc * alpha + p.to(p_dtype).float() @ tile_v).to(keep).float()
        m = m_new
    return (acc / l).transpose(0, 1)  # [q_len, hq, d]


def near_correct(inputs: PagedInputs, variant: str, order: str = "blocked16") -> torch.Tensor:
    """The output of ``variant`` (one of :data:`VARIANTS`) for ``inputs``,
    ``Tensor[total_q, num_q_heads, v_head_dim]`` in the case dtype, its float32 logits summed
    over the channels in ``order`` (``reference.yardstick.SUM_ORDERS``; by default as an
    AVX-512 loop's 16 lanes do).

    Raises
    ------
    ValueError
        If ``variant`` is not one of :data:`VARIANTS`.
    PagedValueError
        If ``order`` is not one of ``SUM_ORDERS``.
    """
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    case = inputs.case
    dtype = case.torch_dtype
    cu = inputs.cu_seqlens_q.tolist()
    out = torch.empty(case.total_q, case.num_q_heads, case.v_head_dim, dtype=dtype)
    slopes = inputs.alibi_slopes
    for i, (k, v) in enumerate(gather_kv(inputs)):
        q = inputs.q[cu[i] : cu[i + 1]].float()
        k = dequantize(k, case.k_scale, dtype).float()
        v = dequantize(v, case.v_scale, dtype)
        v = v.repeat_interleave(case.gqa_ratio, dim=1)  # [kv_len, hq, d]
        scores = naive_logits(q, k, case, slopes, order)  # [hq, q_len, kv_len] float32
        sink = None if inputs.sinks is None else inputs.sinks.float()[:, None, None]
        result = _online_softmax(scores, v, sink, dtype, variant)
        rounded = truncate_toward_zero(result, dtype) if variant == "truncate" else result.to(dtype)
        out[cu[i] : cu[i + 1]] = rounded
    return out


def random_case(rng: random.Random, dtype: str, kv_range: tuple[int, int] = (1, MAX_KV_LEN),
                seed: int = 0, spread: bool = False) -> PagedCase:
    """A random case across every axis the policy must hold on: kv_len log-uniform in
    ``kv_range``, decode or prefill, GQA 1..8, sliding windows of 1, 2, block_size +- 1 or
    any, soft caps far below and above the logits, ALiBi, sinks, fp8 caches, ``sm_scale``
    from 1e-3 to 1e3. ``spread=True`` keeps the attention spread over the whole context
    (no window, no ALiBi, ``sm_scale`` at most 0.3): the long-context cases on which a
    low-precision accumulator must be caught."""
    lo, hi = kv_range
    batch = rng.choice((1, 1, 2, 3))
    kv_lens = [min(max(round(math.exp(rng.uniform(math.log(lo), math.log(hi + 0.5)))), lo), hi)
               for _ in range(batch)]
    q_lens = None
    if rng.random() < 0.3:
        q_lens = tuple(rng.randint(1, min(n, 16)) for n in kv_lens)
    num_kv_heads = rng.choice((1, 2))
    block_size = rng.choice((16, 32))
    features: dict[str, object] = {}
    if spread:
        if rng.random() < 0.5:
            features["sm_scale"] = rng.uniform(0.03, 0.3)
    elif rng.random() < 0.4:
        features["sm_scale"] = 10 ** rng.uniform(-3, 3)
    if not spread and rng.random() < 0.3:
        features["sliding_window"] = rng.choice(
            (1, 2, block_size - 1, block_size + 1, rng.randint(1, max(kv_lens))))
    if rng.random() < 0.3:
        features["logits_soft_cap"] = rng.choice((5.0, 30.0, 50.0, 1000.0) if spread else
                                                 (0.5, 5.0, 30.0, 50.0, 1000.0))
    features["alibi"] = not spread and rng.random() < 0.25
    features["sinks"] = rng.random() < 0.25
    if rng.random() < 0.15:
        features |= {"kv_cache_dtype": rng.choice(("fp8_e4m3", "fp8_e5m2")),
                     "k_scale": rng.choice((0.5, 1.0, 2.0)), "v_scale": rng.choice((0.25, 1.0))}
    return PagedCase(kv_lens=tuple(kv_lens), q_lens=q_lens,
                     num_q_heads=num_kv_heads * rng.choice((1, 2, 4, 8)),
                     num_kv_heads=num_kv_heads, head_dim=rng.choice((64, 128)),
                     block_size=block_size, dtype=dtype, seed=seed, name="calib", **features)


def variants_for(dtype: str) -> tuple[str, ...]:
    """The variants that differ at ``dtype``: in float32 the output needs no rounding and the
    math is float32 already, so only ``round_once`` (float32 tiled online softmax) is left."""
    return ("round_once",) if dtype == "float32" else VARIANTS


def compare_variants(case: PagedCase, variants: tuple[str, ...] = VARIANTS,
          orders: tuple[str, ...] = ("blocked16",)) -> dict[tuple[str, str], object]:
    """Verdict figures of every variant on ``case`` with its logits summed in each of
    ``orders``: ``{(variant, order): Comparison}``."""
    inputs = materialize(case)
    expected = Expected.of(inputs)
    return {(variant, order): compare(near_correct(inputs, variant, order), expected,
                                      case.dtype, inputs.cu_seqlens_q)
            for variant in variants for order in orders}


def calibrate(cases: int, long_cases: int, seed: int = 0,
              progress: Callable[[str], None] | None = None,
              orders: tuple[str, ...] = SUM_ORDERS) -> pd.DataFrame:
    """One row per (dtype, case set, variant, channel order of the logits): pass rate,
    cases, largest err/allowance, largest error in ulps and mean signed error in ulps (the
    bias)."""
    rows = []
    rng = random.Random(seed)
    sets = [("random 1..8192", (1, MAX_KV_LEN), cases, False)]
    sets += [(f"kv {lo}..{hi}", (lo, hi), long_cases, True) for lo, hi in LONG_BANDS]
    for dtype in DTYPES:
        for label, kv_range, count, spread in sets:
            if count == 0:
                continue
            results: dict[tuple[str, str], list] = {
                (v, o): [] for v in variants_for(dtype) for o in orders}
            started = time.monotonic()
            for _ in range(count):
                case = random_case(rng, dtype, kv_range, rng.randrange(2**31), spread)
                for key, comparison in compare_variants(case, variants_for(dtype), orders).items():
                    results[key].append(comparison)
            if progress:
                progress(f"{dtype} {label}: {count} cases in {time.monotonic() - started:.0f} s")
            for (variant, order), comps in results.items():
                rows.append({
                    "dtype": dtype, "cases": label, "variant": variant, "order": order,
                    "n": len(comps),
                    "pass_rate": sum(c.passed for c in comps) / len(comps),
                    "max_err_over_allowance": max(c.err_over_allowance for c in comps),
                    "max_err_ulps": max(c.max_err_ulps for c in comps),
                    "mean_err_ulps": sum(c.mean_err_ulps for c in comps) / len(comps),
                })
    return pd.DataFrame(rows)


def main(argv: list[str] | None = None) -> int:
    """Print the calibration table (Markdown); exit 1 when a correct variant failed a case
    or the faulty one passed more than 1% of the kv >= 4096 cases."""
    parser = argparse.ArgumentParser(prog="python -m pagedbench.harness.calibration.tolerance",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=1000, help="random cases per dtype")
    parser.add_argument("--long-cases", type=int, default=100,
                        help="cases per dtype in each long-context band")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path, default=None,
                        help="also write the table to this Markdown file, headed by the "
                             "command and the environment it ran in")
    args = parser.parse_args(argv)
    table = calibrate(args.cases, args.long_cases, args.seed,
                      progress=lambda line: print(line, file=sys.stderr, flush=True))
    markdown = table.to_markdown(index=False, floatfmt=".3g")
    print(markdown)
    if args.output is not None:
        command = " ".join(["python -m pagedbench.harness.calibration.tolerance",
                            *(argv if argv is not None else sys.argv[1:])])
        env = json.dumps(environment("cpu"), indent=2)
        write_output(args.output, f"# Tolerance calibration\n\n`{command}`\n\n"
                                  f"```json\n{env}\n```\n\n{markdown}\n")
    correct = table[table["variant"].isin(CORRECT)]
    faulty_long = table[(table["variant"] == FAULTY) & (table["cases"] == "kv 4096..8192")
                        & (table["dtype"] != "float32")]
    ok = bool((correct["pass_rate"] == 1.0).all()) and bool((faulty_long["pass_rate"] <= 0.01).all())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
