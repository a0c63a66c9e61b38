"""Check the import-layer contracts (pyproject.toml [tool.importlinter]) on the installed layout.

The checkout keeps compile/, graphs/, predictor/, planner/, bench/ and recipes/ at the top; an
install puts them inside the yggdrasil package ([tool.setuptools] package-dir). import-linter reads
packages from disk, so this copies the sources into that installed layout in a temporary folder
(the same mapping a wheel uses, without building one) and runs lint-imports there.

    python .ci/lint_layers.py
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def package_dirs(pyproject: Path) -> dict[str, Path]:
    """Each package of [tool.setuptools] package-dir and the checkout folder it comes from."""
    config = tomllib.loads(pyproject.read_text())["tool"]["setuptools"]
    return {name: ROOT / folder for name, folder in config["package-dir"].items()}


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
        shutil.copy(ROOT / "pyproject.toml", layout)  # where lint-imports looks for its contracts
        env = {**os.environ, "PYTHONPATH": str(layout)}
        done = subprocess.run(["lint-imports", "--no-cache"], cwd=layout, env=env)
    return done.returncode


if __name__ == "__main__":
    sys.exit(main())
