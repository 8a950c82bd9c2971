"""What a paged-attention problem is, and its ground truth (plain PyTorch, no kernels).

Each public name is imported from its module when first used (PEP 562): ``from
pagedbench.reference import PagedValueError`` loads ``errors.py`` alone, and a case
(``case.py``, ``axes.py``) is described without torch, so a command's options and usage
errors answer before torch is imported.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

#: Each public name, by the module (of this package) that defines it.
_MODULE_OF = {
    "BlockAllocator": "allocator",
    "OutOfBlocksError": "allocator",
    "DTYPES": "axes",
    "PagedCase": "case",
    "attention": "dense",
    "gather_kv": "dense",
    "reference_attention": "dense",
    "PagedInputError": "errors",
    "PagedTypeError": "errors",
    "PagedValueError": "errors",
    "PagedInputs": "inputs",
    "check_fits": "inputs",
    "logit_bound": "inputs",
    "materialize": "inputs",
    "new_output": "inputs",
    "resolve_device": "inputs",
    "logit_rounding": "yardstick",
    "naive_attention": "yardstick",
    "yardstick_attention": "yardstick",
}


def __getattr__(name: str) -> Any:
    """The public ``name``, from its module (imported now if it was not)."""
    if name not in _MODULE_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_MODULE_OF[name]}", __name__), name)
    globals()[name] = value  # the next use finds it without this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_MODULE_OF})


if TYPE_CHECKING:  # for type checkers and the import graph (suites/docs/test_architecture.py)
    from .allocator import BlockAllocator, OutOfBlocksError
    from .axes import DTYPES
    from .case import PagedCase
    from .dense import attention, gather_kv, reference_attention
    from .errors import PagedInputError, PagedTypeError, PagedValueError
    from .inputs import (PagedInputs, check_fits, logit_bound, materialize, new_output,
                         resolve_device)
    from .yardstick import logit_rounding, naive_attention, yardstick_attention

__all__ = [
    "DTYPES",
    "BlockAllocator",
    "OutOfBlocksError",
    "PagedCase",
    "PagedInputError",
    "PagedInputs",
    "PagedTypeError",
    "PagedValueError",
    "attention",
    "check_fits",
    "gather_kv",
    "logit_bound",
    "logit_rounding",
    "materialize",
    "naive_attention",
    "new_output",
    "reference_attention",
    "resolve_device",
    "yardstick_attention",
]
