"""SGLang's radix cache files (``adapters/sglang_radix_load.py``): loaded from the pinned
wheel's bytes without importing SGLang, every import they make covered by a file, a
stand-in or a named unreached path, a changed byte refused, and the loaded cache doing
what SGLang's own ``__main__`` example of ``radix_cache.py`` shows. Skipped when ``make``
has not extracted them."""

from __future__ import annotations

import sys
from array import array
from pathlib import Path

import pytest
import torch

from pagedbench.adapters import sglang_radix_load as load
from pagedbench.adapters.pinned_files import PinnedFilesInvalid, module_path

pytestmark = pytest.mark.skipif(
    not (load.SGLANG_RADIX.files_dir() / module_path(next(iter(load.SGLANG_RADIX.files)))).exists(),
    reason=f"SGLang's radix files are not in {load.SGLANG_RADIX.files_dir()} (`make` extracts them)")


def test_files_load_without_importing_sglang() -> None:
    radix = load.load_radix()
    assert radix.version == "0.5.23"
    assert not any(name == "sglang" or name.startswith("sglang.") for name in sys.modules)


def test_stand_ins_cover_every_import_but_the_unreached() -> None:
    sources = load.SGLANG_RADIX.read()
    assert load.SGLANG_RADIX.unmet_imports(sources, load.stand_ins(), "sglang",
                                           load.UNREACHED_IMPORTS) == []
    assert load.SGLANG_RADIX.unmet_imports(sources, load.stand_ins(), "sglang") != []


def test_a_changed_byte_is_refused(tmp_path: Path) -> None:
    load.SGLANG_RADIX.copy(tmp_path)
    changed = tmp_path / module_path(load.MEM + "radix_cache")
    changed.write_bytes(changed.read_bytes().replace(b"lock_ref == 0", b"lock_ref <= 0"))
    with pytest.raises(PinnedFilesInvalid, match="radix_cache.py: sha256 .* differs"):
        load.load_radix(tmp_path)


def test_loaded_cache_matches_inserts_and_evicts() -> None:
    """SGLang's own example (``radix_cache.py``'s ``__main__``), with a token pool; the
    slots an insert finds already cached are freed, as the scheduler frees them."""
    radix = load.load_radix()
    pool = radix.TokenToKVPoolAllocator(size=16, dtype=torch.float32, device="cpu",
                                        kvcache=None, need_sort=False)
    tree = radix.RadixCache.create_simulated(mock_allocator=pool)
    key = lambda *ids: radix.RadixKey(array("q", ids))  # noqa: E731
    for ids in ((1, 2, 3), (1, 2, 4, 5), (8, 9)):
        slots = pool.alloc(len(ids))
        cached = tree.insert(radix.InsertParams(key=key(*ids), value=slots)).prefix_len
        pool.free(slots[:cached])
    assert pool.available_size() == 16 - 7 and tree.evictable_size() == 7  # [1, 2] once
    match = tree.match_prefix(radix.MatchPrefixParams(key=key(1, 2, 3, 13)))
    assert match.device_prefix_len == 3
    tree.lock(match.last_device_node)  # [1, 2] and [3]
    assert tree.evict(radix.EvictParams(num_tokens=9)).num_tokens_evicted == 4  # [4, 5], [8, 9]
    assert (tree.evictable_size(), tree.protected_size(), pool.available_size()) == (0, 3, 13)
