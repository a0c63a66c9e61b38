"""The layer contracts (pyproject.toml [tool.importlinter]) hold: each layer imports only the
layers below it, and the runtime never imports compile or bench. The check is import-linter's,
run as CI runs it (`python .ci/lint_layers.py`: the checkout copied into the installed layout)."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
needs_linter = pytest.mark.skipif(shutil.which("lint-imports") is None,
                                  reason="import-linter is not installed (test extra)")


def _lint_layers_module():
    spec = importlib.util.spec_from_file_location("lint_layers", ROOT / ".ci" / "lint_layers.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@needs_linter
def test_import_contracts_are_kept():
    run = subprocess.run([sys.executable, ".ci/lint_layers.py"], capture_output=True, text=True, cwd=ROOT)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert "0 broken" in run.stdout


@needs_linter
def test_the_check_sees_the_installed_layout_and_fails_on_an_upward_import(tmp_path):
    """compile/ is checked as yggdrasil.compile, and graphs importing it breaks the layers."""
    layout = _lint_layers_module().installed_layout(tmp_path)
    assert (layout / "yggdrasil" / "compile" / "build.py").is_file()
    assert (layout / "yggdrasil" / "runtime" / "steps.py").is_file()
    (layout / "yggdrasil" / "graphs" / "upward.py").write_text("import yggdrasil.compile.build\n")
    shutil.copy(ROOT / "pyproject.toml", layout)
    run = subprocess.run(["lint-imports", "--no-cache"], capture_output=True, text=True, cwd=layout,
                         env={**os.environ, "PYTHONPATH": str(layout)})
    assert run.returncode != 0 and "yggdrasil.graphs.upward -> yggdrasil.compile.build" in run.stdout, run.stdout[-3000:]


@needs_linter
def test_plain_lint_imports_in_the_checkout_keeps_the_layers_inside_yggdrasil():
    """Without the mapped folders (optional layers there), the layers inside yggdrasil/ are checked."""
    run = subprocess.run(["lint-imports", "--no-cache"], capture_output=True, text=True, cwd=ROOT)
    assert run.returncode == 0 and "0 broken" in run.stdout, run.stdout[-4000:] + run.stderr[-2000:]


def test_a_layer_missing_from_the_installed_layout_fails_the_check(tmp_path):
    """The mapped folders are optional layers for a plain checkout, never for the installed layout."""
    lint = _lint_layers_module()
    layout = lint.installed_layout(tmp_path)
    assert lint.missing_layers(ROOT / "pyproject.toml", layout) == []
    shutil.rmtree(layout / "yggdrasil" / "planner")
    assert lint.missing_layers(ROOT / "pyproject.toml", layout) == ["yggdrasil.planner"]


def test_the_checkout_is_the_layout_no_symlinks_no_dual_imports():
    """One mapping from folders to packages (pyproject's package-dir): no symlinked packages, and no
    module that imports its siblings two ways depending on how it was started."""
    tracked = subprocess.run(["git", "ls-files", "-s"], capture_output=True, text=True, cwd=ROOT).stdout.splitlines()
    links = [line.split("\t")[1] for line in tracked if line.startswith("120000")]
    assert not links, f"symlinks in the checkout: {links}"
    by_folder = re.compile(r"^\s*(from|import) (bench|compile|graphs|predictor|planner)\b", re.M)
    dual = [str(path.relative_to(ROOT)) for folder in (*SOURCE_DIRS, "tests") for path in (ROOT / folder).rglob("*.py")
            if path != Path(__file__).resolve()
            and ("if __package__" in path.read_text() or by_folder.search(path.read_text()))]
    assert not dual, f"import them as yggdrasil.<package>.<module> instead: {dual}"


# Imports inside functions are kept for these only: slow, optional dependencies. The CLI's command
# modules are exempt (they import the runtime when a command runs, so --help never waits for torch).
# gguf and tokenizers: optional at run time (GGUF models only; the GPU image lacks gguf)
LAZY_ALLOWED = {"matplotlib", "httpx", "transformers", "triton", "torch", "readline", "gguf", "tokenizers",
                "jinja2"}  # jinja2: only a chat template needs it, 0.1 s of every bundle start
SOURCE_DIRS = ("yggdrasil", "compile", "graphs", "predictor", "planner", "bench")
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
    config = _lint_layers_module().pyproject_tool(ROOT / "pyproject.toml", "setuptools")
    found = set()
    for package, folder in config["package-dir"].items():
        for init in (ROOT / folder).rglob("__init__.py"):
            relative = init.parent.relative_to(ROOT / folder).parts
            if "results" not in relative:
                found.add(".".join((package, *relative)))
    assert found <= set(config["packages"]), sorted(found - set(config["packages"]))


def test_the_layout_copy_reads_package_dir_without_a_toml_reader(monkeypatch):
    """bench/gpu_session.sh copies the checkout into the installed layout on a device image that
    may have neither tomllib nor tomli: the one-line package-dir table is read without them."""
    spec = importlib.util.spec_from_file_location("installed_layout", ROOT / ".ci" / "installed_layout.py")
    layout = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(layout)
    with_toml = layout.package_dirs(ROOT / "pyproject.toml")
    monkeypatch.setattr(layout, "tomllib", None)
    assert layout.package_dirs(ROOT / "pyproject.toml") == with_toml and "yggdrasil.bench" in with_toml
