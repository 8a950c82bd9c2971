"""Cases from real models: attention shapes of public models and request-length draws.

Each :class:`ModelPreset` carries the attention shape of a published model, per GPU where
the model is normally sharded, with the config it comes from. :func:`preset_cases` turns
a preset into benchmark cases with ragged, realistic context lengths.

Request-length distribution (``kv_lens``): every batch holds the boundary lengths
``1``, ``block_size`` and ``block_size + 1`` (first block, exactly full, one past full:
where paged kernels go wrong), the longest context ``max_kv_len``, and the rest drawn
log-uniformly from ``[1, max_kv_len]`` with the case seed. Log-uniform weights every
order of magnitude of context equally, so short chat turns and long documents both occur
in every batch, as in serving traces whose lengths are heavy-tailed (e.g. ShareGPT).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from pagedbench.reference import PagedCase


@dataclass(frozen=True)
class ModelPreset:
    """Attention shape of one model (per GPU when sharded).

    Attributes
    ----------
    name : str
        Short id used in case ids and ``--preset``.
    num_q_heads, num_kv_heads, head_dim : int
    num_layers : int
        Decoder layers (KV bytes per token = layers * num_kv_heads * (head_dim +
        v_head_dim) * bytes).
    source : str
        The published config the numbers come from.
    notes : str
        Features of the model not yet exercised by the preset's cases.
    head_dim_v : int or None
        V's head dim when it differs from Q/K's (MLA); None: ``head_dim``.
    block_sizes : tuple[int, ...] or None
        The block sizes of its default cases; None: :data:`DEFAULT_BLOCK_SIZES`.
    dtypes : tuple[str, ...] or None
        The dtypes of its default cases; None: :data:`DEFAULT_DTYPES`.
    latent_cache : bool
        MLA's one latent cache: V is K's first ``head_dim_v`` channels
        (``PagedCase.latent_cache``).
    """

    name: str
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    num_layers: int
    source: str
    notes: str = ""
    head_dim_v: int | None = None
    block_sizes: tuple[int, ...] | None = None
    dtypes: tuple[str, ...] | None = None
    latent_cache: bool = False

    @property
    def v_head_dim(self) -> int:
        return self.head_dim if self.head_dim_v is None else self.head_dim_v

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        """Bytes of K and V per token over all layers (bytes): one latent head of
        ``head_dim`` with a latent cache."""
        per_head = self.head_dim + (0 if self.latent_cache else self.v_head_dim)
        return self.num_layers * self.num_kv_heads * per_head * dtype_bytes


_HF = "https://huggingface.co/{}/blob/main/config.json"

#: Model presets, in leaderboard row order.
MODEL_PRESETS: dict[str, ModelPreset] = {
    p.name: p
    for p in (
        ModelPreset("llama3.1-8b", 32, 8, 128, 32, _HF.format("meta-llama/Llama-3.1-8B"),
                    "num_attention_heads 32, num_key_value_heads 8, hidden_size 4096"),
        ModelPreset("llama3.1-70b-tp8", 8, 1, 128, 80, _HF.format("meta-llama/Llama-3.1-70B"),
                    "64 q / 8 kv heads split over 8 GPUs (tensor parallel): 8 / 1 per GPU"),
        ModelPreset("mistral-7b", 32, 8, 128, 32, _HF.format("mistralai/Mistral-7B-v0.1"),
                    "v0.1 also declares sliding_window 4096 (not exercised here)"),
        ModelPreset("qwen2.5-7b", 28, 4, 128, 28, _HF.format("Qwen/Qwen2.5-7B"),
                    "hidden_size 3584 / 28 heads = head_dim 128; GQA ratio 7"),
        ModelPreset("phi3-mini", 32, 32, 96, 32,
                    _HF.format("microsoft/Phi-3-mini-4k-instruct"),
                    "MHA; hidden_size 3072 / 32 heads = head_dim 96"),
        ModelPreset("gemma2-9b", 16, 8, 256, 42, _HF.format("google/gemma-2-9b"),
                    "attn_logit_softcapping 50 and sliding_window 4096 not exercised yet"),
        # MLA with the weights absorbed, as the decode kernels see it: 128 query heads
        # over 8 GPUs, one latent KV head of kv_lora_rank 512 + qk_rope_head_dim 64.
        ModelPreset("deepseek-v3-mla-tp8", 16, 1, 576, 61, _HF.format("deepseek-ai/DeepSeek-V3"),
                    "MLA: 128 q heads / 8 GPUs, one latent KV head of 576 (512 + 64 rope) "
                    "for Q/K whose first 512 channels are V; block sizes 1 (SGLang's token "
                    "pool), 16, 64; float16, which the interpreted MLA peers run on the "
                    "CPU (not bfloat16: triton#11584), and bfloat16, vLLM's AMX_MLA dtype",
                    head_dim_v=512, block_sizes=(1, 16, 64), dtypes=("float16", "bfloat16"),
                    latent_cache=True),
    )
}

DEFAULT_BLOCK_SIZES = (16, 32)
DEFAULT_DTYPES = ("bfloat16",)
DEFAULT_BATCH_SIZE = 8
DEFAULT_MAX_KV_LEN = 2048
#: The reduced form that an interpreted kernel can afford (see the budgets in
#: adapters/triton_decode.py and adapters/vllm_triton.py).
REDUCED_BATCH_SIZE = 4
REDUCED_MAX_KV_LEN = 160


def draw_kv_lens(batch_size: int, max_kv_len: int, block_size: int | None,
                 seed: int) -> tuple[int, ...]:
    """Ragged context lengths, ``[batch_size]``: boundary values plus log-uniform draws.

    The first entries are ``1, block_size, block_size + 1, max_kv_len`` (those that fit
    under ``max_kv_len`` and the batch size; ``1, max_kv_len`` when ``block_size`` is None,
    so that the lengths do not depend on any block size); the rest are
    ``round(exp(U(0, ln max)))``.

    Raises
    ------
    ValueError
        If ``batch_size`` < 1 or ``max_kv_len`` < 1.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if max_kv_len < 1:
        raise ValueError(f"max_kv_len must be >= 1, got {max_kv_len}")
    edges = (1, max_kv_len) if block_size is None else (1, block_size, block_size + 1,
                                                           max_kv_len)
    boundary = [n for n in edges if n <= max_kv_len]
    lens = list(dict.fromkeys(boundary))[:batch_size]
    rng = random.Random(seed)
    while len(lens) < batch_size:
        lens.append(max(1, round(math.exp(rng.uniform(0.0, math.log(max_kv_len))))))
    return tuple(lens)


def preset_cases(
    preset: ModelPreset,
    block_sizes: tuple[int, ...] = DEFAULT_BLOCK_SIZES,
    dtypes: tuple[str, ...] = DEFAULT_DTYPES,
    batch_size: int = DEFAULT_BATCH_SIZE,
    max_kv_len: int = DEFAULT_MAX_KV_LEN,
    reduced: bool = False,
) -> list[PagedCase]:
    """Decode cases of ``preset``: one per (dtype, block_size), with its ``head_dim_v``.

    With ``reduced=True`` the batch and contexts shrink to :data:`REDUCED_BATCH_SIZE` and
    :data:`REDUCED_MAX_KV_LEN`, and the case id ends in ``-reduced``.
    """
    if reduced:
        batch_size, max_kv_len = REDUCED_BATCH_SIZE, REDUCED_MAX_KV_LEN
    lengths_seed = sum(map(ord, preset.name))
    return [
        PagedCase(
            kv_lens=draw_kv_lens(batch_size, max_kv_len, block_size, lengths_seed + block_size),
            num_q_heads=preset.num_q_heads,
            num_kv_heads=preset.num_kv_heads,
            head_dim=preset.head_dim,
            head_dim_v=preset.head_dim_v,
            latent_cache=preset.latent_cache,
            block_size=block_size,
            dtype=dtype,
            name=preset.name,
            tag="reduced" if reduced else "",
        )
        for dtype in dtypes
        for block_size in block_sizes
    ]


def default_cases(
    presets: list[str] | None = None,
    block_sizes: tuple[int, ...] | None = None,
    dtypes: tuple[str, ...] | None = None,
) -> list[PagedCase]:
    """The default job: every preset's full cases, each followed by its reduced form, at
    ``block_sizes`` and in ``dtypes`` (None: each preset's own, else
    :data:`DEFAULT_BLOCK_SIZES` / :data:`DEFAULT_DTYPES`).

    Raises
    ------
    ValueError
        If a name in ``presets`` is not in :data:`MODEL_PRESETS`.
    """
    names = presets or list(MODEL_PRESETS)
    unknown = [n for n in names if n not in MODEL_PRESETS]
    if unknown:
        raise ValueError(f"unknown preset(s) {unknown}; choose from {list(MODEL_PRESETS)}")
    cases = []
    for name in names:
        preset = MODEL_PRESETS[name]
        sizes = block_sizes or preset.block_sizes or DEFAULT_BLOCK_SIZES
        types = dtypes or preset.dtypes or DEFAULT_DTYPES
        cases += preset_cases(preset, sizes, types)
        cases += preset_cases(preset, sizes, types, reduced=True)
    return cases
