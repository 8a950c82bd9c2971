"""Tests of harness/gate/: the gate's verdicts against a baseline."""
