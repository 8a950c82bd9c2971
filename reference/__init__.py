"""What a paged-attention problem is, and its ground truth (plain PyTorch, no kernels)."""

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
