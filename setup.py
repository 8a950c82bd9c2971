"""Packaging: the checkout's top-level folders are the subpackages of ``pagedbench``.

``reference/`` installs as ``pagedbench.reference``, ``harness/`` as ``pagedbench.harness``
and so on; every folder below them is found by setuptools (no hand-kept list), and the
JSON beside the code (example timings, pinned regression cases) travels with it.
``suites/harness/end_to_end/test_installed_plugin.py`` checks that the built wheel holds
every folder.
"""

from setuptools import find_namespace_packages, setup

ROOTS = {
    "pagedbench": "pagedbench",
    "pagedbench.reference": "reference",
    "pagedbench.kernels": "kernels",
    "pagedbench.adapters": "adapters",
    "pagedbench.harness": "harness",
    "pagedbench.suites": "suites",
}


def _packages() -> list[str]:
    found = []
    for package, folder in ROOTS.items():
        found.append(package)
        found += [f"{package}.{sub}" for sub in find_namespace_packages(folder, exclude=["*__pycache__*"])]
    return found


setup(
    package_dir=ROOTS,
    packages=_packages(),
    package_data={"": ["*.json"]},
    include_package_data=False,  # else a stale egg-info's SOURCES.txt adds what it lists
)
