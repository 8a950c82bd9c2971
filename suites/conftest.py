"""The checkout's conftest: registers pagedbench's pytest plugin (``suites/plugin.py``,
the same module the installed entry point loads) when pytest has not loaded it, e.g.
with ``PYTEST_DISABLE_PLUGIN_AUTOLOAD=1``. ``-p no:pagedbench`` still turns it off."""

from __future__ import annotations

import pytest


def pytest_addhooks(pluginmanager: pytest.PytestPluginManager) -> None:
    if not pluginmanager.has_plugin("pagedbench"):
        from pagedbench.suites import plugin

        pluginmanager.register(plugin, "pagedbench")
