"""bench/gpu_session.py, the one command a lent GPU runs (issues 23, 36), checked on a CPU so that
it cannot rot: its CPU dry run end to end with the packages the device image lacks hidden
(gguf, the server's), every recipe it can write passes the recipe loader, small --layers work,
and a step run before its inputs exist says which to run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from yggdrasil.bench.gpu_session import STEPS, Session, main, session_recipe, shape_of, draft_layers_of
from yggdrasil.compile.recipe import load_recipe

REPO = Path(__file__).resolve().parent.parent
# what the device image does not have (bench/gpu_session.py's REQUIRED does not need them)
HIDDEN = ("gguf", "fastapi", "uvicorn", "starlette", "openai", "importlinter")


def _hide_packages(directory: Path) -> dict:
    """An environment whose Python cannot import HIDDEN (a sitecustomize on PYTHONPATH)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "sitecustomize.py").write_text(
        "import sys\n"
        "class _Hide:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        f"        if name.split('.')[0] in {HIDDEN!r}:\n"
        "            raise ImportError(f'{name} is not on the device image')\n"
        "sys.meta_path.insert(0, _Hide())\n"
        # no install either: the device runs a plain checkout (pip install -e's finder dropped)
        "sys.meta_path[:] = [f for f in sys.meta_path if not getattr(f, '__module__', '').startswith('__editable__')]\n")
    return {**os.environ, "PYTHONPATH": str(directory)}


@pytest.mark.slow
@pytest.mark.parametrize("steps", ["inductor"])
def test_cpu_dry_run_without_the_packages_the_device_lacks(tmp_path, steps):
    """Every step of the GPU command on a CPU with steps inductor, what the lent GPU image gets
    (its torch cannot load packages). Dry runs with steps aoti (what other images would get) and
    eager differ from it only in the bundle's steps, which the rest of the suite and
    tests/test_eager_steps.py cover; on a 2-core Xeon the aoti one took 225 s, the eager one 112 s."""
    out, reports = tmp_path / "session", tmp_path / "reports"
    env = _hide_packages(tmp_path / "hide")
    args = ["--out", str(out), "--report-dir", str(reports), "--device", "cpu", "--tiny", "--draft", "lookup",
            "--steps", steps]
    env.update(PYTHON=sys.executable, TMPDIR=str(tmp_path), YGGDRASIL_CACHE_DIR=str(tmp_path / "cache"))
    done = subprocess.run(["sh", str(REPO / "bench" / "gpu_session.sh"), *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for name in STEPS[:-1]:
        assert (out / f"{name}.json").is_file(), name
    report = json.loads((reports / "report.json").read_text())  # copied for the device tool's $OUT
    assert all(report["steps"].values()), report["steps"]
    assert report["preflight"]["versions"]["gguf"] is None  # hidden, and not needed
    assert report["tiny"] and report["torch"]
    assert report["preflight"]["package"] == str(REPO), report["preflight"]  # the checkout itself, no copy
    variants = report["measure"]["variants"]
    assert report["measure"]["steps"] == steps
    assert set(variants) >= {"eager", "aoti_bundle", "egt_policy"}
    assert ("aoti_plain" in variants) == (steps == "aoti")  # only packages can be called plainly
    graph_files = {p.suffix for p in (out / "bundle" / "graphs").rglob("*.*")} if steps != "eager" else set()
    assert graph_files == {"aoti": {".pt2"}, "inductor": {".inductor"}, "eager": set()}[steps]
    assert all(v["tpot_ms"] > 0 and v["ok"] for v in variants.values()), variants
    assert variants["aoti_bundle"]["exact"] == "4/4"  # the reference itself
    assert variants["egt_policy"]["aal"] >= 1 and variants["egt_policy"]["host_reads_per_iteration"] > 0
    assert variants["egt_policy"]["gpu_idle_us_per_iteration"] is None  # no captured graph to time on a CPU
    assert report["measure"]["agree"] is True
    tests = report["tests"]
    assert tests["returncode"] == 0 and "skipped" in tests["summary"] and tests["on_session_bundle"]
    assert report["measure"]["capture_bytes"] == 0 and report["measure"]["replays"] == {}  # CPU: no capture
    assert (reports / "compile.log").is_file() and (reports / "tests.log").is_file()
    assert (reports / "measure.log").is_file()
    # one step alone, from the files the others left
    (out / "report.json").unlink()
    assert main(args + ["--step", "report"]) == 0
    assert json.loads((out / "report.json").read_text())["measure"]["variants"].keys() == variants.keys()


def test_tests_are_skipped_when_compile_failed(tmp_path):
    from yggdrasil.bench.gpu_session import step_tests

    session = Session(tmp_path, device="cpu", tiny=True)
    session.write("compile.json", {"error": "SessionError: compile failed (exit 1)"})
    assert step_tests(session, 5.0) == {"skipped": "compile failed: no session bundle to test (see the compile step)"}


def test_a_child_past_its_share_is_stopped_with_its_whole_group(tmp_path):
    """run_child (compile, tests and the measure step's child) stops the child's process group at
    its budget and says so (None), keeping what it printed."""
    from yggdrasil.bench.gpu_session import run_child

    command = [sys.executable, "-c", "import subprocess, sys, time; print('started', flush=True); "
               "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); time.sleep(60)"]
    status, output = run_child(command, 1.0, tmp_path / "child.log")
    assert status is None and "started" in output


@pytest.mark.parametrize("argv", [["--tiny"], [], ["--scale", "full"], ["--layers", "2"], ["--layers", "1"],
                                  ["--draft", "lookup"], ["--layers", "3", "--draft-layers", "2"],
                                  ["--steps", "eager"], ["--steps", "aoti"], ["--steps", "inductor"]])
def test_every_recipe_the_session_writes_is_valid(tmp_path, argv):
    """The recipe loader accepts every recipe the session can write (before issue 36 the
    non-tiny one had verify widths that were no multiple of its tile, and only --tiny ran here)."""
    from yggdrasil.bench.gpu_session import parse_args

    session, _ = parse_args(["--out", str(tmp_path / "s"), *argv])
    (tmp_path / "s" / "recipe.yaml").write_text(yaml.safe_dump(session_recipe(session)))
    recipe = load_recipe(tmp_path / "s" / "recipe.yaml")
    assert recipe.device == "cuda" and recipe.dtype == "bfloat16"
    assert recipe.steps == session.steps
    assert 1 <= draft_layers_of(session) <= shape_of(session)["num_hidden_layers"]


@pytest.mark.slow
def test_fewer_target_layers_than_the_draft_default(tmp_path):
    """--layers below the draft's default layer count builds (the draft is clipped to the target)."""
    from yggdrasil.bench.gpu_session import step_models
    from yggdrasil.models.hf_loader import load_hf_model

    session = Session(tmp_path, device="cpu", tiny=True, layers=1, draft_layers=4)
    body = step_models(session)
    assert body["draft_layers"] == 1
    draft = load_hf_model(tmp_path / "models" / "draft", __import__("torch").bfloat16)
    assert draft.config.n_layers == 1


def test_a_step_without_its_inputs_names_the_step_to_run(tmp_path, capsys):
    out = tmp_path / "empty"
    assert main(["--out", str(out), "--device", "cpu", "--tiny", "--step", "measure"]) == 1
    assert "run --step compile first" in capsys.readouterr().err
    assert main(["--out", str(out), "--device", "cpu", "--tiny", "--step", "compile"]) == 1
    assert "run --step models first" in capsys.readouterr().err


def test_cuda_without_a_gpu_is_refused_in_one_line(tmp_path, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert main(["--out", str(tmp_path / "s"), "--step", "models"]) == 1
    assert "CUDA is not available here" in capsys.readouterr().err


def test_the_device_command_fits_the_tool(tmp_path):
    """bench/gpu_session.cmd is what a session pastes into the device tool: one command under
    its 2,000-character limit that runs the session with the image's python3 into $OUT."""
    command = (REPO / "bench" / "gpu_session.cmd").read_text().strip()
    assert len(command) < 2000 and "\n" not in command
    assert "gpu_session" in command and "$OUT" in command and "pip install" not in command.split("&&")[0]
