"""Benchmark workloads: what a batch holds, independent of how its KV cache is paged.

A :class:`Workload` fixes the query and KV lengths of every sequence, the heads and the
head_dim; :meth:`Workload.case` pages it at a block size and dtype. Lengths are a function
of the workload alone, never of the block size, so every block size sees the same batch
and a row of the sweep reads "how does block size change the time".

Workloads come from four places:

- the grid: mode x GQA layout x batch size x context length (:func:`grid_workload`);
- vLLM's batch-spec strings (``benchmarks/attention_benchmarks/batch_spec.py``):
  underscore-separated segments ``[count]q<q_len>[k][s<kv_len>[k]]``, ``k`` = x1024,
  ``kv_len`` defaulting to ``q_len`` (:func:`parse_batch_spec`); ``8q1s1k`` is eight
  decodes over 1024 tokens, ``2q2k_32q1s1k`` two 2048-token prefills and 32 decodes; its
  production-mix configs' odd residual lengths are the same grammar
  (``q257_7q1s1057_3q4s2051_2q129s4093``: a 257-token prefill, 7 decodes over 1057, 3
  four-token speculative decodes over 2051, 2 129-token chunks over 4093);
- batch traces (:mod:`.batch_trace`): one step of a serving engine, or of
  ``pagedbench simulate``, a line;
- model presets (:data:`~.presets.MODEL_PRESETS`): a ragged decode batch, lengths drawn
  log-uniformly from the workload's own seed (:func:`preset_workload`).

Modes: ``decode`` (one query token per sequence), ``prefill`` (``q_len == kv_len``),
``chunked`` (a chunk of ``kv_len // 4`` new tokens over a partly cached context, as in
chunked prefill) and ``mixed`` (a quarter of the batch chunked prefills, the rest decodes,
as a continuous-batching step). Grid workloads are named ``<mode>-<layout>-<batch spec>``.
"""

from __future__ import annotations

import re
import zlib
from dataclasses import dataclass

from pagedbench.reference import PagedCase, PagedValueError

from pagedbench.harness.cases.presets import MODEL_PRESETS, draw_kv_lens

MODES = ("decode", "prefill", "chunked", "mixed")
#: Query heads of the grid's synthetic layouts, and their head_dim (Llama-3-8B's).
GRID_NUM_Q_HEADS = 32
GRID_HEAD_DIM = 128
#: Query heads per KV head of the synthetic layouts; a preset name is a layout too.
LAYOUT_RATIOS = {"mha": 1, "gqa4": 4, "gqa8": 8, "mqa": GRID_NUM_Q_HEADS}
#: Bounds of one benchmark batch, checked before anything is allocated for it. A real GPU
#: batch lies far inside them: vLLM's largest default ``max_num_seqs`` is 1024 sequences,
#: the longest served context windows are 1M tokens, and vLLM's KV pool for an 8B model
#: on an 80 GB H100 holds about 0.5M tokens. The bounds are 16x (sequences), 1x (one
#: sequence's length) and 32x (the batch's KV tokens) those: room for larger devices, never
#: a batch no device could hold.
MAX_BATCH_SEQUENCES = 16 * 1024
MAX_SEQ_LEN = 1024 * 1024
MAX_BATCH_KV_TOKENS = 16 * 1024 * 1024
BATCH_BOUNDS = (f"at most {MAX_BATCH_SEQUENCES} sequences, each q_len and kv_len at most "
                f"{MAX_SEQ_LEN} (1024k), at most {MAX_BATCH_KV_TOKENS} KV tokens in all")
#: The grammar, for error messages.
BATCH_SPEC_GRAMMAR = ("underscore-separated segments [count]q<q_len>[k][s<kv_len>[k]] "
                      "(k = x1024; kv_len defaults to q_len), e.g. 8q1s1k or 2q2k_32q1s1k")
_SEGMENT = re.compile(r"(\d*)q(\d+)(k?)(?:s(\d+)(k?))?")


def parse_batch_spec(spec: str) -> tuple[tuple[int, int], ...]:
    """The ``(q_len, kv_len)`` of every sequence of a vLLM batch-spec string, in order.

    Raises
    ------
    PagedValueError
        Naming ``batch_spec``: a segment outside :data:`BATCH_SPEC_GRAMMAR`, a count or
        length of 0, ``q_len > kv_len`` (a query token must be in the cache), or a batch
        past :data:`BATCH_BOUNDS` (checked before the batch is built).
    """
    if not isinstance(spec, str) or not spec:
        raise PagedValueError("batch_spec", spec, BATCH_SPEC_GRAMMAR)
    sequences: list[tuple[int, int]] = []
    kv_tokens = 0
    for segment in spec.split("_"):  # vLLM's grammar, production-mix specs included
        match = _SEGMENT.fullmatch(segment)
        if match is None:
            raise PagedValueError("batch_spec", spec, BATCH_SPEC_GRAMMAR,
                                  f"batch_spec {spec!r}: segment {segment!r} is not "
                                  f"{BATCH_SPEC_GRAMMAR}")
        count_text, q_text, q_k, kv_text, kv_k = match.groups()
        count = _number(count_text, 1) if count_text else 1
        q_len = _number(q_text, 1024 if q_k else 1)
        kv_len = _number(kv_text, 1024 if kv_k else 1) if kv_text else q_len
        kv_tokens += count * kv_len
        if (len(sequences) + count > MAX_BATCH_SEQUENCES or max(q_len, kv_len) > MAX_SEQ_LEN
                or kv_tokens > MAX_BATCH_KV_TOKENS):
            raise PagedValueError("batch_spec", spec, BATCH_BOUNDS,
                                  f"batch_spec {spec!r}: segment {segment!r} is past the "
                                  f"bounds of one batch ({BATCH_BOUNDS}; no GPU batch is "
                                  "that large)")
        if count < 1 or q_len < 1:
            raise PagedValueError("batch_spec", spec, "counts and lengths >= 1",
                                  f"batch_spec {spec!r}: segment {segment!r} has a count or "
                                  "length of 0")
        if q_len > kv_len:
            raise PagedValueError("batch_spec", spec, "q_len <= kv_len in every segment",
                                  f"batch_spec {spec!r}: segment {segment!r} has q_len "
                                  f"{q_len} > kv_len {kv_len}")
        sequences += [(q_len, kv_len)] * count
    return tuple(sequences)


def check_sequences(sequences: tuple[tuple[int, int], ...], parameter: str,
                    where: str) -> None:
    """Check ``(q_len, kv_len)`` pairs against :data:`BATCH_BOUNDS` (before anything is
    allocated for them).

    Raises
    ------
    PagedValueError
        Naming ``parameter`` and ``where`` (a file and step, say) for a batch past the
        bounds of one batch.
    """
    if (len(sequences) > MAX_BATCH_SEQUENCES
            or max(max(q, kv) for q, kv in sequences) > MAX_SEQ_LEN
            or sum(kv for _, kv in sequences) > MAX_BATCH_KV_TOKENS):
        raise PagedValueError(parameter, where, BATCH_BOUNDS,
                              f"{parameter} {where}: {len(sequences)} sequences of "
                              f"{sum(kv for _, kv in sequences)} KV tokens are past the bounds "
                              f"of one batch ({BATCH_BOUNDS}; no GPU batch is that large)")


def _number(digits: str, scale: int) -> int:
    """``digits`` times ``scale``; digits too many to be a size count as past every bound
    (``int`` refuses strings over 4300 digits)."""
    return int(digits) * scale if len(digits) <= 18 else MAX_BATCH_KV_TOKENS * 1024


def _size(tokens: int) -> str:
    return f"{tokens // 1024}k" if tokens % 1024 == 0 else str(tokens)


def format_batch_spec(sequences: tuple[tuple[int, int], ...]) -> str:
    """The shortest batch-spec string of ``sequences`` (runs of equal sequences become one
    segment); :func:`parse_batch_spec` inverts it."""
    segments: list[str] = []
    run: list[tuple[int, int]] = []
    for seq in [*sequences, None]:
        if run and seq != run[-1]:
            q_len, kv_len = run[-1]
            count = str(len(run)) if len(run) > 1 else ""
            seq_part = "" if kv_len == q_len else f"s{_size(kv_len)}"
            segments.append(f"{count}q{_size(q_len)}{seq_part}")
            run = []
        if seq is not None:
            run.append(seq)
    return "_".join(segments)


def mode_of(sequences: tuple[tuple[int, int], ...]) -> str:
    """``decode`` (every q_len 1), ``prefill`` (every q_len == kv_len > 1), ``chunked``
    (every q_len in (1, kv_len)), else ``mixed``."""
    if all(q == 1 for q, _ in sequences):
        return "decode"
    if all(q == kv and q > 1 for q, kv in sequences):
        return "prefill"
    if all(1 < q < kv for q, kv in sequences):
        return "chunked"
    return "mixed"


@dataclass(frozen=True)
class Workload:
    """One batch of sequences to benchmark, before paging.

    Attributes
    ----------
    name : str
        Stable id; leads the case id of every point, so points match across runs.
    q_lens, kv_lens : tuple[int, ...]
        Query and KV tokens per sequence, ``[batch]``.
    num_q_heads, num_kv_heads, head_dim : int
    layout : str
        ``mha``, ``gqa4``, ``gqa8``, ``mqa`` or the preset whose heads it has.
    mode : str
        One of :data:`MODES`.
    batch_spec : str or None
        The vLLM batch-spec string of the lengths (None for a ragged preset batch).
    head_dim_v : int or None
        V's head dim where it differs from ``head_dim`` (an MLA preset's), else None.
    """

    name: str
    q_lens: tuple[int, ...]
    kv_lens: tuple[int, ...]
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    layout: str
    mode: str
    batch_spec: str | None
    head_dim_v: int | None = None

    @property
    def batch_size(self) -> int:
        return len(self.kv_lens)

    @property
    def context(self) -> int:
        """The longest KV length (tokens)."""
        return max(self.kv_lens)

    @property
    def seed(self) -> int:
        """Seeds the values and block placement: the CRC-32 of the name, so it is the
        same in every run and for every block size."""
        return zlib.crc32(self.name.encode())

    def contiguous_block_size(self, multiple: int = 16) -> int:
        """The smallest multiple of ``multiple`` holding the longest sequence in one block:
        paged at it, every sequence's K and V are contiguous (one block-table entry)."""
        return multiple * -(-self.context // multiple)

    def case(self, block_size: int, dtype: str, tag: str = "") -> PagedCase:
        """This workload paged at ``block_size`` in ``dtype`` (raises ``PagedValueError``
        for an invalid block size or dtype)."""
        decode = all(q == 1 for q in self.q_lens)
        return PagedCase(kv_lens=self.kv_lens, q_lens=None if decode else self.q_lens,
                         num_q_heads=self.num_q_heads, num_kv_heads=self.num_kv_heads,
                         head_dim=self.head_dim, head_dim_v=self.head_dim_v,
                         block_size=block_size, dtype=dtype, seed=self.seed, name=self.name,
                         tag=tag)


def layout_heads(layout: str) -> tuple[int, int, int]:
    """``(num_q_heads, num_kv_heads, head_dim)`` of a layout name.

    Raises
    ------
    PagedValueError
        If ``layout`` is neither in :data:`LAYOUT_RATIOS` nor a preset name.
    """
    if layout in LAYOUT_RATIOS:
        return GRID_NUM_Q_HEADS, GRID_NUM_Q_HEADS // LAYOUT_RATIOS[layout], GRID_HEAD_DIM
    if layout in MODEL_PRESETS:
        preset = MODEL_PRESETS[layout]
        return preset.num_q_heads, preset.num_kv_heads, preset.head_dim
    raise PagedValueError("layout", layout, f"one of {[*LAYOUT_RATIOS, *MODEL_PRESETS]}")


def spec_workload(spec: str, layout: str) -> Workload:
    """The workload of a vLLM batch-spec string with the heads of ``layout``, named
    ``<mode>-<layout>-<spec>`` (raises ``PagedValueError`` as :func:`parse_batch_spec`
    and :func:`layout_heads`)."""
    sequences = parse_batch_spec(spec)
    num_q_heads, num_kv_heads, head_dim = layout_heads(layout)
    canonical = format_batch_spec(sequences)
    mode = mode_of(sequences)
    return Workload(name=f"{mode}-{layout}-{canonical}",
                    q_lens=tuple(q for q, _ in sequences),
                    kv_lens=tuple(kv for _, kv in sequences), num_q_heads=num_q_heads,
                    num_kv_heads=num_kv_heads, head_dim=head_dim, layout=layout, mode=mode,
                    batch_spec=canonical)


def grid_batch_spec(mode: str, batch_size: int, context: int) -> str:
    """The batch-spec string of a grid point (see the module docstring for the modes).

    Raises
    ------
    PagedValueError
        For an unknown mode, a batch size or context < 1, a batch past
        :data:`BATCH_BOUNDS`, a ``mixed`` batch of one sequence, or a
        ``chunked``/``mixed`` context below 8 (no chunk of a quarter).
    """
    if mode not in MODES:
        raise PagedValueError("mode", mode, f"one of {list(MODES)}")
    for name, value in (("batch_size", batch_size), ("context", context)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise PagedValueError(name, value, "an int >= 1")
    if (batch_size > MAX_BATCH_SEQUENCES or context > MAX_SEQ_LEN
            or batch_size * context > MAX_BATCH_KV_TOKENS):
        raise PagedValueError("batch_size", batch_size, BATCH_BOUNDS,
                              f"batch_size {batch_size} x context {context} is past the "
                              f"bounds of one batch ({BATCH_BOUNDS}; no GPU batch is that "
                              "large)")
    chunk = context // 4
    if mode in ("chunked", "mixed") and chunk < 2:
        raise PagedValueError("context", context, f">= 8 for mode {mode!r} (a chunk of a "
                              "quarter of it, at least 2 tokens)")
    if mode == "decode":
        return format_batch_spec(((1, context),) * batch_size)
    if mode == "prefill":
        return format_batch_spec(((context, context),) * batch_size)
    if mode == "chunked":
        return format_batch_spec(((chunk, context),) * batch_size)
    if batch_size < 2:
        raise PagedValueError("batch_size", batch_size, ">= 2 for mode 'mixed' (chunked "
                              "prefills and decodes)")
    prefills = max(1, batch_size // 4)
    return format_batch_spec(((chunk, context),) * prefills
                             + ((1, context),) * (batch_size - prefills))


def grid_workload(mode: str, layout: str, batch_size: int, context: int) -> Workload:
    """The grid's workload at (mode, layout, batch size, context)."""
    return spec_workload(grid_batch_spec(mode, batch_size, context), layout)


def preset_workload(preset: str, batch_size: int, max_kv_len: int) -> Workload:
    """A ragged decode batch with ``preset``'s heads: ``1``, ``max_kv_len`` and
    log-uniform draws (:func:`~.presets.draw_kv_lens` without block-size boundaries),
    seeded by the workload's name, so the same in every run and at every block size.

    Raises
    ------
    PagedValueError
        For an unknown preset, or a batch size or length below 1.
    """
    num_q_heads, num_kv_heads, head_dim = layout_heads(preset)
    for name, value in (("batch_size", batch_size), ("max_kv_len", max_kv_len)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise PagedValueError(name, value, "an int >= 1")
    name = f"decode-{preset}-ragged-b{batch_size}-kv{_size(max_kv_len)}"
    kv_lens = draw_kv_lens(batch_size, max_kv_len, None, zlib.crc32(name.encode()))
    return Workload(name=name, q_lens=(1,) * batch_size, kv_lens=kv_lens,
                    num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                    layout=preset, mode="decode", batch_spec=None,
                    head_dim_v=MODEL_PRESETS[preset].head_dim_v)


#: The ``suite`` of results written by ``pagedbench bench``.
BENCH_SUITE = "bench"
#: The implementation bench's speedups are measured against unless another is named.
DEFAULT_BASELINE = "sdpa-contiguous"
#: The tag of a workload's point at its contiguous block size (one block per sequence).
CONTIGUOUS_TAG = "contig"


def workload_fields(case: PagedCase, suite: str) -> dict[str, str | None]:
    """The record fields naming the workload of ``case`` in a ``suite``: in a bench run
    (:data:`BENCH_SUITE`) its name (the case's), mode and batch-spec string, all derived
    from the case; None for every other suite."""
    if suite != BENCH_SUITE:
        return {"workload": None, "bench_mode": None, "batch_spec": None}
    sequences = tuple(zip(case.q_lens_or_decode, case.kv_lens))
    return {"workload": case.name, "bench_mode": mode_of(sequences),
            "batch_spec": format_batch_spec(sequences)}


__all__ = ["BATCH_BOUNDS", "BATCH_SPEC_GRAMMAR", "BENCH_SUITE", "CONTIGUOUS_TAG",
           "DEFAULT_BASELINE", "LAYOUT_RATIOS", "MAX_BATCH_KV_TOKENS", "MAX_BATCH_SEQUENCES",
           "MAX_SEQ_LEN", "MODES", "Workload", "check_sequences", "format_batch_spec",
           "grid_batch_spec", "grid_workload", "layout_heads", "mode_of", "parse_batch_spec",
           "preset_workload", "spec_workload", "workload_fields"]
