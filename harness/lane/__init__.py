"""The GPU lane: its steps on a GPU machine without network access (:mod:`.steps`), their
time model (:mod:`.model`), what they run (:mod:`.sweep`, :mod:`.probe`, :mod:`.warmup`),
what the lane says at its end (:mod:`.outcome`), the carry built beforehand
(:mod:`.carry`, :mod:`.flashinfer_aot`), the compile check of its Triton kernels
(:mod:`.compile_check`) and the ingest of what comes back (:mod:`.ingest`)."""

from pathlib import Path

#: The checkout the lane runs from (a copy on the GPU machine), and its build folder.
ROOT = Path(__file__).resolve().parents[2]
BUILD = ROOT / "build"
