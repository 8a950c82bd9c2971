"""Tests of harness/calibration/: the tolerance's and the gate's measured rates."""
