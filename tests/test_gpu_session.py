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
@pytest.mark.parametrize("steps", ["inductor", "aoti", "eager"])
def test_cpu_dry_run_without_the_packages_the_device_lacks(tmp_path, steps):
    """Every step of the GPU command on a CPU: steps inductor is what the lent GPU image gets
    (its torch cannot load packages), and runs the sweep, the prediction and the probe too;
    aoti and eager skip those three (the same on every steps kind) to keep CI short."""
    out, reports = tmp_path / "session", tmp_path / "reports"
    env = _hide_packages(tmp_path / "hide")
    skip = [] if steps == "inductor" else ["--skip", "sweep,predict,probe"]
    args = ["--out", str(out), "--report-dir", str(reports), "--device", "cpu", "--tiny", "--draft", "lookup",
            "--steps", steps, *skip]
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
    if steps == "inductor":
        sweep = report["sweep"]
        assert set(sweep["target"]["inductor_ms"]) == {"1", "2", "4"} and sweep["draft"]["eager_ms"]["1"] > 0
        here = report["predict"]["inductor"]["here"]
        assert here["best"] and here["predicted_speedup_over_ar"] >= 1.0 and report["predict"]["acceptance"]
        assert report["probe"]["loads"] is True and report["probe"]["load"]["outcome"] == "loaded"
        assert (reports / "sweep.log").is_file() and (reports / "measure.log").is_file()
    else:
        assert all(report[name] == {"skipped": "--skip", "seconds": report[name]["seconds"]}
                   for name in ("sweep", "predict", "probe"))
    # one step alone, from the files the others left
    (out / "report.json").unlink()
    assert main(args + ["--step", "report"]) == 0
    assert json.loads((out / "report.json").read_text())["measure"]["variants"].keys() == variants.keys()


def test_tests_are_skipped_when_compile_failed(tmp_path):
    from yggdrasil.bench.gpu_session import step_tests

    session = Session(tmp_path, device="cpu", tiny=True)
    session.write("compile.json", {"error": "SessionError: compile failed (exit 1)"})
    assert step_tests(session, 5.0) == {"skipped": "compile failed: no session bundle to test (see the compile step)"}


def test_a_child_step_past_its_share_is_stopped_and_says_so(tmp_path):
    from yggdrasil.bench.gpu_session import SessionError, _child_step

    session = Session(tmp_path, device="cpu", tiny=True)
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    with pytest.raises(SessionError, match="the sweep step was stopped after 1 s"):
        _child_step(session, "sweep", 1.0, sleeper)
    assert sleeper.poll() is not None


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


@pytest.mark.slow
def test_the_probe_diagnoses_its_package_in_children_and_keeps_its_verdict(tmp_path, monkeypatch):
    """bench/gpu_probe.py on a CPU: compile/loader_check builds the one-Linear probe package and
    opens it in a child; the diagnosis reads its library (ldd, readelf), opens it again with
    LD_DEBUG and the mapped libcuda printed, and says why it cannot preload a driver libcuda."""
    from yggdrasil.bench.gpu_probe import main as probe

    monkeypatch.setenv("YGGDRASIL_CACHE_DIR", str(tmp_path / "cache"))
    assert probe(["--out", str(tmp_path / "p"), "--device", "cpu"]) == 0
    report = json.loads((tmp_path / "p" / "probe.json").read_text())
    assert report["loads"] is True and report["failure"] is None and not report["probe_cached"]
    assert any("libc.so" in line for line in report["ldd"]), report["ldd"]
    assert any("NEEDED" in line for line in report["readelf"]), report["readelf"]
    assert report["load"]["outcome"] == "loaded" and report["load"]["libcuda_mapped"] == "no libcuda"
    assert report["driver_libcuda"] is None and report["preload"]["outcome"].startswith("not tried")
    assert probe(["--out", str(tmp_path / "q"), "--device", "cpu"]) == 0  # the verdict is kept
    assert json.loads((tmp_path / "q" / "probe.json").read_text())["probe_cached"] is True

def _acceptance(mean_accepted, depths=(1, 2, 4), widths=(1, 2), verifies=(1, 2, 4, 8)) -> dict:
    return {"grid": {"depths": list(depths), "widths": list(widths), "verifies": list(verifies)},
            "mean_accepted": mean_accepted, "mean_capped": [0.9, 1.6, 2.6], "models": {}, "cpu_latency":
            {"draft": [[1, 0.01], [2, 0.012]], "verify": [[1, 0.03], [2, 0.045], [4, 0.08], [8, 0.16]]}}


def test_the_prediction_picks_bigger_trees_on_a_flat_curve_and_never_an_undrafted_one():
    """predict() runs the objective on measured step times: a flat GPU-like verify curve pays
    for the widest tree, a CPU-like steep one does not; a bucket calibration never drafted
    (None) is never chosen, however well it would look."""
    from yggdrasil.bench.gpu_sweep import predict

    # [depths][widths][verifies]: deeper and wider trees accept more, up to what V keeps (V = 1
    # keeps only the root: a plain decode step)
    mean = [[[0.0, 0.8, 0.8, 0.8], [0.0, 0.9, 0.9, 0.9]],
            [[0.0, 1.2, 1.4, 1.4], [0.0, 1.3, 1.7, 1.7]],
            [[0.0, 1.3, 2.0, 2.6], [0.0, 1.4, 2.2, 3.1]]]
    flat = {"target": {"inductor_ms": {"1": 10.0, "2": 10.0, "4": 10.1, "8": 10.2}},
            "draft": {"inductor_ms": {"1": 1.0, "2": 1.0, "4": 1.0, "8": 1.0}}}
    result = predict(flat, _acceptance(mean))
    assert result["here"]["best"] == "D4xW2/V8" and result["here"]["predicted_speedup_over_ar"] > 2.5
    assert result["here"]["ar_ms"] == 10.0 and result["here"]["aal"] == 4.1
    assert result["calibration_cpu"]["best"] != "D4xW2/V8"  # the CPU curve is steep: a smaller tree
    assert "prediction" in result["note"]
    mean[2][1][3] = None  # D4xW2 was not drafted by calibration
    assert predict(flat, _acceptance(mean))["here"]["best"] != "D4xW2/V8"


@pytest.mark.slow
def test_the_acceptance_summary_reads_a_calibration_directory(tiny_bundle):
    from yggdrasil.bench.gpu_sweep import acceptance_summary, predict

    summary = acceptance_summary(tiny_bundle[1] / "calibration")
    depths, widths, verifies = (summary["grid"][k] for k in ("depths", "widths", "verifies"))
    assert len(summary["mean_accepted"]) == len(depths) and len(summary["mean_accepted"][0]) == len(widths)
    assert len(summary["mean_accepted"][0][0]) == len(verifies) and summary["iterations"] > 0
    json.dumps(summary)  # committed as JSON
    flat = {role: {"inductor_ms": {str(n): 1.0 for n in (1, 2, 4, 8)}} for role in ("target", "draft")}
    assert predict(flat, summary)["here"]["predicted_speedup_over_ar"] >= 1.0
