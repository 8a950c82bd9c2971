"""conformance suite."""
