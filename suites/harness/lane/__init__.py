"""Tests of harness/lane/: the GPU lane's steps, time model, warm-up, compile check."""
