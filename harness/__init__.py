"""Cases, tolerance, timing, the runner, results store, reports and the CLI."""
