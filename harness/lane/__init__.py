"""The GPU lane: its steps on a GPU machine without network access (:mod:`.steps`), what
they run (:mod:`.sweep`, :mod:`.probe`), the carry built beforehand (:mod:`.carry`) and
the ingest of what comes back (:mod:`.ingest`)."""

from pathlib import Path

#: The checkout the lane runs from (a copy on the GPU machine), and its build folder.
ROOT = Path(__file__).resolve().parents[2]
BUILD = ROOT / "build"
