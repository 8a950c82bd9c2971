"""This project's own paged-attention kernels (Triton)."""
