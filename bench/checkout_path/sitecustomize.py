"""Run a checkout with no install (the GPU session, bench/gpu_session.sh): with this folder on
PYTHONPATH, every python started (the session and its children: compile, pytest) imports the
checkout's folders under their installed names (pyproject's [tool.setuptools] package-dir:
yggdrasil.bench is bench/, ...), as an editable install's finder does. Nothing is copied."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def package_dirs(pyproject: Path) -> dict[str, Path]:
    """package-dir's packages and folders; read without a TOML reader (a device image may have
    Python 3.10 without tomli): pyproject.toml keeps the table on one line."""
    line = next(x for x in pyproject.read_text().splitlines() if x.startswith("package-dir"))
    return {name: ROOT / folder for name, folder in re.findall(r'"([\w.]+)"\s*=\s*"([\w./-]+)"', line)}


class CheckoutFinder:
    """Finds the packages package-dir maps at their checkout folders, ahead of sys.path (where
    the working directory's yggdrasil/ would otherwise be the whole package)."""

    folders = package_dirs(ROOT / "pyproject.toml")

    @classmethod
    def find_spec(cls, name, path=None, target=None):
        folder = cls.folders.get(name)
        if folder is None:
            return None
        return importlib.util.spec_from_file_location(name, folder / "__init__.py",
                                                      submodule_search_locations=[str(folder)])


def run_the_next_sitecustomize() -> None:
    """Python imports one sitecustomize, the first on sys.path: this one shadows any later one
    (the machine's own, a test's), so that one runs here too."""
    here = Path(__file__).resolve()
    for entry in sys.path:
        candidate = Path(entry or ".") / "sitecustomize.py"
        if candidate.is_file() and candidate.resolve() != here:
            code = compile(candidate.read_text(), str(candidate), "exec")
            exec(code, {"__name__": "sitecustomize", "__file__": str(candidate)})
            return


if CheckoutFinder not in sys.meta_path:
    sys.meta_path.insert(0, CheckoutFinder)
    run_the_next_sitecustomize()
