"""Tests of harness/cli/: options and their errors, start-up, ``list``, read-only commands."""
