"""Tests of harness/measure/: CPU and CUDA timers, timing statistics, bytes and FLOPs."""
