"""KV capacity simulation front-end: request traces and ``pagedbench simulate``."""
