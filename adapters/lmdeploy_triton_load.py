"""LMDeploy's Triton attention kernels, loaded from its pinned wheel without importing it.

lmdeploy 0.18.0 on PyPI requires ``torch<=2.12.1``, ``triton<=3.7.1``, NCCL and CUDA
runtime wheels, a server stack (fastapi, ray, ...): it cannot be installed beside this
project's torch, and ``import lmdeploy`` pulls its engine. So the Makefile's venv step
runs ``python -m pagedbench.adapters.lmdeploy_triton_load``: ``pip download --no-deps`` of
the one wheel (:data:`LMDEPLOY`) into ``build/wheels`` and the files of its
``lmdeploy/pytorch/kernels/cuda/`` that the attention kernels need extracted into
``build/lmdeploy-triton`` (``PAGEDBENCH_LMDEPLOY_TRITON_DIR`` names another folder, as
the GPU lane's carry does), each sha256-checked (:mod:`.pinned_files`).

The files import two LMDeploy modules that pull in its engine; :func:`stand_ins` gives
each with the names the files use and LMDeploy 0.18.0's meaning: ``lmdeploy.messages``
(``QuantPolicy``, the KV-cache quantization enum, ``lmdeploy/messages.py``) and
``lmdeploy.utils`` (``get_logger``: a ``logging`` logger). Its own light files
(``utils.py``: device properties; ``turbo_quant.py``: the Hadamard rotation) load as they
are.

What the host answers (:func:`host_answers`, applied to the loaded modules): a CPU tensor
(device index ``None``) has no SM count, so ``get_device_props`` describes it as
:data:`CPU_DEVICE_PROPS` and the decode's split count is LMDeploy's floor,
:data:`CPU_SPLIT_K` (``_get_split_k`` clamps to at least 4); on a CUDA tensor both are
LMDeploy's own. Under Triton's interpreter (``TRITON_INTERPRET=1``) the interpreter is
not CUDA, so ``is_cuda()`` is False (no programmatic dependent launch), and since the
interpreter patches ``triton.language``'s builtins only at launch, each module-level alias
of one (``tl_exp2 = tl.exp2``) is rebound to a forwarder that looks the builtin up at call
time; ``tl.extra.cuda.libdevice`` functions (the soft cap's ``tanh``) have no interpreter
implementation at all. Compiled, the files run as shipped.
"""

from __future__ import annotations

import enum
import logging
import sys
import types
from dataclasses import dataclass
from pathlib import Path

from .pinned_files import BUILD_DIR, PinnedFiles, link_parents, package_module

LMDEPLOY_VERSION = "0.18.0"
KERNELS = "lmdeploy.pytorch.kernels.cuda."
LMDEPLOY = PinnedFiles(
    project="lmdeploy",
    version=LMDEPLOY_VERSION,
    wheel_tags=("--python-version", "3.11", "--implementation", "cp", "--abi", "cp311",
                "--platform", "manylinux_2_28_x86_64", "--only-binary=:all:"),
    files={
        KERNELS + "utils": "5a9832849364059f80e51c3a7cf7a5e078d11a8846b4d7cac51173e543e1f9db",
        KERNELS + "turbo_quant":
            "4949a8a8ece8a28c244ddb6ea879ac56f205d26fb3ae8fca9ddc8a004ea79863",
        KERNELS + "pagedattention":
            "e20073d2921a5443932f65223554f6ca015f29cadd2f2ce252fa80d127ee5011",
        KERNELS + "flatten_kv_cache":
            "85195d1b1c773e9894d2ec6581198817da5993d31a1a3cca9589c6c5d418b1d7",
        KERNELS + "flashattention":
            "2ee6d9292fa046fdd0764e45573a067ecd7c9036bd1cc568bbf0eb2d8542a4b6",
    },
    dir_env="PAGEDBENCH_LMDEPLOY_TRITON_DIR",
    default_dir=BUILD_DIR / "lmdeploy-triton",
)
_PACKAGES = ("lmdeploy", "lmdeploy.pytorch", "lmdeploy.pytorch.kernels",
             "lmdeploy.pytorch.kernels.cuda")
#: What ``get_device_props`` answers for a CPU tensor: the keys LMDeploy's returns, an
#: SM 8.0 architecture (the kernels' default launch tables) and no multiprocessor.
CPU_DEVICE_PROPS = {"multi_processor_count": 0, "compute_capability": (8, 0),
                    "warps_per_sm": 64, "blocks_per_sm": 32}
#: The decode's KV splits on a CPU tensor: ``_get_split_k``'s floor (``max(..., 4)``).
CPU_SPLIT_K = 4


class QuantPolicy(enum.IntEnum):
    """``lmdeploy.messages.QuantPolicy`` of lmdeploy 0.18.0: the KV-cache quantization."""

    NONE = 0
    INT4 = 4
    INT8 = 8
    FP8 = 16
    FP8_E5M2 = 17
    TURBO_QUANT = 42


def stand_ins() -> dict[str, types.ModuleType]:
    """The stand-in modules (module docstring), by module name."""
    modules = {name: package_module(name, "a package of LMDeploy's kernel files")
               for name in _PACKAGES}
    modules["lmdeploy.messages"] = package_module(
        "lmdeploy.messages", "the KV-cache quantization enum", QuantPolicy=QuantPolicy)
    modules["lmdeploy.utils"] = package_module(
        "lmdeploy.utils", "LMDeploy's logger", get_logger=logging.getLogger)
    return link_parents(modules)


def _rebind_builtin_aliases(module: types.ModuleType) -> list[str]:
    """Rebind each global of ``module`` that is a ``triton.language`` (or ``.math``)
    builtin to a forwarder resolving it at call time; returns the names rebound."""
    import triton.language as tl

    rebound = []
    for name, value in list(vars(module).items()):
        if not tl.core.is_builtin(value):
            continue
        for namespace in (tl, tl.math):
            attr = next((a for a in dir(namespace) if getattr(namespace, a, None) is value), None)
            if attr is not None:
                setattr(module, name, lambda *a, _ns=namespace, _attr=attr, **k:
                        getattr(_ns, _attr)(*a, **k))
                rebound.append(name)
                break
    return rebound


def host_answers(modules: dict[str, types.ModuleType], interpreted: bool) -> list[str]:
    """Apply the host's answers (module docstring) to the loaded ``modules``; returns the
    builtin aliases rebound for the interpreter."""
    utils = modules[KERNELS + "utils"]
    props, split_k = utils.get_device_props, modules[KERNELS + "pagedattention"]._get_split_k

    def get_device_props(device=None):
        return dict(CPU_DEVICE_PROPS) if device is None and not _cuda() else props(device)

    def _get_split_k(device_idx, head_grid, batch_size, num_warps):
        if device_idx is None:
            return CPU_SPLIT_K
        return split_k(device_idx, head_grid, batch_size, num_warps)

    cuda = utils.is_cuda
    rebound = []
    for module in modules.values():
        if hasattr(module, "get_device_props"):
            module.get_device_props = get_device_props
        if hasattr(module, "is_cuda"):
            module.is_cuda = (lambda: False) if interpreted else cuda
        if interpreted:
            rebound += [f"{module.__name__.rpartition('.')[2]}.{name}"
                        for name in _rebind_builtin_aliases(module)]
    modules[KERNELS + "pagedattention"]._get_split_k = _get_split_k
    return rebound


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


@dataclass(frozen=True)
class LmdeployTritonKernels:
    """The loaded modules.

    Attributes
    ----------
    decode : types.ModuleType
        ``pagedattention`` (``flash_attn_with_kvcache``, ``_fwd_grouped_split_kernel``).
    flatten : types.ModuleType
        ``flatten_kv_cache`` (the paged cache copied into a contiguous one).
    prefill : types.ModuleType
        ``flashattention`` (``flash_attn_varlen_func``, ``_flash_prefill_fwd_kernel``).
    version, source : str
        The release, and what results record: the version, and that each file was checked.
    interpreted : bool
        Whether the kernels were loaded for Triton's interpreter.
    rebound : tuple[str, ...]
        The builtin aliases rebound for the interpreter (``module.name``).
    """

    decode: types.ModuleType
    flatten: types.ModuleType
    prefill: types.ModuleType
    version: str
    source: str
    interpreted: bool
    rebound: tuple[str, ...]


def load_kernels(folder: Path | None = None) -> LmdeployTritonKernels:
    """The kernel modules from ``folder`` (default :meth:`PinnedFiles.files_dir`),
    sha256-checked, with the host's answers applied.

    Raises
    ------
    PinnedFilesInvalid
        A file is missing, changed, or does not load with the stand-ins.
    ImportError
        If triton is not installed.
    """
    import triton

    _, modules = LMDEPLOY.load(stand_ins(), folder)
    interpreted = bool(triton.knobs.runtime.interpret)
    rebound = host_answers(modules, interpreted)
    return LmdeployTritonKernels(
        decode=modules[KERNELS + "pagedattention"],
        flatten=modules[KERNELS + "flatten_kv_cache"],
        prefill=modules[KERNELS + "flashattention"],
        version=LMDEPLOY_VERSION,
        source=LMDEPLOY.source,
        interpreted=interpreted,
        rebound=tuple(rebound),
    )


if __name__ == "__main__":
    sys.exit(LMDEPLOY.main(None, "pagedbench.adapters.lmdeploy_triton_load",
                           "its Triton attention kernel files"))
