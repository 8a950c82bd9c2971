"""kernels suite: this project's own Triton kernels against the float64 truth."""
