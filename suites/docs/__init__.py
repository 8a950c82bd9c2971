"""docs suite: the README and docs/ pages."""
