"""adapters suite."""
