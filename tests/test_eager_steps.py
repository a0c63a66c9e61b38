"""Bundles whose buckets run the models' eager steps (recipe `steps`; compile/loader_check.py):
for a torch that compiles AOTInductor packages it cannot load, as on the lent GPU image, where
the loader dies with SIGSEGV. Such a bundle compiles and ships no package, opens without one, and
generates the plain-PyTorch greedy output. `steps: auto` finds the crash with a probe package in a
child process (and then runs Inductor's saved steps: tests/test_inductor_steps.py)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from helpers import TINY_RECIPE, tiny_profile, write_tiny_recipe_dir

import yggdrasil.graphs.aoti as aoti
import yggdrasil.compile.loader_check as loader_check
import yggdrasil.runtime.latency as latency
from yggdrasil.bundle import open_bundle
from yggdrasil.compile.build import build_bundle
from yggdrasil.compile.context import BuildContext
from yggdrasil.compile.recipe import RecipeError, load_recipe
from yggdrasil.runtime.generate import greedy_tokens
from yggdrasil.storage.layout import BundleLayout
from yggdrasil.graphs.describe import describe
from yggdrasil.storage.manifest import BundleError, read_manifest
from yggdrasil.storage.registry import EagerStep
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


@pytest.mark.slow
def test_an_unchanged_eager_steps_bundle_is_up_to_date(eager_bundle):
    """It has no serve graph, which only a bundle of packages must have (before issue 49 every
    compile of an eager bundle rebuilt it, calling it an older bundle without serve graphs)."""
    recipe, built = eager_bundle
    logs = []
    again = build_bundle(load_recipe(recipe), built.bundle, log=logs.append)
    assert again.reused and again.manifest.bundle_id == built.manifest.bundle_id, logs


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
    ("cuda", "auto", False, "inductor"), ("cuda", "auto", True, "aoti"), ("cpu", "auto", False, "aoti"),
    ("cuda", "aoti", False, "aoti"), ("cpu", "eager", True, "eager"), ("cpu", "inductor", True, "inductor")])
def test_auto_runs_inductor_steps_only_where_a_cuda_package_does_not_load(tmp_path, monkeypatch, device, steps,
                                                                         loads, expected):
    probed, logs = [], []

    def probe(device, log):
        probed.append(device)
        failure = None if loads else "opening linear.pt2 killed the process (SIGSEGV)"
        return loader_check.ProbeVerdict(device, loads, failure, str(tmp_path / "linear.pt2"))

    monkeypatch.setattr(loader_check, "aoti_probe", probe)
    ctx = loader_check.decide_steps(_context(tmp_path, device, steps, logs))
    assert ctx.steps == expected
    assert probed == (["cuda"] if device == "cuda" and steps == "auto" else [])  # a CPU never asks
    assert any("SIGSEGV" in line and "Inductor's saved steps" in line for line in logs) == (expected == "inductor"
                                                                                          and bool(probed))


def test_the_probe_verdict_is_kept_per_machine_and_a_timeout_is_not(tmp_path, monkeypatch):
    calls = []

    def child(args, timeout_s, what, env=None):
        calls.append(args[0])
        return {"build": None, "load": "opening linear.pt2 killed the process (SIGSEGV)"}[args[0]]

    monkeypatch.setattr(loader_check, "child_failure", child)
    first = loader_check.aoti_probe("cuda", log=lambda line: None, directory=tmp_path / "p")
    assert (first.loads, first.cached, calls) == (False, False, ["build", "load"])
    assert first.failure.endswith("(SIGSEGV)") and first.package == str(tmp_path / "p" / "linear.pt2")
    again = loader_check.aoti_probe("cuda", log=lambda line: None, directory=tmp_path / "p")
    assert (again.loads, again.cached, again.failure, calls) == (False, True, first.failure, ["build", "load"])

    monkeypatch.setattr(loader_check, "child_failure",
                        lambda args, timeout_s, what, env=None: f"{what} in a child process did not finish in 1 s")
    slow = loader_check.aoti_probe("cuda", log=lambda line: None, directory=tmp_path / "q")
    assert not slow.loads and not (tmp_path / "q" / "verdict.json").exists()  # asked again next time
    assert loader_check.probe_key("cpu") == loader_check.probe_key("cpu") != ""


def test_inductor_steps_on_a_cpu_are_native_only(tmp_path):
    from yggdrasil.graphs.isa import IsaError

    with pytest.raises(RecipeError, match="steps: inductor compiles for this CPU only"):
        load_recipe(_recipe_with(tmp_path, steps="inductor", isa="avx2"))
    ctx = _context(tmp_path, "cpu", "inductor", [])
    with pytest.raises(IsaError, match="--isa avx2 needs steps: aoti"):  # --isa given on the command line
        loader_check.decide_steps(replace(ctx, recipe=replace(ctx.recipe, isa="avx2")))


def test_the_recipe_refuses_an_unknown_steps_value(tmp_path):
    with pytest.raises(RecipeError, match="steps must be one of auto, aoti, inductor, eager"):
        load_recipe(_recipe_with(tmp_path, steps="jit"))
    assert load_recipe(TINY_RECIPE).steps == "auto"


def test_a_manifest_with_unknown_steps_is_refused_as_malformed(tiny_bundle, tmp_path):
    import shutil

    from yggdrasil.storage.manifest import integrity

    bundle = tmp_path / "b"
    shutil.copytree(tiny_bundle[1], bundle)
    path = BundleLayout(bundle).manifest
    raw = yaml.safe_load(path.read_text())
    assert "steps" not in raw  # a bundle of packages writes what bundles always wrote
    raw["steps"] = "jit"
    raw["integrity"] = integrity({k: v for k, v in raw.items() if k != "integrity"})
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(BundleError, match="malformed.*steps 'jit' is none of aoti, inductor, eager"):
        read_manifest(bundle, "rebuild")
