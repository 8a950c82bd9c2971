"""Measurement: timers, bytes and FLOPs, device peaks, and the statistics of one point's
speed change."""
