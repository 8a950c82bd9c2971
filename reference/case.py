"""What a paged-attention problem is: :class:`PagedCase`.

A case fixes every axis that changes the math or the memory layout (lengths, heads,
head_dim, block_size, dtype, masking options) plus the seed that fixes the values.
It is frozen, hashable and JSON-serialisable (:meth:`PagedCase.to_dict`), so a case
can travel to a worker process, into a result record, and back into a replay.
"""

from __future__ import annotations

import math
from dataclasses import MISSING, asdict, dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any

from .axes import (DTYPES, KV_CACHE_DTYPES, LAYOUTS, MAX_LOGIT_OFFSET, POISONS, as_int,
                   check_one_of, int_tuple, positive_finite, torch_dtype)
from .errors import PagedTypeError, PagedValueError

if TYPE_CHECKING:
    import torch

#: Short names of the dtypes and fp8 cache types in case ids.
_TAGS = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "fp8_e4m3": "fp8e4m3",
         "fp8_e5m2": "fp8e5m2"}


def _range_tag(values: tuple[int, ...]) -> str:
    lo, hi = min(values), max(values)
    return f"{lo}" if lo == hi else f"{lo}..{hi}"


@dataclass(frozen=True)
class PagedCase:
    """One batch of sequences attending to a paged KV cache.

    Parameters
    ----------
    kv_lens : tuple[int, ...]
        Tokens in each sequence's KV cache, ``[batch]``, each >= 0. The query tokens of
        a sequence are its last ``q_lens[i]`` positions: query ``j`` sits at position
        ``kv_lens[i] - q_lens[i] + j`` and sees the keys at positions ``<=`` it (causal,
        aligned bottom-right, FlashAttention's convention).
    q_lens : tuple[int, ...] or None
        Query tokens per sequence, ``[batch]``, each >= 0; ``None`` means decode (1 each).
        Degenerate entries are allowed, as serving engines pad CUDA-graph batches with
        them: ``kv_lens[i] == 0`` (feature ``"empty_kv"``), ``q_lens[i] == 0`` (no rows,
        ``"empty_q"``), ``q_lens[i] > kv_lens[i] > 0`` (the first ``q_lens[i] -
        kv_lens[i]`` rows sit before position 0, ``"unseen_rows"``). A query row that
        sees no key has output 0 (a sink, having no value, leaves it 0).
    num_q_heads, num_kv_heads : int
        Query and KV heads; ``num_q_heads % num_kv_heads == 0``. Query head ``h`` reads
        KV head ``h // (num_q_heads // num_kv_heads)`` (GQA; MQA when num_kv_heads is 1).
    head_dim : int
        Channels per head of Q and K (and of V unless ``head_dim_v`` is set).
    head_dim_v : int or None
        Channels per head of V and the output when they differ from ``head_dim`` (MLA:
        DeepSeek-V3's latent cache has 576 for Q/K and 512 for V, with one KV head;
        feature ``"head_dim_v"``). ``None`` (or ``head_dim``) means the same.
    block_size : int
        Tokens per KV block (page).
    dtype : str
        One of :data:`~.axes.DTYPES` (``"float32"``, ``"float16"``, ``"bfloat16"``): Q, K, V, O.
    sm_scale : float or None
        Softmax scale applied to ``q @ k``; ``None`` means ``1 / sqrt(head_dim)``. At most
        :data:`~.axes.MAX_SCALE`, like ``logits_soft_cap``, ``k_scale`` and ``v_scale``.
    sliding_window : int or None
        If set, a query at absolute position ``p`` sees keys ``p - W + 1 .. p`` (vLLM's
        and FlashAttention's convention: ``window_size = (W - 1, 0)``).
    logits_soft_cap : float or None
        If set, scaled logits ``s`` become ``c * tanh(s / c)`` (Gemma-2; FlashInfer and
        vLLM apply the cap after scaling).
    num_blocks : int or None
        Blocks in the pool; ``None`` means ``min_block_id`` plus what the lengths need
        plus 25% spare (at least 4 spare blocks), so that tables can be scattered over a
        larger pool.
    min_block_id : int
        Every block the sequences and the table padding use has an id ``>=`` this; the
        blocks below it stay unused (poisoned). Places a batch past the ids where a
        16-bit table entry wraps (32767 signed, 65535 unsigned) or where ``block *
        block_stride`` passes 2**31 elements, which a random placement in a big pool
        rarely reaches. 0 by default.
    shared_blocks : tuple[int, ...] or None
        Physical blocks shared between sequences, ``[batch]``: sequence ``i``'s first
        ``shared_blocks[i]`` logical blocks are sequence ``i - 1``'s own physical blocks
        (the same ids in both tables, hence the same K and V), as prefix caching shares a
        common prompt and a beam-search fork shares all but its last block (Kwon et al.,
        SOSP 2023, s. 4.4; vLLM's ``docs/design/prefix_caching.md``). Entry 0 is 0; only
        full blocks are shared: ``shared_blocks[i] * block_size <= min(kv_lens[i - 1],
        kv_lens[i])``. Chains share further back: ``(0, 2, 2)`` puts the first two blocks
        of all three sequences in the same two physical blocks. The truth is unchanged: a
        sequence's logical K/V is what its table points to. ``None`` (or all zeros): every
        sequence has its own blocks.
    latent_cache : bool
        MLA's one latent cache: V is the first ``head_dim_v`` channels of K (DeepSeek-V3's
        ``c_kv``, kv_lora_rank 512, then the 64-channel RoPE key: vLLM's
        ``kv_c_and_k_pe_cache``, FlashInfer's ``ckv``/``kpe``). Needs ``head_dim_v <
        head_dim``, ``v_magnitude`` 1.0 and ``v_scale == k_scale``. MLA kernels read V
        from K's storage; any other kernel takes the case as any other.
    seed : int
        Seeds the values of Q, K, V and the block placement.
    name : str
        Model or workload label that leads the case id, e.g. ``"llama3.1-8b"``.
    tag : str
        Suffix for the case id, e.g. ``"reduced"`` for a cut-down form of a preset.
    alibi : bool
        Add ALiBi biases (Press et al., "Train Short, Test Long", ICLR 2022): to the
        (scaled, soft-capped) logit of query position ``i`` and key position ``j <= i``
        add ``-slope[h] * (i - j)``, with the standard geometric slopes of
        :func:`~pagedbench.reference.inputs.alibi_slopes` per query head. This is vLLM's
        convention (``tests/kernels/attention/test_cpu_attn.py``) and FlashAttention's
        (``flash_attn_func``: "-alibi_slope * |i + seqlen_k - seqlen_q - j|").
    sinks : bool
        Give each query head one learned "sink" logit that joins the softmax denominator
        and contributes no value (gpt-oss; vLLM's ``s_aux``, FlashInfer's ``sinks``).
        The values are drawn from the seed (see
        :func:`~pagedbench.reference.inputs.materialize`).
    kv_cache_dtype : str
        One of :data:`~.axes.KV_CACHE_DTYPES`: ``"auto"`` (K and V in ``dtype``),
        ``"fp8_e4m3"`` or ``"fp8_e5m2"`` (quantized with ``k_scale`` and ``v_scale``).
    k_scale, v_scale : float
        Per-tensor dequantization scales of an fp8 cache: the stored value ``s`` means
        ``s * k_scale`` (vLLM's ``k_scale``/``v_scale``). Must be 1.0 when
        ``kv_cache_dtype`` is ``"auto"``.
    qk_magnitude, v_magnitude : float
        Standard deviation of the Q and K draws, and of the V draws (1.0: unit normal);
        draws past the dtype's largest finite value are clamped to it, so float16 cases
        can hold magnitudes near 65504. Large ``qk_magnitude`` puts the logits far from 0
        in both signs.
    logit_offset : float
        Shifts every scaled logit of a query by about this much (channel 0 of every Q
        and K row is set to ``sqrt(|offset| / scale)``, with the sign of the offset on
        Q's), leaving the softmax unchanged in exact arithmetic: large positive offsets
        overflow a softmax that does not subtract its maximum, large negative ones fall
        below the finite mask values some kernels use instead of ``-inf``. ``|offset| <=``
        :data:`~.axes.MAX_LOGIT_OFFSET`.
    layout : str
        One of :data:`~.axes.LAYOUTS`: how the tensors lie in memory (never their values).
    poison : str
        One of :data:`~.axes.POISONS`: what fills every slot without a live token, the padding
        block and whatever the layout allocates around the tensors (never the truth).

    Raises
    ------
    PagedTypeError
        On a field of the wrong type (bools are not ints; strings are not numbers).
    PagedValueError
        On any inconsistent or out-of-range field, naming it and the allowed values.
    """

    kv_lens: tuple[int, ...]
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str = "bfloat16"
    q_lens: tuple[int, ...] | None = None
    sm_scale: float | None = None
    sliding_window: int | None = None
    logits_soft_cap: float | None = None
    num_blocks: int | None = None
    seed: int = 0
    name: str = "case"
    tag: str = field(default="", compare=True)
    alibi: bool = False
    sinks: bool = False
    kv_cache_dtype: str = "auto"
    k_scale: float = 1.0
    v_scale: float = 1.0
    head_dim_v: int | None = None
    min_block_id: int = 0
    qk_magnitude: float = 1.0
    v_magnitude: float = 1.0
    logit_offset: float = 0.0
    layout: str = "contiguous"
    poison: str = "nan"
    shared_blocks: tuple[int, ...] | None = None
    latent_cache: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "kv_lens", int_tuple("kv_lens", self.kv_lens))
        if self.q_lens is not None:
            object.__setattr__(self, "q_lens", int_tuple("q_lens", self.q_lens))
        if self.shared_blocks is not None:
            shared = int_tuple("shared_blocks", self.shared_blocks)
            object.__setattr__(self, "shared_blocks", shared if any(shared) else None)
            if len(shared) != len(self.kv_lens):
                raise PagedValueError(
                    "shared_blocks", shared, f"{len(self.kv_lens)} entries, one per kv_lens",
                    f"shared_blocks has {len(shared)} entries but kv_lens has "
                    f"{len(self.kv_lens)}")
        for name in ("num_q_heads", "num_kv_heads", "head_dim", "block_size", "seed",
                     "sliding_window", "num_blocks", "head_dim_v", "min_block_id"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, as_int(name, getattr(self, name)))
        if self.head_dim_v == self.head_dim:
            object.__setattr__(self, "head_dim_v", None)
        for name in ("name", "tag"):
            if not isinstance(getattr(self, name), str):
                raise PagedTypeError(name, getattr(self, name), "a str")
        if not 0 <= self.seed < 2**63:
            raise PagedValueError("seed", self.seed, "in [0, 2**63)")
        for name in ("sm_scale", "logits_soft_cap"):
            if getattr(self, name) is not None:
                positive_finite(name, getattr(self, name), "None or a finite number > 0")
        if not self.kv_lens or min(self.kv_lens) < 0:
            raise PagedValueError("kv_lens", self.kv_lens, "at least one sequence, all >= 0")
        if self.q_lens is not None:
            if len(self.q_lens) != len(self.kv_lens):
                raise PagedValueError(
                    "q_lens", self.q_lens, f"{len(self.kv_lens)} entries, one per kv_lens",
                    f"q_lens has {len(self.q_lens)} entries but kv_lens has {len(self.kv_lens)}")
            bad = [i for i, q in enumerate(self.q_lens) if q < 0]
            if bad:
                raise PagedValueError("q_lens", self.q_lens, "each >= 0",
                                      f"q_lens[i] must be >= 0; violated at {bad}")
        for name in ("num_q_heads", "num_kv_heads", "head_dim", "block_size"):
            if getattr(self, name) < 1:
                raise PagedValueError(name, getattr(self, name), ">= 1")
        if self.head_dim_v is not None and self.head_dim_v < 1:
            raise PagedValueError("head_dim_v", self.head_dim_v, "None or >= 1")
        if self.min_block_id < 0:
            raise PagedValueError("min_block_id", self.min_block_id, ">= 0")
        for name in ("qk_magnitude", "v_magnitude"):
            positive_finite(name, getattr(self, name), "a finite float > 0")
        offset = self.logit_offset
        if isinstance(offset, bool) or not isinstance(offset, (int, float)):
            raise PagedTypeError("logit_offset", offset, "a finite float")
        if not (math.isfinite(offset) and abs(offset) <= MAX_LOGIT_OFFSET):
            raise PagedValueError("logit_offset", offset,
                                  f"finite, of magnitude at most {MAX_LOGIT_OFFSET:g}")
        check_one_of("layout", self.layout, list(LAYOUTS))
        check_one_of("poison", self.poison, list(POISONS))
        if self.num_q_heads % self.num_kv_heads:
            raise PagedValueError(
                "num_q_heads", self.num_q_heads,
                f"a multiple of num_kv_heads ({self.num_kv_heads})",
                f"num_q_heads ({self.num_q_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})")
        check_one_of("dtype", self.dtype, sorted(DTYPES))
        if self.sliding_window is not None and self.sliding_window < 1:
            raise PagedValueError("sliding_window", self.sliding_window, "None or >= 1")
        for name in ("alibi", "sinks", "latent_cache"):
            if not isinstance(getattr(self, name), bool):
                raise PagedTypeError(name, getattr(self, name), "True or False")
        check_one_of("kv_cache_dtype", self.kv_cache_dtype, sorted(KV_CACHE_DTYPES))
        for name in ("k_scale", "v_scale"):
            value = getattr(self, name)
            positive_finite(name, value, "a finite float > 0")
            if self.kv_cache_dtype == "auto" and value != 1.0:
                raise PagedValueError(
                    name, value, "1.0 with kv_cache_dtype 'auto'",
                    f"{name}={value} needs an fp8 kv_cache_dtype ('fp8_e4m3' or 'fp8_e5m2'); "
                    "with kv_cache_dtype 'auto' it must be 1.0")
        if self.shared_blocks is not None:
            self._check_shared_blocks()
        if self.latent_cache:
            self._check_latent_cache()
        need = self.min_block_id + self.min_num_blocks
        if self.num_blocks is not None and self.num_blocks < need:
            raise PagedValueError(
                "num_blocks", self.num_blocks, f">= {need}",
                f"num_blocks={self.num_blocks} is below the {self.min_num_blocks} blocks "
                f"the kv_lens need (plus one padding block) above min_block_id "
                f"{self.min_block_id}")

    def _check_shared_blocks(self) -> None:
        """Refuse ``shared_blocks`` entries that are negative, share into the first
        sequence, or share more full blocks than either neighbour holds."""
        shared, bs = self.shared_blocks, self.block_size
        if shared[0] != 0:
            raise PagedValueError("shared_blocks", shared, "entry 0 equal to 0",
                                  "shared_blocks[0] must be 0: sequence 0 has no sequence "
                                  "before it to share blocks with")
        for i in range(1, len(shared)):
            most = min(self.kv_lens[i - 1], self.kv_lens[i]) // bs
            if not 0 <= shared[i] <= most:
                raise PagedValueError(
                    f"shared_blocks[{i}]", shared[i], f"in 0..{most}",
                    f"shared_blocks[{i}]={shared[i]}: only full blocks are shared, and "
                    f"sequences {i - 1} and {i} (kv_lens {self.kv_lens[i - 1]} and "
                    f"{self.kv_lens[i]}, block_size {bs}) have {most} full blocks in "
                    f"common at most; allowed: 0..{most}")

    def _check_latent_cache(self) -> None:
        """Refuse a latent cache whose V cannot be K's first ``head_dim_v`` channels."""
        for name, value, bad, allowed in (
                ("head_dim_v", self.v_head_dim, self.v_head_dim >= self.head_dim,
                 f"below head_dim ({self.head_dim}) with latent_cache"),
                ("v_magnitude", self.v_magnitude, self.v_magnitude != 1.0,
                 "1.0 with latent_cache (V is K's)"),
                ("v_scale", self.v_scale, self.v_scale != self.k_scale,
                 f"k_scale ({self.k_scale}) with latent_cache (V is stored as K)")):
            if bad:
                raise PagedValueError(name, value, allowed)

    # Derived axes ---------------------------------------------------------------------
    @property
    def batch_size(self) -> int:
        """Sequences in the batch."""
        return len(self.kv_lens)

    @property
    def q_lens_or_decode(self) -> tuple[int, ...]:
        """Query tokens per sequence, ``[batch]`` (1 each for decode)."""
        return self.q_lens if self.q_lens is not None else (1,) * self.batch_size

    @property
    def total_q(self) -> int:
        """Query tokens of the batch, all sequences together."""
        return sum(self.q_lens_or_decode)

    @property
    def mode(self) -> str:
        """``"decode"`` when every sequence has exactly one query token, else
        ``"prefill"`` (varlen queries, ``cu_seqlens_q``; a ``q_len`` of 0 included)."""
        return "decode" if set(self.q_lens_or_decode) == {1} else "prefill"

    @property
    def gqa_ratio(self) -> int:
        """Query heads per KV head."""
        return self.num_q_heads // self.num_kv_heads

    @property
    def scale(self) -> float:
        """The softmax scale actually used: ``sm_scale`` or ``1 / sqrt(head_dim)``."""
        return self.sm_scale if self.sm_scale is not None else 1.0 / math.sqrt(self.head_dim)

    @property
    def v_head_dim(self) -> int:
        """Channels per head of V and the output: ``head_dim_v`` or ``head_dim``."""
        return self.head_dim if self.head_dim_v is None else self.head_dim_v

    @property
    def cache_head_dim(self) -> int:
        """Channels per head of the canonical cache: ``max(head_dim, v_head_dim)``."""
        return max(self.head_dim, self.v_head_dim)

    @property
    def torch_dtype(self) -> torch.dtype:
        """Element type of Q, K, V and the output."""
        return torch_dtype(self.dtype)

    @property
    def kv_torch_dtype(self) -> torch.dtype:
        """Element type of the KV cache: the case dtype, or the fp8 type."""
        return torch_dtype(KV_CACHE_DTYPES[self.kv_cache_dtype] or self.dtype)

    @property
    def blocks_per_seq(self) -> tuple[int, ...]:
        """KV blocks each sequence's tokens fill, ``[batch]`` (the last one partly)."""
        return tuple(-(-n // self.block_size) for n in self.kv_lens)

    @property
    def max_blocks_per_seq(self) -> int:
        """Columns of the block table: the most blocks a sequence has, at least 1 (a
        batch of empty sequences still has one column, of padding)."""
        return max(1, *self.blocks_per_seq)

    @property
    def num_shared_blocks(self) -> int:
        """Table entries that point to another sequence's block (0 without sharing)."""
        return 0 if self.shared_blocks is None else sum(self.shared_blocks)

    @property
    def min_num_blocks(self) -> int:
        """Blocks the sequences need (a shared block counted once), plus the one that
        table padding points to."""
        return sum(self.blocks_per_seq) - self.num_shared_blocks + 1

    @property
    def pool_blocks(self) -> int:
        """``num_blocks`` or its default: ``min_block_id`` plus the need plus 25% spare,
        at least 4."""
        if self.num_blocks is not None:
            return self.num_blocks
        need = self.min_num_blocks
        return self.min_block_id + need + max(4, need // 4)

    @property
    def features(self) -> frozenset[str]:
        """Optional attention features the case uses (names as in ``Capabilities``)."""
        found = set()
        if self.sliding_window is not None:
            found.add("sliding_window")
        if self.logits_soft_cap is not None:
            found.add("logits_soft_cap")
        if self.alibi:
            found.add("alibi")
        if self.sinks:
            found.add("sinks")
        if self.head_dim_v is not None:
            found.add("head_dim_v")
        q_lens = self.q_lens_or_decode
        if 0 in self.kv_lens:
            found.add("empty_kv")
        if 0 in q_lens:
            found.add("empty_q")
        if any(q > kv > 0 for q, kv in zip(q_lens, self.kv_lens)):
            found.add("unseen_rows")
        return frozenset(found)

    @property
    def case_id(self) -> str:
        """A stable, readable id, e.g. ``llama3.1-8b-bf16-d128-bs16-h32x8-b8-kv1..2048``."""
        parts = [
            self.name,
            _TAGS[self.dtype],
            f"d{self.head_dim}" + ("" if self.head_dim_v is None else f"v{self.head_dim_v}"),
            f"bs{self.block_size}",
            f"h{self.num_q_heads}/{self.num_kv_heads}".replace("/", "x"),
            f"b{self.batch_size}",
            f"kv{_range_tag(self.kv_lens)}",
        ]
        if self.mode == "prefill":
            parts.append(f"q{_range_tag(self.q_lens_or_decode)}")
        if self.sliding_window is not None:
            parts.append(f"sw{self.sliding_window}")
        if self.logits_soft_cap is not None:
            parts.append(f"cap{self.logits_soft_cap:g}")
        if self.alibi:
            parts.append("alibi")
        if self.sinks:
            parts.append("sinks")
        if self.kv_cache_dtype != "auto":
            parts += [_TAGS[self.kv_cache_dtype], f"ks{self.k_scale:g}", f"vs{self.v_scale:g}"]
        if self.sm_scale is not None:
            parts.append(f"scale{self.sm_scale:g}")
        if self.qk_magnitude != 1.0:
            parts.append(f"qk{self.qk_magnitude:g}")
        if self.v_magnitude != 1.0:
            parts.append(f"vmag{self.v_magnitude:g}")
        if self.logit_offset:
            parts.append(f"off{self.logit_offset:+g}")
        if self.min_block_id:
            parts.append(f"min-block{self.min_block_id}")
        if self.shared_blocks is not None:
            parts.append("share" + ".".join(map(str, self.shared_blocks)))
        if self.latent_cache:
            parts.append("latent")
        if self.layout != "contiguous":
            parts.append(self.layout.replace("_", "-"))
        if self.poison != "nan":
            parts.append(f"poison{self.poison}")
        if self.tag:
            parts.append(self.tag)
        return "-".join(parts)

    # Serialisation ----------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Every field, JSON-ready (tuples become lists)."""
        out = asdict(self)
        out["kv_lens"] = list(self.kv_lens)
        out["q_lens"] = None if self.q_lens is None else list(self.q_lens)
        out["shared_blocks"] = None if self.shared_blocks is None else list(self.shared_blocks)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PagedCase:
        """Inverse of :meth:`to_dict`.

        Raises
        ------
        PagedTypeError
            If ``data`` is not a dict, or a field has the wrong type.
        PagedValueError
            If a field is unknown or missing, or a value is out of range.
        """
        if not isinstance(data, dict):
            raise PagedTypeError("case", data, "a dict of PagedCase fields")
        known = [f.name for f in fields(cls)]
        unknown = sorted(str(k) for k in data if k not in known)
        if unknown:
            raise PagedValueError("case", unknown, f"fields among {known}",
                                  f"case has unknown fields {unknown}; allowed: {known}")
        required = [f.name for f in fields(cls) if f.default is MISSING]
        missing = [name for name in required if name not in data]
        if missing:
            raise PagedValueError("case", sorted(data), f"all of {required}",
                                  f"case is missing fields {missing} (required: {required})")
        data = dict(data)
        for name in ("kv_lens", "q_lens", "shared_blocks"):
            if isinstance(data.get(name), list):
                data[name] = tuple(data[name])
        return cls(**data)

    def with_(self, **changes: Any) -> PagedCase:
        """A copy with some fields changed (validated again).

        Raises
        ------
        PagedValueError
            If a name in ``changes`` is not a field (or any error of the constructor).
        """
        known = [f.name for f in fields(self)]
        unknown = sorted(k for k in changes if k not in known)
        if unknown:
            raise PagedValueError("changes", unknown, f"fields among {known}",
                                  f"PagedCase has no fields {unknown}; allowed: {known}")
        return replace(self, **changes)
