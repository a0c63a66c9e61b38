"""Check the import-layer contracts (pyproject.toml [tool.importlinter]) on the installed layout.

The checkout keeps compile/, graphs/, predictor/, planner/, bench/ and recipes/ at the top; an
install puts them inside the yggdrasil package ([tool.setuptools] package-dir). import-linter reads
packages from disk, so this copies the sources into that installed layout in a temporary folder
(the same mapping a wheel uses, without building one), requires every layer the contracts name
to be there (plain `lint-imports` in a checkout treats the mapped folders as optional layers,
since they are absent from yggdrasil/ there), and runs lint-imports on it.

    python .ci/lint_layers.py
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

try:
    import tomllib
except ImportError:  # Python 3.10 (the test extra installs tomli there)
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent


def pyproject_tool(pyproject: Path, tool: str) -> dict:
    """pyproject.toml's [tool.TOOL] table."""
    return tomllib.loads(pyproject.read_text())["tool"][tool]


def package_dirs(pyproject: Path) -> dict[str, Path]:
    """Each package of [tool.setuptools] package-dir and the checkout folder it comes from."""
    return {name: ROOT / folder for name, folder in pyproject_tool(pyproject, "setuptools")["package-dir"].items()}


def missing_layers(pyproject: Path, layout: Path) -> list[str]:
    """The modules the layer contracts name that the layout lacks (optional ones included)."""
    missing = []
    for contract in pyproject_tool(pyproject, "importlinter")["contracts"]:
        for container in contract.get("containers", []):
            base = layout.joinpath(*container.split("."))
            for layer in contract.get("layers", []):
                for name in layer.replace("|", ":").split(":"):
                    name = name.strip().strip("()")
                    if not (base / name).is_dir() and not (base / f"{name}.py").is_file():
                        missing.append(f"{container}.{name}")
    return missing


def installed_layout(dest: Path) -> Path:
    """Copy the Python sources into DEST as an install lays them out; returns DEST."""
    for package, folder in sorted(package_dirs(ROOT / "pyproject.toml").items()):
        target = dest.joinpath(*package.split("."))
        shutil.copytree(folder, target, dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns("__pycache__", "results", "*.gguf", "out"))
    return dest


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="yggdrasil-layout-") as scratch:
        layout = installed_layout(Path(scratch))
        missing = missing_layers(ROOT / "pyproject.toml", layout)
        if missing:
            print(f"layers the contracts name are missing from the installed layout: {', '.join(missing)}",
                  file=sys.stderr)
            return 1
        shutil.copy(ROOT / "pyproject.toml", layout)  # where lint-imports looks for its contracts
        env = {**os.environ, "PYTHONPATH": str(layout)}
        done = subprocess.run(["lint-imports", "--no-cache"], cwd=layout, env=env)
    return done.returncode


if __name__ == "__main__":
    sys.exit(main())
