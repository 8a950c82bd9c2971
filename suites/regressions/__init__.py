"""Regression cases: failing cases found once, kept and replayed (see test_saved_cases_replay)."""
