"""``python -m pagedbench.harness.cli``: the ``pagedbench`` command."""

from pagedbench.harness.cli import console_main

console_main()
