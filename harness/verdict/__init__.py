"""Verdicts: statuses and exit codes, the tolerance policy, the float64 truth, and the
conformance check of one case."""
