"""import-linter's layers contract, checked on the package as installed, from a plain checkout.

The checkout keeps cli/, bench/, compile/, predictor/, graphs/, planner/ and recipes/ at the top;
an install puts them inside the yggdrasil package (pyproject's [tool.setuptools] package-dir).
import-linter builds its graph with grimp, which finds a package's modules by walking the
directories its import spec names: in a checkout `yggdrasil` is yggdrasil/ alone, so a plain
`layers` contract never sees the mapped folders. grimp also takes, as root packages, the children
of a namespace package. So this contract builds its graph from specs made from package-dir:
`yggdrasil` as a namespace over yggdrasil/, each mapped folder a regular package under it
(yggdrasil.compile at compile/, ...), and checks the layers on that graph: the whole table, with
nothing copied and nothing installed. pyproject.toml registers it (contract_types), so a plain
`lint-imports` in the checkout runs it.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
import types
from contextlib import contextmanager
from pathlib import Path

import grimp
from importlinter.contracts.layers import LayersContract

try:
    import tomllib
except ImportError:  # Python 3.10: the test extra installs tomli
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "yggdrasil"


def package_dirs(root: Path = ROOT) -> dict[str, Path]:
    """Each package of pyproject's [tool.setuptools] package-dir and the folder it comes from."""
    config = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    return {name: root / folder for name, folder in config["package-dir"].items()}


def _module(name: str, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__spec__, module.__path__ = spec, spec.submodule_search_locations
    return module


@contextmanager
def installed_specs(root: Path = ROOT):
    """While open, importlib's find_spec (which grimp asks, and which answers from sys.modules
    first) finds the installed layout: nothing is imported, and sys.modules is restored after."""
    folders = package_dirs(root)
    top = importlib.machinery.ModuleSpec(PACKAGE, None, is_package=True)  # a namespace: no origin
    top.submodule_search_locations = [str(folders[PACKAGE])]
    specs = {PACKAGE: top}
    for name, folder in folders.items():
        if name != PACKAGE:
            specs[name] = importlib.util.spec_from_file_location(
                name, folder / "__init__.py", submodule_search_locations=[str(folder)])
    saved = {name: sys.modules[name] for name in specs if name in sys.modules}
    sys.modules.update({name: _module(name, spec) for name, spec in specs.items()})
    try:
        yield sorted(specs)
    finally:
        for name in specs:
            sys.modules.pop(name, None)
        sys.modules.update(saved)


def installed_graph(root: Path = ROOT, exclude_type_checking_imports: bool = False) -> grimp.ImportGraph:
    """The import graph of the yggdrasil package as an install lays it out."""
    with installed_specs(root) as packages:
        return grimp.build_graph(*packages, cache_dir=None,
                                 exclude_type_checking_imports=exclude_type_checking_imports)


class InstalledLayersContract(LayersContract):
    """A `layers` contract whose graph is the installed package's (installed_graph), not the
    checkout's yggdrasil/ folder alone."""

    def check(self, graph: grimp.ImportGraph, verbose: bool):
        exclude = str(self.session_options.get("exclude_type_checking_imports", "")).lower() == "true"
        return super().check(installed_graph(exclude_type_checking_imports=exclude), verbose)
