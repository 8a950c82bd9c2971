"""Tests of harness/: a folder per sub-package, pytest_plugin/ and end_to_end/ (the map:
docs/ARCHITECTURE.md, "suites/ and scripts/")."""
