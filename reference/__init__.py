"""What a paged-attention problem is, and its ground truth (plain PyTorch, no kernels)."""

from .allocator import BlockAllocator, OutOfBlocksError
from .case import DTYPES, PagedCase
from .dense import attention, gather_kv, naive_attention, reference_attention
from .inputs import PagedInputs, materialize, new_output

__all__ = [
    "DTYPES",
    "BlockAllocator",
    "OutOfBlocksError",
    "PagedCase",
    "PagedInputs",
    "attention",
    "gather_kv",
    "materialize",
    "naive_attention",
    "new_output",
    "reference_attention",
]
