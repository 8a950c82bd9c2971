"""Pinned probes: the thresholds a random search rarely hits, placed on purpose for every
implementation. Each probe is one case at the smallest block size and head dim the
implementation takes (``pinned_case``), judged by the same check as the search, and skipped
only where the implementation declares the case unsupported.

- long contexts in 16-bit types (kv_len 4096: low-precision accumulation shows there);
- lengths just around the split thresholds kernels use (128, 256, 512, 1024 +- 1..3);
- logits far from 0 (``sm_scale`` 1e4: rows whose every logit lies below -5e4);
- batches like production: 17, 64 and 257 ragged sequences (one past a per-sequence
  table of 16 and of 256), a chunk of a few tokens in one sequence of eight where the
  implementation takes prefill rows.

The other edges (sliding windows of 1, 2 and block_size +- 1, block ids past 32767 and
65535, degenerate rows, layouts, shapes) are probed in ``test_edges``.

Interpreted kernels (the Triton interpreter on the CPU) skip the long-context and
split-threshold probes, and the batches of 64 and 257 sequences: seconds to minutes per
case there (every sequence is a program run in Python); a GPU runs them.
"""

from __future__ import annotations

import pytest

from pagedbench.adapters import Adapter
from pagedbench.reference import PagedCase
from pagedbench.suites import peer_findings

from .conftest import DEVICE
from .cases import pinned_case

#: Split thresholds of paged kernels (vLLM's PARTITION_SIZE 512, flash-decoding chunk
#: sizes 128..1024) and the lengths around them.
SPLIT_LENGTHS = (125, 129, 254, 259, 511, 513, 1021, 1027)
LONG_KV_LEN = 4096
LARGE_SM_SCALE = 1e4
#: Sequences of the batches like production.
MANY_SEQUENCES = (17, 64, 257)
#: One sequence in this many of them is a chunk of :data:`CHUNK` new tokens (a chunked
#: prefill or a speculative decode beside the decodes), where prefill rows are declared.
CHUNK_ONE_IN, CHUNK = 8, 4


def probe(adapter: Adapter, name: str, kv_lens, *, interpreted_ok: bool = True,
          **fields) -> PagedCase:
    """``pinned_case`` with ``kv_lens(block_size)`` and ``fields`` changed; skips where
    the adapter declares the result unsupported (or runs interpreted, unless
    ``interpreted_ok``)."""
    if not interpreted_ok and adapter.is_interpreted(DEVICE):
        pytest.skip(f"{adapter.name} runs interpreted on {DEVICE}: seconds to minutes per case")
    base = pinned_case(adapter, lambda bs: (1,), 4, 2, name)
    case = base.with_(kv_lens=kv_lens(base.block_size), **fields)
    reasons = adapter.why_unsupported(case, DEVICE)
    if reasons:
        pytest.skip(f"{adapter.name}: {'; '.join(reasons)}")
    return case


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_long_context_in_16_bit(adapter, impl, dtype, pytestconfig) -> None:
    """kv_len 4096 (256 blocks of 16) in a 16-bit type: an accumulator or softmax sum
    kept in that type drifts past the tolerance here."""
    case = probe(adapter, "long", lambda bs: (LONG_KV_LEN,), interpreted_ok=False,
                 dtype=dtype)
    peer_findings.check_conformance(adapter, case, DEVICE, impl, f"long-context-{dtype}",
                                    pytestconfig.rootpath)


def test_lengths_around_split_thresholds(adapter, impl, pytestconfig) -> None:
    """One decode batch with a sequence just below and just above 128, 256, 512 and 1024
    keys, where split-KV kernels change how many partitions they merge."""
    case = probe(adapter, "splits", lambda bs: SPLIT_LENGTHS, interpreted_ok=False)
    peer_findings.check_conformance(adapter, case, DEVICE, impl, "split-thresholds",
                                    pytestconfig.rootpath)


def test_logits_far_from_zero(adapter, impl, pytestconfig) -> None:
    """``sm_scale`` 1e4 in float32: logits of +-1e5, so some rows see only logits below
    -5e4, where a finite masking sentinel underflows to zero weight everywhere."""
    case = probe(adapter, "logits", lambda bs: (1, 2, bs + 1), dtype="float32",
                 sm_scale=LARGE_SM_SCALE)
    peer_findings.check_conformance(adapter, case, DEVICE, impl, "logits-far-from-zero",
                                    pytestconfig.rootpath)


def ragged_lengths(batch: int, block_size: int) -> tuple[int, ...]:
    """``batch`` KV lengths stepping by ``block_size + 1`` through 1 to ``2 * block_size +
    3`` (coprime, so every length appears before any repeats): neighbours differ by about
    a block, and every block boundary (``block_size - 1``, ``block_size``, ``+ 1``) is
    among them."""
    span = 2 * block_size + 3
    return tuple(1 + (i * (block_size + 1)) % span for i in range(batch))


@pytest.mark.parametrize("batch", MANY_SEQUENCES)
def test_many_ragged_sequences(adapter, impl, batch, pytestconfig) -> None:
    """A batch of ``batch`` sequences of ragged lengths, one KV head: a kernel keeping
    per-sequence state in a fixed table (work lists, split counts, a scratch slot per
    sequence) is right up to its size and wrong past it."""
    case = probe(adapter, f"many-{batch}", lambda bs: ragged_lengths(batch, bs),
                 interpreted_ok=batch <= MANY_SEQUENCES[0], num_q_heads=4, num_kv_heads=1)
    if "prefill" in adapter.capabilities(DEVICE).modes:
        q_lens = tuple(min(CHUNK, kv) if i % CHUNK_ONE_IN == CHUNK_ONE_IN - 1 else 1
                       for i, kv in enumerate(case.kv_lens))
        case = case.with_(q_lens=q_lens)
        if adapter.why_unsupported(case, DEVICE):
            pytest.skip(f"{adapter.name}: {'; '.join(adapter.why_unsupported(case, DEVICE))}")
    peer_findings.check_conformance(adapter, case, DEVICE, impl, f"many-sequences-{batch}",
                                    pytestconfig.rootpath)
