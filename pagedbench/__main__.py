"""``python -m pagedbench``: the ``pagedbench`` command (:func:`pagedbench.harness.cli.console_main`).

This folder is the top-level package's only file of its own: setup.py maps each other
folder of the checkout to ``pagedbench.<folder>``, and ``pagedbench`` stays a namespace.
"""

from pagedbench.harness.cli import console_main

console_main()
