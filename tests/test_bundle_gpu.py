"""CUDA: the tiny recipe compiled for CUDA, captured as CUDA graphs at load, replays to exactly
eager greedy output (skipped without a CUDA device)."""

from __future__ import annotations

import pytest
import torch
import yaml

from helpers import write_tiny_recipe_dir
from test_bundle import PROMPT

from yggdrasil.compile.build import build_bundle
from yggdrasil.compile.recipe import load_recipe
from yggdrasil.bundle import open_bundle


@pytest.mark.gpu
@pytest.mark.slow
def test_cuda_graph_capture_and_replay_match_eager(tmp_path):
    from yggdrasil.generate import greedy_tokens
    from yggdrasil.hf_loader import load_hf_model
    from yggdrasil.steps import StepRunner

    recipe_path = write_tiny_recipe_dir(tmp_path)
    raw = yaml.safe_load(recipe_path.read_text())
    raw.update(device="cuda", name="tiny-random-cuda")
    recipe_path.write_text(yaml.safe_dump(raw))
    build_bundle(load_recipe(recipe_path), tmp_path / "bundle")
    runtime = open_bundle(tmp_path / "bundle", quiet=True).generator()
    print(f"CUDA graph capture memory: {runtime.capture_bytes / 2**20:.1f} MiB")
    assert runtime.capture_bytes >= 0
    assert all(type(g).__name__ == "CapturedStep" for s in runtime.graph_sets.values() for g in s.graphs.values())
    ids = runtime.target.tokenizer.encode(PROMPT)
    model = load_hf_model(tmp_path / "tiny-random", torch.float32, "cuda")
    expected = greedy_tokens(StepRunner(model, 256, 16), ids, 24)
    assert greedy_tokens(runtime.runner, ids, 24) == expected
    spec = runtime.speculator()
    if spec is not None:
        from yggdrasil.sampling import SamplingParams

        assert spec.generate(ids, 24, SamplingParams(temperature=0.0)).tokens == expected
