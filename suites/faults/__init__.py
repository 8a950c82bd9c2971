"""The fault catalogue: broken paged-attention kernels, each imitating a fault from a
public bug report of FlashInfer, vLLM, FlashAttention, xformers or FlexAttention, and
each exact on everyday inputs and wrong only on its trigger.

They prove that the conformance suite can fail. Every class subclasses the fault-free
:class:`~.kernel.PagedKernel` (``catalogue-control``, which must pass) and replaces one
step; its docstring cites the report it imitates. The catalogue is an out-of-tree
distribution, ``pagedbench-faults``, that is not installed: its entry points
(``site/pagedbench_faults-0.1.dist-info/entry_points.txt``, group
``pagedbench.adapters``) register the faults exactly as an out-of-tree kernel registers,
once :data:`SITE` is on the path (``PYTHONPATH=suites/faults/site``; the conformance
suite adds it when ``--impl`` names a fault). ``pagedbench selftest`` runs the suite on
every fault and prints which property caught it (docs/conformance.md, "Self-test").
"""

from __future__ import annotations

from pathlib import Path

#: The folder holding the catalogue's installed-distribution metadata.
SITE = Path(__file__).resolve().parent / "site"
