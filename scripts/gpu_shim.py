"""Make ``pagedbench.*`` importable from a checkout that is not installed.

``python3 scripts/gpu_shim.py SHIM_DIR`` reads the package folders (``ROOTS``) from the
checkout's ``setup.py`` (``"pagedbench.harness": "harness"``, ...) and makes
``SHIM_DIR/pagedbench/`` a folder of symbolic links, one per mapped package, to the
checkout's folders (and to the namespace's own ``__main__.py``). With ``SHIM_DIR`` on ``PYTHONPATH``, ``pagedbench`` is a namespace
package (PEP 420: no ``__init__.py``, as in the installed distribution) whose
subpackages are the checkout's own files: no install, no ``wheel``, no network. The
links are made afresh on each call (a stale one would point into another copy).

Standard library only (``ast``: ``setup.py`` is read, never run): it runs before anything
of pagedbench can be imported. Prints ``SHIM_DIR``; exit 2 on a mapping it cannot make.
"""

from __future__ import annotations

import ast
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "pagedbench"


def package_dirs(setup: Path) -> dict[str, Path]:
    """``{subpackage: folder}`` for each ``pagedbench.<subpackage>`` of ``setup.py``'s
    ``ROOTS``, and ``{"": folder}`` for the namespace's own files (``"pagedbench":
    "pagedbench"``: ``__main__.py``, no ``__init__.py``).

    Raises
    ------
    ValueError
        If ``ROOTS`` is missing or not a literal, maps a nested or foreign package, or
        names a folder that does not exist.
    """
    assigned = [node.value for node in ast.parse(setup.read_text()).body
                if isinstance(node, ast.Assign)
                and any(getattr(t, "id", None) == "ROOTS" for t in node.targets)]
    try:
        mapping = ast.literal_eval(assigned[0]) if assigned else None
    except ValueError:
        mapping = None
    if not isinstance(mapping, dict) or not mapping:
        raise ValueError(f"{setup}: no literal ROOTS mapping to shim")
    found = {}
    for name, folder in mapping.items():
        if name == PACKAGE:
            path = (setup.parent / folder).resolve()
            if not path.is_dir() or (path / "__init__.py").exists():
                raise ValueError(f"{setup}: ROOTS {name!r} = {folder!r}: not a "
                                 f"namespace folder (a folder without __init__.py) at {path}")
            found[""] = path
            continue
        parent, _, child = name.rpartition(".")
        if parent != PACKAGE or not child.isidentifier():
            raise ValueError(f"{setup}: ROOTS key {name!r} is not "
                             f"'{PACKAGE}.<name>'")
        path = (setup.parent / folder).resolve()
        if not (path / "__init__.py").is_file():
            raise ValueError(f"{setup}: ROOTS {name!r} = {folder!r}: no package "
                             f"at {path}")
        found[child] = path
    return found


def make_shim(shim_dir: Path, setup: Path = ROOT / "setup.py") -> Path:
    """Replace ``shim_dir/pagedbench`` by links to the folders of :func:`package_dirs`;
    returns ``shim_dir``."""
    dirs = package_dirs(setup)
    package = shim_dir / PACKAGE
    if package.is_symlink() or package.is_file():
        package.unlink()
    elif package.exists():
        shutil.rmtree(package)
    package.mkdir(parents=True)
    for child, path in dirs.items():
        if child:
            (package / child).symlink_to(path, target_is_directory=True)
        else:  # the namespace's own files
            for file in sorted(path.glob("*.py")):
                (package / file.name).symlink_to(file)
    return shim_dir


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python3 scripts/gpu_shim.py SHIM_DIR", file=sys.stderr)
        return 2
    try:
        print(make_shim(Path(argv[0]).resolve()))
    except (OSError, ValueError) as exc:
        print(f"gpu_shim: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
