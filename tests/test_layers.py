"""The layer contracts (pyproject.toml [tool.importlinter]) hold: each layer imports only the
layers below it, and yggdrasil/ (what runs a bundle) imports no folder above it. The check is a
plain `lint-imports`, as CI runs it: its contract type (tests/layer_contract.py) sees the mapped
folders under their installed names from the checkout itself."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

try:
    import tomllib
except ImportError:  # Python 3.10: the test extra installs tomli
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
needs_linter = pytest.mark.skipif(shutil.which("lint-imports") is None,
                                  reason="import-linter is not installed (test extra)")


def package_dirs() -> dict[str, Path]:
    """pyproject's [tool.setuptools] package-dir: each package and the folder it comes from."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    return {name: ROOT / folder for name, folder in config["package-dir"].items()}


def _lint(cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run(["lint-imports", "--no-cache"], capture_output=True, text=True, cwd=cwd, env=env)


@needs_linter
def test_import_contracts_are_kept():
    run = _lint(ROOT)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert "0 broken" in run.stdout


@needs_linter
def test_the_graph_holds_every_folder_under_its_installed_name():
    from layer_contract import installed_graph  # imports import-linter (test extra)

    before = {name: sys.modules.get(name) for name in package_dirs()}
    graph = installed_graph()
    for module in ("yggdrasil.cli.common", "yggdrasil.bench.harness", "yggdrasil.compile.build",
                   "yggdrasil.predictor.depth", "yggdrasil.graphs.aoti", "yggdrasil.planner.schedule",
                   "yggdrasil.runtime.steps", "yggdrasil.storage.layout", "yggdrasil.recipes"):
        assert module in graph.modules, module
    assert graph.chain_exists(importer="yggdrasil.cli.compile", imported="yggdrasil.compile.build")
    assert "yggdrasil.storage.layout" in graph.find_modules_directly_imported_by("yggdrasil.bundle")
    assert {name: sys.modules.get(name) for name in package_dirs()} == before  # nothing left swapped


@needs_linter
def test_plain_lint_imports_fails_on_upward_imports_and_missing_folders(tmp_path):
    """In a copy of the checkout: the runtime importing compile, and graphs importing the CLI,
    each break the layers; a folder the table names that is gone fails the check too."""
    for folder in set(package_dirs().values()):
        shutil.copytree(folder, tmp_path / folder.name,
                        ignore=shutil.ignore_patterns("__pycache__", "results", "*.gguf", "out"))
    (tmp_path / "tests").mkdir()
    shutil.copy(ROOT / "tests" / "layer_contract.py", tmp_path / "tests")
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    assert _lint(tmp_path).returncode == 0
    (tmp_path / "yggdrasil" / "runtime" / "upward.py").write_text("import yggdrasil.compile.build\n")
    (tmp_path / "graphs" / "upward.py").write_text("from yggdrasil.cli import common\n")
    run = _lint(tmp_path)
    assert run.returncode != 0, run.stdout[-3000:]
    assert "yggdrasil.runtime.upward -> yggdrasil.compile.build" in run.stdout, run.stdout[-3000:]
    assert "yggdrasil.graphs.upward -> yggdrasil.cli.common" in run.stdout, run.stdout[-3000:]
    shutil.rmtree(tmp_path / "planner")
    (tmp_path / "yggdrasil" / "runtime" / "upward.py").unlink()
    (tmp_path / "graphs" / "upward.py").unlink()
    run = _lint(tmp_path)
    assert run.returncode != 0 and "yggdrasil.planner" in run.stdout + run.stderr, run.stdout[-3000:]


def test_the_checkout_is_the_layout_no_symlinks_no_dual_imports():
    """One mapping from folders to packages (pyproject's package-dir): no symlinked packages, and no
    module that imports its siblings two ways depending on how it was started."""
    tracked = subprocess.run(["git", "ls-files", "-s"], capture_output=True, text=True, cwd=ROOT).stdout.splitlines()
    links = [line.split("\t")[1] for line in tracked if line.startswith("120000")]
    assert not links, f"symlinks in the checkout: {links}"
    by_folder = re.compile(r"^\s*(from|import) (bench|cli|compile|graphs|predictor|planner)\b", re.M)
    dual = [str(path.relative_to(ROOT)) for folder in (*SOURCE_DIRS, "tests") for path in (ROOT / folder).rglob("*.py")
            if path != Path(__file__).resolve()
            and ("if __package__" in path.read_text() or by_folder.search(path.read_text()))]
    assert not dual, f"import them as yggdrasil.<package>.<module> instead: {dual}"


# Imports inside functions are kept for these only: slow, optional dependencies. The CLI's command
# modules are exempt (they import the runtime when a command runs, so --help never waits for torch).
# gguf and tokenizers: optional at run time (GGUF models only; the GPU image lacks gguf)
LAZY_ALLOWED = {"matplotlib", "httpx", "transformers", "triton", "torch", "readline", "gguf", "tokenizers",
                "jinja2"}  # jinja2: only a chat template needs it, 0.1 s of every bundle start
SOURCE_DIRS = ("yggdrasil", "cli", "compile", "graphs", "predictor", "planner", "bench")
# the manifest module stays torch-free so `inspect` is instant; device.py imports torch
# kernels/build.py <-> ops.py import each other; the GPU session's steps before `measure` run
# where the runtime may not import yet (a fresh GPU image); a bundle's serve engine
TORCH_VIA = {("yggdrasil/storage/manifest.py", "yggdrasil"), ("yggdrasil/kernels/build.py", "."),
             ("bench/gpu_session.py", "."),
             ("yggdrasil/bundle.py", "yggdrasil")}  # the server's engine: generate and chat never load it


def _function_level_imports(path: Path):
    import ast

    source = path.read_text()
    lines = source.splitlines()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for inner in ast.walk(node):
                if isinstance(inner, (ast.Import, ast.ImportFrom)):
                    name = inner.module if isinstance(inner, ast.ImportFrom) else inner.names[0].name
                    before = lines[inner.lineno - 2].strip() if inner.lineno > 1 else ""
                    commented = "#" in lines[inner.lineno - 1] or before.startswith("#") or \
                        any(lines[i].strip().startswith("#") for i in range(max(0, inner.lineno - 8), inner.lineno - 1))
                    relative = getattr(inner, "level", 0) > 0
                    yield inner.lineno, "." if relative else (name or "").split(".")[0], commented


def test_function_level_imports_are_only_optional_dependencies_with_a_reason():
    offenders = []
    for folder in SOURCE_DIRS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path.parent.name == "cli" or "egg-info" in str(path):
                continue
            for line, top, commented in _function_level_imports(path):
                allowed = top in LAZY_ALLOWED or (str(path.relative_to(ROOT)), top) in TORCH_VIA
                if not allowed or not commented:
                    offenders.append(f"{path.relative_to(ROOT)}:{line} imports {top or '.'}"
                                     f"{'' if commented else ' (no comment saying why)'}")
    assert not offenders, "move these imports to module level (layers permitting):\n" + "\n".join(offenders)


def test_every_package_of_the_layout_is_installed():
    """A subpackage missing from pyproject's `packages` works from a checkout (pip install -e)
    but is absent from a wheel: every folder with an __init__.py is listed."""
    packages = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    found = set()
    for package, folder in package_dirs().items():
        for init in folder.rglob("__init__.py"):
            relative = init.parent.relative_to(folder).parts
            if "results" not in relative:
                found.add(".".join((package, *relative)))
    assert found <= set(packages), sorted(found - set(packages))


def test_the_gpu_session_imports_the_checkout_without_an_install(tmp_path):
    """bench/gpu_session.sh puts bench/checkout_path on PYTHONPATH: any python started then finds
    the mapped folders at their checkout paths, whatever its working directory, reading package-dir
    without a TOML reader (a device image may have none)."""
    code = ("import sys, yggdrasil.bench, yggdrasil.cli, yggdrasil.storage; "
            "print(sys.meta_path[0].__name__, yggdrasil.bench.__file__, yggdrasil.storage.__file__)")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path,
                         env={**os.environ, "PYTHONPATH": str(ROOT / "bench" / "checkout_path")})
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split() == ["CheckoutFinder", str(ROOT / "bench" / "__init__.py"),
                                  str(ROOT / "yggdrasil" / "storage" / "__init__.py")]


def test_python_m_yggdrasil_runs_the_installed_command_or_says_how():
    """yggdrasil/__main__.py imports nothing above yggdrasil/: it runs the console script's entry
    point (recorded results quote `python -m yggdrasil ...`); with none installed, one line says what to do."""
    run = subprocess.run([sys.executable, "-m", "yggdrasil", "--version"], capture_output=True, text=True)
    assert run.returncode == 0 and run.stdout.startswith("yggdrasil "), run.stderr[-2000:]
    without = ("import importlib.metadata as m, runpy; m.entry_points = lambda **kw: (); "
               "runpy.run_module('yggdrasil', run_name='__main__')")
    run = subprocess.run([sys.executable, "-c", without], capture_output=True, text=True)
    assert run.returncode == 2 and "python -m yggdrasil.cli" in run.stderr, run.stderr[-2000:]
