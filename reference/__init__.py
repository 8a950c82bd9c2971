"""What a paged-attention problem is, and its ground truth (plain PyTorch, no kernels).

Each public name is imported from its module when first used (PEP 562): ``from
pagedbench.reference import PagedValueError`` loads ``errors.py`` alone, and a case
(``case.py``, ``axes.py``) is described without torch, so a command's options and usage
errors answer before torch is imported.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import lazy_loader

#: The public names, by the module (of this package) that defines each.
_NAMES_BY_MODULE = {
    "allocator": ["BlockAllocator", "OutOfBlocksError"],
    "axes": ["DTYPES"],
    "case": ["PagedCase"],
    "dense": ["attention", "gather_kv", "reference_attention"],
    "errors": ["PagedInputError", "PagedTypeError", "PagedValueError"],
    "inputs": ["PagedInputs", "check_fits", "logit_bound", "materialize", "new_output",
               "resolve_device"],
    "yardstick": ["logit_rounding", "naive_attention", "yardstick_attention"],
}
__getattr__, __dir__, __all__ = lazy_loader.attach(__name__, submod_attrs=_NAMES_BY_MODULE)

if TYPE_CHECKING:  # for type checkers and the import graph (suites/docs/test_architecture.py)
    from .allocator import BlockAllocator, OutOfBlocksError
    from .axes import DTYPES
    from .case import PagedCase
    from .dense import attention, gather_kv, reference_attention
    from .errors import PagedInputError, PagedTypeError, PagedValueError
    from .inputs import (PagedInputs, check_fits, logit_bound, materialize, new_output,
                         resolve_device)
    from .yardstick import logit_rounding, naive_attention, yardstick_attention
