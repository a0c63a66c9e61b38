"""bench/gpu_session.py's CPU dry run end to end (tiny model, prompt lookup), so that the
script a person with a GPU runs cannot rot: every step writes its file, the report holds every
section, steps resume from the folder, and a step run before its inputs exist says which to run."""

from __future__ import annotations

import json

import pytest

from yggdrasil.bench.gpu_session import main


@pytest.mark.slow
def test_cpu_dry_run_writes_a_complete_report_and_steps_resume(tmp_path, capsys):
    out = tmp_path / "session"
    args = ["--out", str(out), "--device", "cpu", "--tiny", "--draft", "lookup"]
    assert main(args) == 0
    for name in ("models", "compile", "tests", "measure", "report"):
        assert (out / f"{name}.json").is_file(), name
    report = json.loads((out / "report.json").read_text())
    assert report["tiny"] and report["torch"]
    assert set(report["tpot_ms"]) >= {"eager", "aoti_plain", "aoti_bundle"}
    assert all(v > 0 for v in report["tpot_ms"].values())
    assert report["agree"] is True
    assert set(report["agreement"]) >= {"aoti_plain", "bundle", "speculative"}  # bf16 on CPU: checked, not assumed
    assert report["tests"]["returncode"] == 0 and "skipped" in report["tests"]["summary"]  # no CUDA here
    assert report["capture_bytes"] == 0 and report["replays"] == {}  # nothing is captured on a CPU
    assert report["syncs_per_plain_step"] is None  # set_sync_debug_mode is CUDA's
    # one step alone, from the files the others left
    (out / "report.json").unlink()
    assert main(args + ["--step", "report"]) == 0
    assert json.loads((out / "report.json").read_text())["tpot_ms"] == report["tpot_ms"]


def test_a_step_without_its_inputs_names_the_step_to_run(tmp_path, capsys):
    out = tmp_path / "empty"
    assert main(["--out", str(out), "--device", "cpu", "--tiny", "--step", "measure"]) == 1
    assert "run --step compile first" in capsys.readouterr().err
    assert main(["--out", str(out), "--device", "cpu", "--tiny", "--step", "report"]) == 1
    assert "run --step models first" in capsys.readouterr().err


def test_cuda_without_a_gpu_is_refused_in_one_line(tmp_path, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert main(["--out", str(tmp_path / "s"), "--step", "models"]) == 1
    assert "CUDA is not available here" in capsys.readouterr().err
