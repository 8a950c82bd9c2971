"""README's "Adding an implementation" example is a working adapter.

The test takes the first Python block of that section verbatim, gives it a library
``my_kernel_lib`` whose ``paged_decode`` has the signature the README names, and judges
it with the conformance check the runner uses: a correct library passes, one that
ignores the block table fails, and without the library the adapter is unavailable.
"""

from __future__ import annotations

import math
import re
import sys
import types
from pathlib import Path

import pytest
import torch

from pagedbench.harness.verdict.conformance import check
from pagedbench.harness.verdict.status import Status
from pagedbench.reference import PagedCase

README = Path(__file__).resolve().parents[2] / "README.md"
#: Decode, GQA 4, lengths on both sides of a block boundary, more blocks than sequences.
CASE = PagedCase(kv_lens=(1, 16, 17, 70), num_q_heads=8, num_kv_heads=2, head_dim=64,
                 block_size=16, dtype="bfloat16")


def readme_adapter_source() -> str:
    section = README.read_text().split("## Adding an implementation", 1)[1].split("\n## ", 1)[0]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def paged_decode(q, k_cache, v_cache, block_tables, kv_lens, scale, *, out,
                 follow_table=True):
    """Decode attention read through the block table, float32 math: ``q [batch, hq, d]``,
    ``k_cache``/``v_cache [num_blocks, block_size, hkv, d]``; writes ``out``."""
    block_size, hkv = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // hkv
    for i, kv_len in enumerate(kv_lens.tolist()):
        used = math.ceil(kv_len / block_size)
        blocks = block_tables[i, :used].long() if follow_table else torch.arange(used)
        k = k_cache[blocks].reshape(-1, hkv, k_cache.shape[3])[:kv_len]  # [kv_len, hkv, d]
        v = v_cache[blocks].reshape(-1, hkv, v_cache.shape[3])[:kv_len]
        k = k.float().repeat_interleave(group, dim=1)  # [kv_len, hq, d]
        v = v.float().repeat_interleave(group, dim=1)
        p = (torch.einsum("hd,thd->ht", q[i].float(), k) * scale).softmax(-1)
        out[i] = torch.einsum("ht,thd->hd", p, v).to(out.dtype)


def load_adapter(monkeypatch, library: types.ModuleType | None):
    if library is None:
        monkeypatch.setitem(sys.modules, "my_kernel_lib", None)  # import raises ImportError
    else:
        monkeypatch.setitem(sys.modules, "my_kernel_lib", library)
    namespace: dict = {}
    exec(compile(readme_adapter_source(), str(README), "exec"), namespace)
    return namespace["MyKernel"]()


def library(follow_table: bool) -> types.ModuleType:
    module = types.ModuleType("my_kernel_lib")
    module.__version__ = "1.0"
    module.paged_decode = lambda *args, **kwargs: paged_decode(
        *args, **kwargs, follow_table=follow_table)
    return module


def test_readme_adapter_passes_with_a_correct_library(monkeypatch) -> None:
    adapter = load_adapter(monkeypatch, library(follow_table=True))
    assert adapter.available("cpu").ok
    verdict = check(adapter, CASE, "cpu", probe_nan_tail=False)
    assert verdict.status is Status.PASS, verdict.reason


def test_readme_adapter_fails_with_a_library_that_ignores_the_block_table(monkeypatch) -> None:
    adapter = load_adapter(monkeypatch, library(follow_table=False))
    verdict = check(adapter, CASE, "cpu", probe_nan_tail=False)
    assert verdict.status is Status.FAIL


def test_readme_adapter_is_unavailable_without_its_library(monkeypatch) -> None:
    adapter = load_adapter(monkeypatch, None)
    availability = adapter.available("cpu")
    assert not availability.ok and "my_kernel_lib not installed" in availability.reason
