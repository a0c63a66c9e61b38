"""Bundles whose buckets run Inductor's saved steps (recipe `steps: inductor`, yggdrasil/storage/inductor_steps.py),
the GPU image's path where AOTInductor packages cannot be loaded, checked end to end on the CPU:
compile saves each bucket's Inductor artifacts (and a CPU step's C++ kernels), and a fresh process
with empty caches opens the bundle generating nothing (no cache miss, no kernel built) and decodes
the AOTInductor bundle's greedy output, plainly and speculatively, with nothing compiled after."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
import yaml

from helpers import tiny_profile, write_tiny_recipe_dir

import yggdrasil.runtime.latency as latency
from yggdrasil.compile.build import build_bundle
from yggdrasil.compile.recipe import load_recipe
from yggdrasil.storage import inductor_steps
from yggdrasil.graphs.describe import describe
from yggdrasil.storage.layout import BundleLayout
from yggdrasil.storage.manifest import BundleError

PROMPT = "alpha beta gamma tree"
# a fresh process: open the bundle, greedy and speculative tokens, what opening generated, and
# whether anything compiled while decoding
OPEN_AND_GENERATE = """
import json, sys
from yggdrasil.bundle import dynamo_compilations, open_bundle
from yggdrasil.runtime.generate import greedy_tokens
from yggdrasil.sampling import SamplingParams
runtime = open_bundle(sys.argv[1], quiet=True).generator()
ids = runtime.tokenizer.encode(sys.argv[2])
before = dynamo_compilations()
plain = greedy_tokens(runtime.runner, ids, 24)
spec = runtime.speculator().generate(ids, 24, SamplingParams(temperature=0.0)).tokens
codegen = {role: vars(s.codegen) for role, s in runtime.graph_sets.items() if s.codegen is not None}
print(json.dumps({"plain": plain, "spec": spec, "codegen": codegen,
                  "compiled_after_open": dynamo_compilations() - before}))
"""


@pytest.fixture(scope="module")
def inductor_bundle(tmp_path_factory):
    root = tmp_path_factory.mktemp("inductor-steps")
    recipe = write_tiny_recipe_dir(root)
    recipe.write_text(yaml.safe_dump({**yaml.safe_load(recipe.read_text()), "steps": "inductor"}))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(latency, "measure_profile", lambda *args, **kwargs: tiny_profile())
        built = build_bundle(load_recipe(recipe), root / "bundle", log=lambda line: None)
    return recipe, built


def _fresh_process(bundle: Path, caches: Path) -> dict:
    """OPEN_AND_GENERATE in a child whose yggdrasil and Inductor caches are empty directories."""
    env = {**os.environ, "YGGDRASIL_CACHE_DIR": str(caches / "yggdrasil"),
           "TORCHINDUCTOR_CACHE_DIR": str(caches / "inductor")}
    done = subprocess.run([sys.executable, "-c", OPEN_AND_GENERATE, str(bundle), PROMPT], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_a_fresh_process_opens_inductor_steps_with_zero_codegen_and_the_aoti_output(inductor_bundle, tiny_bundle,
                                                                                     tmp_path):
    _, built = inductor_bundle
    assert built.manifest.steps == "inductor"
    files = sorted(p.relative_to(built.bundle).as_posix() for p in built.bundle.rglob("graphs/*/*"))
    assert files and all(f.endswith(".inductor") for f in files)  # no AOTInductor package, no serve graph
    assert not any("serve" in b for b in built.manifest.buckets)
    assert "Inductor's saved steps" in describe(built.manifest)
    with zipfile.ZipFile(built.bundle / files[0]) as archive:  # a CPU step carries its C++ kernels
        assert inductor_steps.ARTIFACTS in archive.namelist()
        assert any(n.startswith(inductor_steps.KERNELS) and n.endswith(".so") for n in archive.namelist())

    opened = _fresh_process(built.bundle, tmp_path / "empty-caches")
    assert opened["codegen"] == {role: {"fx_graph_misses": 0, "aot_autograd_misses": 0, "kernels_built": 0}
                                 for role in ("target", "draft")}
    assert opened["compiled_after_open"] == 0
    reference = _fresh_process(tiny_bundle[1], tmp_path / "aoti-caches")  # the same recipe, AOTInductor packages
    assert reference["codegen"] == {}
    assert opened["plain"] == reference["plain"] and opened["spec"] == opened["plain"]


@pytest.mark.slow
def test_an_unchanged_inductor_bundle_is_up_to_date(inductor_bundle):
    recipe, built = inductor_bundle
    logs = []
    again = build_bundle(load_recipe(recipe), built.bundle, log=logs.append)
    assert again.reused and again.manifest.bundle_id == built.manifest.bundle_id, logs


@pytest.mark.slow
def test_a_cache_miss_at_open_is_counted(inductor_bundle, tmp_path, monkeypatch):
    """Artifacts that do not fit (here: another ISA tag in the cache key, as on another CPU) are
    compiled at open, and the count says so (what the zero-codegen test would catch)."""
    from yggdrasil.models.hf_loader import load_hf_model

    recipe, built = inductor_bundle
    model = load_hf_model(recipe.parent / "tiny-random", torch.float32)
    cache = model.setup_cache(1, 256, stacked=False)
    tag = torch.compiler.config.cache_key_tag
    monkeypatch.setattr(torch.compiler.config, "cache_key_tag", f"{tag}|another-cpu")
    files = {"decode_w1": BundleLayout(built.bundle).graph_named("target", "decode_w1", "inductor")}
    steps, codegen = inductor_steps.load_steps(files, model, 256, cache.scratch_slot, tmp_path / "inductor")
    assert codegen.fx_graph_misses + codegen.aot_autograd_misses > 0 and not codegen.none, codegen
    tokens, positions, slots, mask, index = inductor_steps.warm_inputs("decode_w1", 256, cache.scratch_slot, "cpu")
    steps["decode_w1"](tokens, positions, slots, mask, index)  # warm: runs what it compiled
    with pytest.raises(inductor_steps.StepRecompiledError, match="decode_w1 compiled again at run time"):
        steps["decode_w1"](tokens.int(), positions, slots, mask, index)  # another dtype: a new graph


def test_a_damaged_step_file_is_refused_with_the_rebuild_command(tmp_path):
    from yggdrasil.storage.registry import load_graph_set
    from yggdrasil.models.model import Transformer
    from yggdrasil.config import ModelConfig

    layout = BundleLayout(tmp_path)
    path = layout.graph_named("target", "decode_w1", "inductor")
    path.parent.mkdir(parents=True)
    path.write_bytes(b"not a zip archive")
    model = Transformer(ModelConfig(arch="llama", vocab_size=32, dim=16, n_layers=1, n_heads=2, n_kv_heads=1,
                                    head_dim=8, ffn_dim=32, norm_eps=1e-5, rope_theta=1e4, max_position=128))
    model.setup_cache(1, 64, stacked=False)
    with pytest.raises(BundleError, match=r"target's compiled steps cannot be restored \(BadZipFile.*rebuild with RB"):
        load_graph_set(tmp_path, "target", model, ["decode_w1"], "RB", "hint", steps="inductor")
    shutil.rmtree(path.parent)
    with pytest.raises(BundleError, match="decode_w1.inductor is missing; rebuild with RB"):
        load_graph_set(tmp_path, "target", model, ["decode_w1"], "RB", "hint", steps="inductor")


def test_warm_inputs_write_only_the_scratch_slot_and_attend_slot_zero():
    tokens, positions, slots, mask, logit_index = inductor_steps.warm_inputs("verify_w4", 128, 129, "cpu")
    assert tokens.shape == (1, 4) and mask.shape == (1, 4, 128) and logit_index is None
    assert slots.eq(129).all() and mask[..., 0].all() and mask.sum() == 4
    *_, decode_index = inductor_steps.warm_inputs("decode_w1", 128, 129, "cpu")
    assert decode_index.shape == (1, 1)
    assert inductor_steps.warm_inputs("verify_hidden_w8", 64, 65, "cpu")[0].shape == (1, 8)
