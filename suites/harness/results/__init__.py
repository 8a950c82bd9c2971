"""Tests of harness/results/: results files, JUnit, the physical floor, shards, the site."""
