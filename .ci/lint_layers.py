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

sys.path.insert(0, str(Path(__file__).resolve().parent))  # .ci/ is no package: its sibling by path
from installed_layout import ROOT, installed_layout, pyproject_tool  # noqa: E402


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
