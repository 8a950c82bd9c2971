"""Tests of the pytest plugin (suites/plugin.py) and the search budget (suites/budget.py):
profiles, markers, xdist workers, pytest-benchmark's JSON."""
