"""Tests of harness/verdict/: the tolerance policy, the truth and its cache, the fp8
interpreter mark."""
