"""Checking, running, recording and reporting, in one sub-package per subsystem (layers
from the bottom, each importing only those below it; docs/ARCHITECTURE.md draws them):
``verdict``, ``cases``, ``measure``, ``capacity``; ``results``; ``run``, ``gate``;
``lane``; ``cli``."""
