"""Compiling a ``@triton.jit`` kernel for an NVIDIA GPU on a machine without one (not
collected): the suites' compile checks run it in a fresh process without
``TRITON_INTERPRET``.

:func:`compile_like_launch` binds the arguments as a launch would (integers equal to 1
become constants, multiples of 16 and aligned pointers get ``tt.divisibility``), through
the same internals ``JITFunction.run`` uses in Triton 3.6 to 3.9
(``triton/runtime/jit.py``), and compiles with the ``ptxas`` in the triton wheel.
"""

from __future__ import annotations

import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import CUDABackend
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction, create_function_from_signature


def compile_like_launch(kernel: JITFunction, args: tuple, kwargs: dict,
                        capability: int) -> triton.compiler.CompiledKernel:
    """``kernel`` compiled for compute capability ``capability`` (e.g. 90) as
    ``kernel[grid](*args, **kwargs)`` would compile it; ``kwargs`` holds the constexprs
    and launch options (``num_warps``, ``num_stages``). Raises what Triton raises."""
    target = GPUTarget("cuda", capability, 32)
    backend = CUDABackend(target)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound,
                                                              specialization, options)
    return triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=target,
                          options=options.__dict__)
