"""Tests of harness/run/: the runner, the worker protocol and its budgets, bench, spread,
progress, replay, the summary."""
