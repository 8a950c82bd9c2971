"""The checkout's conftest: registers pagedbench's pytest plugin (``suites/plugin.py``,
the same module the installed entry point loads) when pytest has not loaded it, e.g.
with ``PYTEST_DISABLE_PLUGIN_AUTOLOAD=1``. ``-p no:pagedbench`` still turns it off. The
checkout's own sessions run the searching suites' files first."""

from __future__ import annotations

import pytest


def pytest_addhooks(pluginmanager: pytest.PytestPluginManager) -> None:
    if not pluginmanager.has_plugin("pagedbench"):
        from pagedbench.suites import plugin

        pluginmanager.register(plugin, "pagedbench")


#: The suites whose files search for the whole of their seconds, each file the longest of
#: a session (the conformance search, the fault catalogue's self-test, the serving loop).
SEARCHING_SUITES = ("conformance", "faults", "serving")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The searching suites' files first, each file's tests in their order: ``make test``'s
    ``--dist loadfile`` hands files to its workers in this order, so the long files start
    first and the short ones even out the end."""
    def suite(item: pytest.Item) -> str:
        parts = item.path.parts
        return parts[parts.index("suites") + 1] if "suites" in parts[:-1] else ""

    items.sort(key=lambda item: suite(item) not in SEARCHING_SUITES)
