"""Bundles whose buckets run the models' eager steps (recipe `steps`; compile/loader_check.py):
for a torch that compiles AOTInductor packages it cannot load, as on the lent GPU image, where
the loader dies with SIGSEGV. Such a bundle compiles and ships no package, opens without one, and
generates the plain-PyTorch greedy output; `steps: auto` finds the crash in a child process."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from helpers import TINY_RECIPE, tiny_profile, write_tiny_recipe_dir

import yggdrasil.compile.aoti as aoti
import yggdrasil.compile.loader_check as loader_check
import yggdrasil.runtime.latency as latency
from yggdrasil.bundle import open_bundle
from yggdrasil.compile.build import build_bundle
from yggdrasil.compile.context import BuildContext
from yggdrasil.compile.recipe import RecipeError, load_recipe
from yggdrasil.runtime.generate import greedy_tokens
from yggdrasil.graphs.layout import BundleLayout
from yggdrasil.graphs.describe import describe
from yggdrasil.graphs.manifest import BundleError, read_manifest
from yggdrasil.graphs.registry import EagerStep
from yggdrasil.models.hf_loader import load_hf_model
from yggdrasil.sampling import SamplingParams
from yggdrasil.runtime.steps import StepRunner

PROMPT = "alpha beta gamma tree"


def _recipe_with(directory: Path, **keys) -> Path:
    path = write_tiny_recipe_dir(directory)
    body = yaml.safe_load(path.read_text())
    path.write_text(yaml.safe_dump({**body, **keys}))
    return path


@pytest.fixture(scope="module")
def eager_bundle(tmp_path_factory):
    root = tmp_path_factory.mktemp("eager-steps")
    recipe = _recipe_with(root, steps="eager")

    def no_packages(*args, **kwargs):
        raise AssertionError("an eager-steps bundle compiled an AOTInductor package")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(latency, "measure_profile", lambda *args, **kwargs: tiny_profile())
        patch.setattr(aoti, "package_graph", no_packages)
        built = build_bundle(load_recipe(recipe), root / "bundle", log=lambda line: None)
    return recipe, built


@pytest.mark.slow
def test_an_eager_steps_bundle_ships_no_package_and_generates_plain_greedy(eager_bundle):
    recipe, built = eager_bundle
    assert built.manifest.steps == "eager"
    assert not list(built.bundle.rglob("*.pt2"))
    assert built.manifest.buckets and not any(b.endswith("serve") for b in built.manifest.buckets)
    assert "the models' eager steps" in describe(built.manifest)
    manifest, _ = read_manifest(built.bundle, "rebuild")  # written, hashed and read back
    assert manifest.steps == "eager" and manifest.bundle_id == built.manifest.bundle_id

    runtime = open_bundle(built.bundle, quiet=True).generator()
    steps = [g for s in runtime.graph_sets.values() for g in s.graphs.values()]
    assert steps and all(isinstance(g, EagerStep) for g in steps)
    ids = runtime.tokenizer.encode(PROMPT)
    reference = StepRunner(load_hf_model(recipe.parent / "tiny-random", runtime.target.model.dtype), 256, 16)
    expected = greedy_tokens(reference, ids, 24)
    assert greedy_tokens(runtime.runner, ids, 24) == expected
    speculated = runtime.speculator().generate(ids, 24, SamplingParams(temperature=0.0))
    assert speculated.tokens == expected and speculated.spec.aal > 1.0
    assert sum(s.calls for s in runtime.graph_sets.values()) > 0  # decoding went through the eager steps


@pytest.mark.slow
def test_an_eager_steps_bundle_serves_on_the_eager_pool_step(eager_bundle):
    _, built = eager_bundle
    assert open_bundle(built.bundle, quiet=True).serve_graphs() == {}


def test_a_package_that_crashes_its_loader_is_found_in_a_child_process(tmp_path, monkeypatch):
    # the child dies as the GPU image's loader does: SIGSEGV, before it can say anything
    (tmp_path / "sitecustomize.py").write_text("import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    failure = loader_check.package_load_failure(tmp_path / "decode_w1.pt2", "cpu")
    assert failure == "opening decode_w1.pt2 killed the process (SIGSEGV)"


def test_a_package_the_loader_refuses_is_reported_with_its_error(tmp_path):
    (tmp_path / "decode_w1.pt2").write_bytes(b"not a zip archive")
    failure = loader_check.package_load_failure(tmp_path / "decode_w1.pt2", "cpu")
    assert failure is not None and failure.startswith("opening decode_w1.pt2 failed (exit 1: ")


@pytest.mark.slow
def test_a_package_torch_loads_passes_the_check(tiny_bundle):
    package = tiny_bundle[1] / "graphs" / "target" / "decode_w1.pt2"
    assert loader_check.package_load_failure(package, "cpu") is None


def _context(tmp_path: Path, device: str, steps: str, logs: list) -> BuildContext:
    recipe = load_recipe(_recipe_with(tmp_path, steps=steps))
    recipe = replace(recipe, device=device)
    return BuildContext(recipe, tmp_path / "bundle", BundleLayout(tmp_path / "work"), None, "rebuild", None, None,
                        {}, log=logs.append)


@pytest.mark.parametrize("device, steps, loads, expected", [
    ("cuda", "auto", False, "eager"), ("cuda", "auto", True, "aoti"), ("cpu", "auto", False, "aoti"),
    ("cuda", "aoti", False, "aoti"), ("cpu", "eager", True, "eager")])
def test_auto_falls_back_to_eager_steps_only_where_a_cuda_package_does_not_load(tmp_path, monkeypatch, device, steps,
                                                                               loads, expected):
    from yggdrasil.buckets import GraphKey

    compiled, checked, logs = [], [], []
    monkeypatch.setattr(loader_check, "compile_graphs", lambda ctx, keys: compiled.extend(keys) or len(keys))

    def failure(package, device):
        checked.append(package)
        return None if loads else "opening decode_w1.pt2 killed the process (SIGSEGV)"

    monkeypatch.setattr(loader_check, "package_load_failure", failure)
    keys = [GraphKey("serve", 0), GraphKey("decode", 1), GraphKey("verify", 4)]
    ctx = loader_check.decide_steps(_context(tmp_path, device, steps, logs), keys)
    assert ctx.steps == expected
    probed = device == "cuda" and steps == "auto"
    assert compiled == ([keys[1]] if probed else []) and len(checked) == int(probed)  # one package, not a serve one
    assert any("SIGSEGV" in line and "eager steps" in line for line in logs) == (expected == "eager" and probed)


def test_the_recipe_refuses_an_unknown_steps_value(tmp_path):
    with pytest.raises(RecipeError, match="steps must be one of auto, aoti, eager"):
        load_recipe(_recipe_with(tmp_path, steps="jit"))
    assert load_recipe(TINY_RECIPE).steps == "auto"


def test_a_manifest_with_unknown_steps_is_refused_as_malformed(tiny_bundle, tmp_path):
    import shutil

    from yggdrasil.graphs.manifest import integrity

    bundle = tmp_path / "b"
    shutil.copytree(tiny_bundle[1], bundle)
    path = BundleLayout(bundle).manifest
    raw = yaml.safe_load(path.read_text())
    assert "steps" not in raw  # a bundle of packages writes what bundles always wrote
    raw["steps"] = "jit"
    raw["integrity"] = integrity({k: v for k, v in raw.items() if k != "integrity"})
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(BundleError, match="malformed.*steps 'jit' is none of aoti, eager"):
        read_manifest(bundle, "rebuild")


def test_a_cuda_package_that_fails_to_compile_also_means_eager_steps(tmp_path, monkeypatch):
    from yggdrasil.buckets import GraphKey

    def broken(ctx, keys):
        raise RuntimeError("nvcc not found\nmore")

    logs = []
    monkeypatch.setattr(loader_check, "compile_graphs", broken)
    ctx = loader_check.decide_steps(_context(tmp_path, "cuda", "auto", logs), [GraphKey("decode", 1)])
    assert ctx.steps == "eager"
    assert any("compiling decode_w1 failed (RuntimeError: nvcc not found)" in line for line in logs)
