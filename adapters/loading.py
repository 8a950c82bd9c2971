"""Importing an adapter in this process: :func:`load` by its target, and
:class:`Unloadable`, what :func:`~pagedbench.adapters.registry` keeps of a plug-in that
failed to load (commands import adapters only in worker processes).
"""

from __future__ import annotations

import importlib

from .base import Adapter, Availability, Capabilities


def load(target: str) -> Adapter:
    """Import and instantiate the adapter class named by ``target`` (``"module:Class"``).

    Raises
    ------
    ValueError
        If ``target`` is not of the form ``"module:Class"``.
    TypeError
        If the object it names is not an :class:`Adapter` subclass.
    ImportError, AttributeError
        If the module or class does not exist (and whatever the module raises at import).
    """
    module_name, sep, class_name = target.partition(":")
    if not sep or not module_name or not class_name:
        raise ValueError(f"adapter target must be 'module:Class', got {target!r}")
    cls = getattr(importlib.import_module(module_name), class_name)
    if not (isinstance(cls, type) and issubclass(cls, Adapter)):
        raise TypeError(f"{target} is a {type(cls).__name__}, not an Adapter subclass")
    return cls()


class Unloadable(Adapter):
    """Stands in, in :func:`~pagedbench.adapters.registry`, for an out-of-tree adapter
    whose module or class failed to load: ``unavailable`` with the import error as the
    reason."""

    description = "adapter failed to load"

    def __init__(self, name: str, target: str, error: Exception) -> None:
        self.name = name
        self.reason = f"failed to load {target}: {type(error).__name__}: {error}"

    def capabilities(self, device: str) -> Capabilities:
        return Capabilities(devices=frozenset(), dtypes=frozenset())

    def available(self, device: str = "cpu") -> Availability:
        return Availability(False, self.reason)

    def prepare(self, inputs):
        raise RuntimeError(self.reason)

    def run(self, prepared):
        raise RuntimeError(self.reason)


__all__ = ["Unloadable", "load"]
