"""``python -m pagedbench.harness.cli``: the ``pagedbench`` command."""

import sys

from pagedbench.harness.cli import main

sys.exit(main())
