"""Running: the plan and the parent's side of a run, the worker process and its job
bodies, the judge in the parent, the process environment, the bench sweep, replays, the
self-test, progress."""
