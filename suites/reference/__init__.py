"""Tests of the reference: inputs, ground truth, features."""
