"""Cases: model presets and the default job, hypothesis strategies, benchmark
workloads."""
