"""Test-only plug-ins: one per fault a plug-in can bring into a run. Tests register them
through the ``pagedbench.adapters`` entry-point group (``suites/harness/conftest.py``),
exactly as an out-of-tree kernel is registered; pytest never collects them."""
