"""Copy the checkout's Python sources into the layout an install gives them (pyproject's
[tool.setuptools] package-dir: compile/ -> yggdrasil/compile/, bench/ -> yggdrasil/bench/, ...),
without building a wheel. Two users: the layer check (.ci/lint_layers.py), since import-linter
reads packages from disk, and the GPU session (bench/gpu_session.sh), which runs from a plain
checkout with the device image's python3 and no install: it puts DEST on PYTHONPATH.

    python3 .ci/installed_layout.py DEST
"""

from __future__ import annotations

import re
import shutil
import sys
from pathlib import Path

try:
    import tomllib
except ImportError:  # Python 3.10: the test extra installs tomli; a device image may have neither
    try:
        import tomli as tomllib
    except ImportError:
        tomllib = None

ROOT = Path(__file__).resolve().parent.parent


def pyproject_tool(pyproject: Path, tool: str) -> dict:
    """pyproject.toml's [tool.TOOL] table."""
    return tomllib.loads(pyproject.read_text())["tool"][tool]


def package_dirs(pyproject: Path) -> dict[str, Path]:
    """Each package of [tool.setuptools] package-dir and the checkout folder it comes from."""
    if tomllib is not None:
        mapping = pyproject_tool(pyproject, "setuptools")["package-dir"]
    else:  # no TOML reader: the one-line inline table pyproject.toml keeps it in
        line = next(x for x in pyproject.read_text().splitlines() if x.startswith("package-dir"))
        mapping = dict(re.findall(r'"([\w.]+)"\s*=\s*"([\w./-]+)"', line))
    return {name: ROOT / folder for name, folder in mapping.items()}


def installed_layout(dest: Path) -> Path:
    """Copy the Python sources into DEST as an install lays them out; returns DEST."""
    for package, folder in sorted(package_dirs(ROOT / "pyproject.toml").items()):
        target = dest.joinpath(*package.split("."))
        shutil.copytree(folder, target, dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns("__pycache__", "results", "*.gguf", "out"))
    return dest


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python3 .ci/installed_layout.py DEST", file=sys.stderr)
        return 2
    print(installed_layout(Path(argv[0])))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
