"""Pytest suites: conformance, allocator, benchmarks, regressions."""
