"""The layer contracts (pyproject.toml [tool.importlinter]) hold: each layer imports only the
layers below it, and the runtime never imports compile or bench. The check is import-linter's,
run as CI runs it (.ci/lint-imports)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(shutil.which("lint-imports") is None, reason="import-linter is not installed (test extra)")
def test_import_contracts_are_kept():
    run = subprocess.run(["bash", str(ROOT / ".ci" / "lint-imports")], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert "0 broken" in run.stdout
