"""Cases, tolerance, the conformance check, truth cache, timing, statuses, the runner and
its worker protocol, the process environment, the typed result record and its store,
reports, the GPU lane and the CLI."""
