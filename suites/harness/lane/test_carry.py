"""The GPU lane's carry (``make gpu-carry``) holds every package the lane's command imports
beyond what a GPU image brings: torch, numpy, triton (and what they import themselves) and
the standard library. The lane runs on a bare copy, with nothing installed."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from importlib.metadata import packages_distributions

from pagedbench.harness.lane import carry

#: A fresh interpreter: the top-level modules ``import pagedbench.harness.lane.steps``
#: brings beyond the image's packages and the standard library.
PROBE = """
import json, sys
import numpy, torch, triton
before = {name.partition(".")[0] for name in sys.modules}
import pagedbench.harness.lane.steps
after = {name.partition(".")[0] for name in sys.modules}
print(json.dumps(sorted(after - before - set(sys.stdlib_module_names))))
"""


def _normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_what_the_lane_imports_beyond_the_image_is_carried() -> None:
    proc = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                          timeout=300, check=True)
    imported = json.loads(proc.stdout)
    carried = {_normalized(r.split("==")[0]) for r in carry.requirements()}
    distributions = packages_distributions()
    missing = [module for module in imported if module != "pagedbench" and not any(
        _normalized(d) in carried for d in distributions.get(module, [module]))]
    assert not missing, f"the lane imports {missing}, which the carry does not hold"
    assert "pydantic" in imported and "lazy_loader" in imported  # the probe sees them
