"""allocator suite."""
