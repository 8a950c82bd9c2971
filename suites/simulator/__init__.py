"""simulator suite."""
