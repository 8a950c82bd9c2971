"""SGLang's radix cache and token allocator, loaded from its pinned wheel without SGLang.

The allocator contract's ``sglang-radix`` (:mod:`.allocator_sglang`) drives SGLang
0.5.23's own ``RadixCache`` (``srt/mem_cache/radix_cache.py``) over its own
``TokenToKVPoolAllocator`` (``srt/mem_cache/allocator/token.py``, page size 1). ``import
sglang`` pulls its server, so the Makefile's venv step extracts these files from the
wheel ``make`` already downloads for SGLang's kernels into ``build/sglang-radix``
(``python -m pagedbench.adapters.sglang_radix_load``; ``PAGEDBENCH_SGLANG_RADIX_DIR``
names another folder), sha256-checked (:mod:`.pinned_files`), and executes them with
stand-ins (:func:`stand_ins`) for the SGLang modules they import, each holding the names
the files use with SGLang 0.5.23's meaning:

- ``sglang.srt.mem_cache.events``: ``KVCacheEventRecorder`` as SGLang's with
  ``enabled=False`` (every ``record_*`` a no-op, ``take`` empty; the radix cache builds
  one disabled unless KV events are asked for, which the stand-in refuses), and the two
  LoRA name tables it is handed (``LoRANameTable``, ``KvEventLoraNames``);
- ``sglang.srt.mem_cache.utils``: ``get_eviction_strategy`` (policy name -> the strategy
  classes of the wheel's own ``evict_policy.py``, SGLang's table) and
  ``split_node_hash_value`` (a node's page hashes cut where the node splits);
- ``sglang.srt.utils.common``: ``ceil_align``;
- ``sglang.srt.mem_cache.allocator``: the package, exposing ``BaseTokenToKVPoolAllocator``
  of the loaded ``allocator/base.py``;
- names reached only on paths the contract never takes: ``memory_pool.ReqToTokenPool``
  (the request-to-token pool a server passes; the simulated cache takes none), and the
  metrics (``observability.metrics_collector``, ``runtime_context``), used only with
  ``enable_metrics``: calling them raises.
"""

from __future__ import annotations

import math
import sys
import types
from pathlib import Path

from .pinned_files import BUILD_DIR, PinnedFiles, link_parents, package_module
from .sglang_triton_load import SGLANG_VERSION, WHEEL_TAGS

MEM = "sglang.srt.mem_cache."
SGLANG_RADIX = PinnedFiles(
    project="sglang",
    version=SGLANG_VERSION,
    wheel_tags=WHEEL_TAGS,
    files={
        MEM + "allocator.base": "17c07a9ab32c62932048d3579e620eaa2e2558b03b828df152b2ee953c4bfe32",
        MEM + "allocator.token": "ee09d0021b69b111e3262811e2fdaf2f495ecfc2cf6ed142070a7f7e95a030ec",
        MEM + "unified_cache.component_type":
            "df978797a6ddc376477d01931d8bb30b8185499a27fe8c9691db19a429155332",
        MEM + "evict_policy": "fff4330dd8e0c04670642ba721f0a1d64e17ff6f3137521d5ca80cc699bf9573",
        MEM + "cache_init_params":
            "9f0bf0107020a4a0647b4f6cf104961c4531e62ec2251056159fbf764df18555",
        MEM + "base_prefix_cache":
            "92dc72c5e34e1106c30b5692d3be5bdae52216cc8689ef951bcf4b10d80ccbf7",
        MEM + "radix_cache": "eea7015fcf678167ac7296b08c8dc568ccbe42a4bb106da23b33a7c59debec01",
    },
    dir_env="PAGEDBENCH_SGLANG_RADIX_DIR",
    default_dir=BUILD_DIR / "sglang-radix",
)
#: Modules the files import inside functions the contract never calls, and which.
UNREACHED_IMPORTS = {
    MEM + "prefill_budget": "BaseTokenToKVPoolAllocator.create_prefill_budget (the scheduler's)",
    MEM + "common": "evict_to_free_tokens, free_kv_row, evict_sliding_windows (a server's "
                    "request rows and sliding windows)",
    "sglang.srt.layers.dp_attention": "BasePrefixCache.init_metrics_collector (metrics on)",
}
_PACKAGES = ("sglang", "sglang.srt", "sglang.srt.mem_cache", "sglang.srt.mem_cache.unified_cache",
             "sglang.srt.utils", "sglang.srt.observability")


class LoRANameTable:
    """SGLang's LoRA id -> name table (``events.py``): handed around, empty here."""


class KvEventLoraNames(LoRANameTable):
    """SGLang's LoRA names for KV events (``events.py``): empty here."""


class KVCacheEventRecorder:
    """SGLang's ``KVCacheEventRecorder`` with ``enabled=False``: records nothing.

    Raises
    ------
    NotImplementedError
        When built enabled (KV events are not part of the allocator contract).
    """

    def __init__(self, *, enabled: bool, page_size: int, dynamo_format: bool = False,
                 lora_names: KvEventLoraNames | None = None) -> None:
        if enabled:
            raise NotImplementedError("pagedbench's stand-in records no KV events")
        self.enabled = False
        self.page_size = page_size

    def record_store(self, *args, **kwargs) -> None:
        return None

    def record_remove(self, *args, **kwargs) -> None:
        return None

    def record_all_cleared(self) -> None:
        return None

    def take(self) -> list:
        return []


def split_node_hash_value(child_hash_value, split_len: int, page_size: int):
    """SGLang's (``mem_cache/utils.py``): a node's page hashes, cut at ``split_len``
    tokens into the new parent's and the child's; ``None`` stays ``None``."""
    if child_hash_value is None:
        return None, None
    pages = split_len if page_size == 1 else split_len // page_size
    return child_hash_value[:pages], child_hash_value[pages:]


def _unreached(name: str):
    def call(*args, **kwargs):
        raise NotImplementedError(f"{name}: reached only with SGLang's metrics on, which "
                                  "pagedbench's stand-ins do not provide")
    return call


def stand_ins() -> dict[str, types.ModuleType]:
    """The stand-in modules (module docstring), by module name."""
    modules = {name: package_module(name, "a package of SGLang's files") for name in _PACKAGES}

    def eviction_strategy(eviction_policy: str, config: dict | None = None):
        policies = utils.evict_policy  # the loaded evict_policy.py (load_radix sets it)
        factories = {"lru": policies.LRUStrategy, "lfu": policies.LFUStrategy,
                     "fifo": policies.FIFOStrategy, "mru": policies.MRUStrategy,
                     "filo": policies.FILOStrategy, "priority": policies.PriorityStrategy,
                     "slru": policies.SLRUStrategy, "tlru": policies.TLRUStrategy}
        policy = eviction_policy.lower()
        if policy not in factories:
            raise ValueError(f"Unknown eviction policy: {policy}. Supported policies: "
                             f"'{chr(39).join(factories)}'.")
        return factories[policy](**config) if config else factories[policy]()

    def allocator_name(name: str):
        base = sys.modules.get(MEM + "allocator.base")  # while the files execute
        if base is None or name not in allocator.__all__:
            raise AttributeError(f"module {MEM}allocator has no attribute {name!r}")
        return getattr(base, name)

    allocator = package_module(MEM + "allocator", "the allocator package")
    allocator.__all__ = ["BaseTokenToKVPoolAllocator"]
    allocator.__getattr__ = allocator_name
    utils = package_module(MEM + "utils", "the radix cache's helpers",
                           get_eviction_strategy=eviction_strategy,
                           split_node_hash_value=split_node_hash_value)
    modules |= {
        MEM + "allocator": allocator,
        MEM + "events": package_module(
            MEM + "events", "KV events, disabled", KVCacheEventRecorder=KVCacheEventRecorder,
            LoRANameTable=LoRANameTable, KvEventLoraNames=KvEventLoraNames),
        MEM + "utils": utils,
        MEM + "memory_pool": package_module(
            MEM + "memory_pool", "a name for annotations",
            ReqToTokenPool=type("ReqToTokenPool", (), {"__doc__": "not provided"})),
        "sglang.srt.utils.common": package_module(
            "sglang.srt.utils.common", "ceil_align",
            ceil_align=lambda x, y: math.ceil(x / y) * y),
        "sglang.srt.observability.metrics_collector": package_module(
            "sglang.srt.observability.metrics_collector", "metrics, not provided",
            STAT_LOGGER_ROLE_RADIX_CACHE="radix_cache",
            RadixCacheMetricsCollector=_unreached("RadixCacheMetricsCollector"),
            radix_cache_metric_labels=_unreached("radix_cache_metric_labels"),
            resolve_collector_class=_unreached("resolve_collector_class")),
        "sglang.srt.runtime_context": package_module(
            "sglang.srt.runtime_context", "the runtime context, not provided",
            get_observability=_unreached("get_observability"),
            get_parallel=_unreached("get_parallel")),
    }
    return link_parents(modules)


def load_radix(folder: Path | None = None) -> types.SimpleNamespace:
    """``RadixCache``, ``TokenToKVPoolAllocator`` and the parameter classes
    (``MatchPrefixParams``, ``InsertParams``, ``EvictParams``, ``RadixKey``), from
    ``folder`` (default :meth:`PinnedFiles.files_dir`), sha256-checked.

    Raises
    ------
    PinnedFilesInvalid
        A file is missing, changed, or does not load with the stand-ins.
    """
    stand = stand_ins()
    _, modules = SGLANG_RADIX.load(stand, folder)
    stand[MEM + "utils"].evict_policy = modules[MEM + "evict_policy"]
    radix, base = modules[MEM + "radix_cache"], modules[MEM + "base_prefix_cache"]
    return types.SimpleNamespace(
        RadixCache=radix.RadixCache, RadixKey=radix.RadixKey,
        TokenToKVPoolAllocator=modules[MEM + "allocator.token"].TokenToKVPoolAllocator,
        MatchPrefixParams=base.MatchPrefixParams, InsertParams=base.InsertParams,
        EvictParams=base.EvictParams, version=SGLANG_VERSION,
        source=SGLANG_RADIX.source)


if __name__ == "__main__":
    sys.exit(SGLANG_RADIX.main(None, "pagedbench.adapters.sglang_radix_load",
                               "its radix cache and token allocator files"))
