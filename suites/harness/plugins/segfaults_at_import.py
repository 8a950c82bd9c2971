"""A plug-in that segfaults while it is imported (a broken C extension): once it killed
the CLI itself (exit 139)."""

import ctypes

ctypes.string_at(0)
