"""The ``pagedbench`` command line: :mod:`.main` parses and dispatches; each command's
body lives in its own module here (``run``, ``bench``, ``results``, ``replay``)."""
