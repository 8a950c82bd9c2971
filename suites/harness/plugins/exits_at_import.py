"""A plug-in that calls ``sys.exit(0)`` while it is imported (a stray ``if __name__`` or
a CLI entry point run on import): once it made ``pagedbench run`` exit 0 with no output."""

import sys

sys.exit(0)
