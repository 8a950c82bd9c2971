"""Tests of harness/capacity/: ``pagedbench tune``."""
