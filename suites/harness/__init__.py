"""Tests of the harness: runner isolation, negative tests, store, report, CLI."""
