"""Tests of harness/cases/: the search strategies, batch traces."""
