"""Calibration: the tolerance's and the gate's rates, measured (``python -m
pagedbench.harness.calibration.tolerance``, ``python -m pagedbench.harness.calibration.gate``):
near-correct and faulty variants against the tolerance, replayed and real noise against
the gate."""
