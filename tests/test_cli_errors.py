"""Every bad command line gets one line on stderr that says what to do, a non-zero exit and no
traceback: the real CLI in a fresh process, as a user runs it (issue 24's cases and a few older
ones). Serve's own flags (--port, --kv-budget) are tested with serve."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

FILE = "{file}"  # stands for a regular file where a bundle directory belongs
DIRECTORY = "{directory}"  # an empty directory: not a bundle
MISSING = "{missing}"  # a path that does not exist

CASES = {
    # a bundle path that is a regular file
    "generate --bundle FILE": (["generate", "--bundle", FILE, "--prompt", "hi"], "is a file, not a bundle directory"),
    "serve FILE": (["serve", FILE], "is a file, not a bundle directory"),
    "inspect FILE": (["inspect", FILE], "is a file, not a bundle directory"),
    "chat FILE": (["chat", FILE], "is a file, not a bundle directory"),
    # values that used to be accepted
    "generate --chunk-size 0": (["generate", "--prompt", "hi", "--chunk-size", "0"], "--chunk-size must be >= 1"),
    "generate --seed -1": (["generate", "--prompt", "hi", "--seed", "-1"], "--seed must be an integer from 0"),
    "chat --seed -1": (["chat", DIRECTORY, "--seed", "-1"], "--seed must be an integer from 0"),
    "generate --seed 2**64": (["generate", "--prompt", "hi", "--seed", str(2**64)], "--seed must be an integer"),
    # flags a bundle fixes
    "generate --bundle --max-context": (["generate", "--bundle", DIRECTORY, "--prompt", "hi", "--max-context", "512"],
                                        "drop --max-context"),
    "generate --bundle --chunk-size": (["generate", "--bundle", DIRECTORY, "--prompt", "hi", "--chunk-size", "32"],
                                       "drop --chunk-size"),
    "generate --no-spec without a bundle": (["generate", "--prompt", "hi", "--no-spec"], "--no-spec is for --bundle"),
    # older cases, kept honest
    "compile missing recipe": (["compile", MISSING + ".yaml"], "does not exist"),
    "inspect a directory that is not a bundle": (["inspect", DIRECTORY], "is not a bundle (no manifest.yaml)"),
    "generate --bundle missing": (["generate", "--bundle", MISSING, "--prompt", "hi"], "is not a bundle"),
    "generate --max-context 1": (["generate", "--prompt", "hi", "--max-context", "1"], "--max-context must be >= 2"),
    "generate --max-new-tokens 0": (["generate", "--prompt", "hi", "--max-new-tokens", "0"],
                                    "--max-new-tokens must be >= 1"),
    "generate --top-p 0": (["generate", "--prompt", "hi", "--top-p", "0"], "top_p must be in (0, 1]"),
    "chat --max-new-tokens 0": (["chat", DIRECTORY, "--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
}


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("cli-errors")
    (root / "bundle.txt").write_text("not a bundle\n")
    (root / "empty").mkdir()
    return {FILE: str(root / "bundle.txt"), DIRECTORY: str(root / "empty"), MISSING: str(root / "missing")}


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_is_one_line_without_a_traceback(name, paths, tmp_path):
    args, expected = CASES[name]
    args = [paths.get(arg, arg.replace(MISSING, paths[MISSING])) for arg in args]
    before = sorted(p.name for p in Path(paths[DIRECTORY]).parent.rglob("*"))
    run = subprocess.run([sys.executable, "-m", "yggdrasil", *args], capture_output=True, text=True,
                         stdin=subprocess.DEVNULL, timeout=300, cwd=tmp_path)
    lines = run.stderr.strip().splitlines()
    assert run.returncode != 0, run.stderr
    assert "Traceback" not in run.stderr, run.stderr
    assert len(lines) == 1, run.stderr
    assert lines[0].startswith("error: ") and expected in lines[0], lines[0]
    assert sorted(p.name for p in Path(paths[DIRECTORY]).parent.rglob("*")) == before  # nothing written
