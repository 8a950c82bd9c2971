"""Checking, running, recording and reporting, in one sub-package per subsystem (layers
from the bottom, each importing only those below it; docs/ARCHITECTURE.md draws them):
``verdict``, ``cases``, ``measure``; ``results``, ``capacity``; ``run``, ``gate``;
``calibration``, ``cli``, ``lane``."""
