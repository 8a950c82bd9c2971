"""benchmarks suite."""
