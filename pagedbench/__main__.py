"""``python -m pagedbench``: the ``pagedbench`` command (:func:`pagedbench.harness.cli.main`).

This folder is the top-level package's only file of its own: setup.py maps each other
folder of the checkout to ``pagedbench.<folder>``, and ``pagedbench`` stays a namespace.
"""

import sys

from pagedbench.harness.cli import main

sys.exit(main())
