"""Calibration is checkpointed per prompt (issue 24, item 4: a kill near the end of a 22-minute
calibration lost all of it): a compile killed while calibrating resumes on the next compile, and
what it saves equals an uninterrupted run's calibration, array for array."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from helpers import write_tiny_recipe_dir
from yggdrasil.runtime import latency
from yggdrasil.buckets import Grid
from yggdrasil.compile.calibrate import CHECKPOINT, REPROFILING, calibrate
from yggdrasil.compile.context import load_context
from yggdrasil.compile.recipe import load_recipe
from yggdrasil.compile.work_cache import work_root
from yggdrasil.runtime.drafters import LookupDrafter
from yggdrasil.models.hf_loader import load_hf_model
from yggdrasil.predictor.calibrate import Calibrator
from yggdrasil.predictor.checkpoint import CalibrationCheckpoint
from yggdrasil.runtime.steps import StepRunner

PROFILE = latency.LatencyProfile(draft=((1, 0.0),), verify=((1, 1.0), (2, 1.1), (4, 1.3)))
PROMPTS = 16


@pytest.fixture(scope="module")
def recipe(tmp_path_factory) -> Path:
    """The tiny target with lookup drafting; 16 calibration prompts of 16 tokens each (too few
    iterations to train the depth predictor, which would only slow the test)."""
    path = write_tiny_recipe_dir(tmp_path_factory.mktemp("recipe"))
    raw = yaml.safe_load(path.read_text())
    raw.update(draft="lookup", buckets={"depths": [1, 2, 3], "draft_widths": [1, 2], "verify_widths": [2, 4],
                                        "prefill_chunks": [16]},
               calibration={"prompts": ["tiny-prompts.jsonl"], "num_prompts": PROMPTS, "max_new_tokens": 16})
    path.write_text(yaml.safe_dump(raw))
    return path


def calibrate_here(recipe: Path, out: Path, monkeypatch, **kwargs) -> list[str]:
    """The compile's calibrate phase in this process, on a fixed step-time profile; its log."""
    monkeypatch.setattr(latency, "measure_profile", lambda *args, **kw: PROFILE)
    log = []
    calibrate(load_context(load_recipe(recipe), out, log.append), **kwargs)
    return log


def saved(out: Path) -> tuple[dict, dict]:
    directory = work_root(out) / "calibration"
    arrays = load_file(str(directory / "calibration.safetensors"))
    meta = yaml.safe_load((directory / "calibration.yaml").read_text())
    meta.pop("profile_quality")  # how busy the machine was while it was measured
    return arrays, meta


def assert_same_calibration(a: Path, b: Path) -> None:
    (arrays_a, meta_a), (arrays_b, meta_b) = saved(a), saved(b)
    assert arrays_a.keys() == arrays_b.keys()
    for name in arrays_a:
        assert arrays_a[name].dtype == arrays_b[name].dtype and torch.equal(arrays_a[name], arrays_b[name]), name
    assert meta_a == meta_b  # iterations, prompts, rank statistics, per-iteration hindsight...


@pytest.mark.slow
def test_a_compile_killed_while_calibrating_resumes_and_equals_an_uninterrupted_run(recipe, tmp_path, monkeypatch):
    out = tmp_path / "bundle"
    checkpoint = work_root(out) / CHECKPOINT
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with open(tmp_path / "compile.log", "w") as log_file:
        compile_run = subprocess.Popen([sys.executable, "-m", "yggdrasil", "compile", str(recipe), "--out", str(out)],
                                       stdout=log_file, stderr=subprocess.STDOUT, env=env)
        try:
            deadline = time.monotonic() + 600
            while not any(checkpoint.glob("prompt-*.safetensors")):  # one prompt's part is saved
                assert compile_run.poll() is None, (tmp_path / "compile.log").read_text()
                assert time.monotonic() < deadline, "no calibration checkpoint appeared"
                time.sleep(0.01)
            compile_run.send_signal(signal.SIGKILL)
        finally:
            compile_run.kill()
            compile_run.wait()
    assert compile_run.returncode == -signal.SIGKILL
    done = len(list(checkpoint.glob("prompt-*.safetensors")))
    assert 1 <= done < PROMPTS  # killed while calibrating
    assert not (work_root(out) / "calibration.key").exists()

    log = calibrate_here(recipe, out, monkeypatch)
    resumed = [line for line in log if line.startswith("resuming calibration")]
    assert resumed and resumed[0].startswith(f"resuming calibration: {done} of {PROMPTS} prompts were done"), log
    assert not checkpoint.exists()  # finished: the parts are gone, the calibration holds them

    calibrate_here(recipe, tmp_path / "uninterrupted", monkeypatch)
    assert_same_calibration(out, tmp_path / "uninterrupted")


def test_an_interrupted_reprofile_is_finished_by_the_next_compile(recipe, tmp_path, monkeypatch):
    out = tmp_path / "bundle"
    calibrate_here(recipe, out, monkeypatch)
    root = work_root(out)
    before = saved(out)
    key = (root / "calibration.key").read_text()
    (root / REPROFILING).write_text(key)  # what a kill during --reprofile leaves: no key, the marker
    (root / "calibration.key").unlink()
    log = calibrate_here(recipe, out, monkeypatch)
    assert "finishing an interrupted --reprofile" in log and not any("resuming calibration" in m for m in log)
    assert (root / "calibration.key").read_text() == key and not (root / REPROFILING).exists()
    after = saved(out)
    assert all(torch.equal(before[0][k], after[0][k]) for k in before[0])


def test_a_checkpoint_resumes_to_the_same_run_in_process(recipe, tmp_path):
    """Calibrator.run with a half-filled checkpoint returns the very run it returns without one."""
    model = load_hf_model(recipe.parent / "tiny-random", torch.float32)
    grid = Grid((1, 2, 3), (1, 2), (1, 2, 4))
    prompts = [[7 + (i * 5 + k) % 90 for k in range(6 + i)] for i in range(6)] + [list(range(250))]  # last: too long

    def calibrate_with(checkpoint=None):
        runner = StepRunner(model, 256, chunk_size=16)
        return Calibrator(runner, LookupDrafter(3, 2), grid).run(prompts, 12, frozenset(), show_progress=False,
                                                                  checkpoint=checkpoint)

    plain = calibrate_with()
    assert plain.skipped_prompts == 1
    full = CalibrationCheckpoint(tmp_path / "ck", "key")
    calibrate_with(full)
    for part in sorted(full.directory.glob("prompt-*.safetensors"))[::2]:
        part.unlink()  # as if killed: every other prompt is missing
    assert full.saved() == 3  # of 7 (the skipped prompt has a part too)
    resumed = calibrate_with(CalibrationCheckpoint(tmp_path / "ck", "key"))
    for name in plain.__dataclass_fields__:
        a, b = getattr(plain, name), getattr(resumed, name)
        assert (torch.equal(a, b) and a.dtype == b.dtype) if isinstance(a, torch.Tensor) else a == b, name


def test_a_checkpoint_for_other_work_is_discarded(tmp_path):
    log = []
    first = CalibrationCheckpoint(tmp_path / "ck", "one", log.append)
    first.save(0, {"hits": torch.tensor([1, 2]), "counts": torch.tensor([3, 4, 0])})
    assert CalibrationCheckpoint(tmp_path / "ck", "one", log.append).load(0)["hits"].tolist() == [1, 2]
    other = CalibrationCheckpoint(tmp_path / "ck", "two", log.append)
    assert other.saved() == 0 and other.load(0) is None
    assert log and "made for other models, prompts or settings" in log[0]
    (tmp_path / "ck" / "prompt-00003.safetensors").write_bytes(b"torn")  # damaged: run that prompt again
    assert other.load(3) is None and not (tmp_path / "ck" / "prompt-00003.safetensors").exists()
