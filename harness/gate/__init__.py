"""The gate: current results against a baseline, point by point, and its measured
false-alarm rate and power."""
