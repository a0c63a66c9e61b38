"""Bundles end to end on the tiny recipe: compile once, load in a fresh process, generate exactly
what eager greedy decoding generates with zero compilations, and refuse every kind of broken
or foreign bundle with its own message."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from helpers import TINY_RECIPE as RECIPE
from helpers import forbid_model_conversion

from yggdrasil.compile.build import build_bundle
from yggdrasil.compile.recipe import load_recipe
from yggdrasil.storage.manifest import BundleError, read_manifest
from yggdrasil.bundle import open_bundle
from yggdrasil.runtime.generate import greedy_tokens
from yggdrasil.sampling import SamplingParams
from yggdrasil.models.tokenizer import load_saved_tokenizer

PROMPT = "alpha beta gamma tree"


@pytest.fixture(scope="module")
def tiny(tiny_bundle):
    return tiny_bundle  # compiled once per session (conftest.py), shared with the bench tests


def eager_greedy(model_dir: Path, prompt_ids: list[int], n: int) -> list[int]:
    from yggdrasil.runtime.generate import greedy_tokens
    from yggdrasil.models.hf_loader import load_hf_model
    from yggdrasil.runtime.steps import StepRunner

    model = load_hf_model(model_dir, torch.float32)
    return greedy_tokens(StepRunner(model, 256, 16), prompt_ids, n)  # the plain-PyTorch reference


FRESH_PROCESS = r"""
import json, sys, time
started = time.perf_counter()
from yggdrasil.bundle import dynamo_compilations
from yggdrasil.runtime.drafters import ModelDrafter
from yggdrasil.runtime.generate import greedy_tokens
from yggdrasil.bundle import open_bundle
from yggdrasil.sampling import SamplingParams
from yggdrasil.runtime.speculative import SpeculativeGenerator
rt = open_bundle(sys.argv[1], quiet=True).generator()
ids = rt.target.tokenizer.encode(sys.argv[2])
greedy = SamplingParams(temperature=0.0)
spec = rt.speculator()
auto = spec.generate(ids, 24, greedy).tokens if spec else greedy_tokens(rt.runner, ids, 24)
# whether the measured profile makes speculation pay depends on this machine's timings; with
# free drafting and flat verify costs the same calibrated policy over the same graphs must speculate
from yggdrasil.policy.auto import policy_from_calibration
from yggdrasil.runtime.latency import LatencyProfile
grid = rt.policy.grid
flat = policy_from_calibration(rt.path / "calibration", grid.widths, grid.verifies,
                               LatencyProfile(draft=((1, 0.0),), verify=((1, 1.0),)), rt.target.model.config.dim,
                               rt.manifest.models["target"]["sha256"])
forced = SpeculativeGenerator(rt.runner, flat.drafter(rt.draft_runner), policy=flat).generate(ids, 24, greedy)
speculated = any(k != "no-spec" for k in forced.spec.shapes)
# the draft graphs at a fixed shape, whatever the bundle's policy picks on this machine
fixed = SpeculativeGenerator(rt.runner, ModelDrafter(rt.draft_runner, 3, grid.max_width, grid.widths),
                             verify_widths=grid.verifies, profile=None).generate(ids, 24, greedy)
print(json.dumps({"prompt": ids, "auto": auto, "forced": forced.tokens, "speculated": speculated, "fixed": fixed.tokens, "aal": fixed.spec.aal,
                  "compilations": dynamo_compilations(), "load_seconds": rt.load_seconds,
                  "graph_calls": sum(s.calls for s in rt.graph_sets.values())}))
"""


@pytest.mark.slow
def test_fresh_process_generates_eager_greedy_with_zero_compilations(tiny):
    recipe_path, bundle = tiny
    out = subprocess.run([sys.executable, "-c", FRESH_PROCESS, str(bundle), PROMPT], capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"fresh-process bundle load {got['load_seconds']:.2f} s")
    expected = eager_greedy(recipe_path.parent / "tiny-random", got["prompt"], 24)
    assert got["auto"] == expected
    assert got["fixed"] == expected
    assert got["forced"] == expected
    assert got["aal"] > 1.0  # the draft nearly always agrees with the target
    assert got["compilations"] == 0
    assert got["speculated"]  # the calibrated policy speculates over the bundle's graphs
    assert got["graph_calls"] > 24


@pytest.mark.slow
def test_cli_generate_from_bundle_and_inspect(tiny):
    _, bundle = tiny
    run = subprocess.run([sys.executable, "-m", "yggdrasil.cli", "generate", "--bundle", str(bundle),
                          "--prompt", PROMPT, "--max-new-tokens", "16", "--verbose", "--verify-bundle"],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "bundle load" in run.stderr and "0 compilations" in run.stderr
    assert re.search(r"first token [\d.]+ s after process start", run.stderr), run.stderr[-2000:]
    phases = re.search(r"\[start-up: (.*)\]", run.stderr)
    assert phases, run.stderr[-2000:]
    names = [re.sub(r" [\d.]+ s$", "", part) for part in phases.group(1).split(" | ")]
    assert names == ["imports", "open", "kernels", "weights", "graphs", "first prefill"]
    # the tiny bundle is fp32: its steps are not claimed bitwise, and the line says the tie rule applies
    assert re.search(r"\[steps: up to ties", run.stderr), run.stderr[-2000:]
    bad = subprocess.run([sys.executable, "-m", "yggdrasil.cli", "generate", "--bundle", str(bundle),
                          "--prompt", PROMPT, "--spec", "egt"], capture_output=True, text=True, timeout=600)
    assert bad.returncode != 0 and "drop --spec" in bad.stderr
    shown = subprocess.run([sys.executable, "-m", "yggdrasil.cli", "inspect", str(bundle)],
                           capture_output=True, text=True, timeout=600)
    assert shown.returncode == 0
    for text in ("tiny-random-cpu", "buckets", "target/decode_w1", "selection", "dropped", "stages", "contention",
                 "weights/models.pt", "memory-mapped", "phases     load "):
        assert text in shown.stdout
    phases = read_manifest(bundle, "x")[0].stats["phase_seconds"]  # issue 37: where compile's time goes
    assert list(phases) == ["load", "formats", "calibrate", "draft vocab", "select", "graphs", "check", "stage plans"]
    assert all(seconds >= 0 for seconds in phases.values()) and phases["graphs"] > 0


@pytest.mark.slow
def test_rerun_on_an_unchanged_recipe_reuses_the_bundle(tiny):
    recipe_path, bundle = tiny
    before = (bundle / "manifest.yaml").read_text()
    result = build_bundle(load_recipe(recipe_path), bundle)
    assert result.reused and (bundle / "manifest.yaml").read_text() == before


@pytest.mark.slow
def test_a_predictor_that_wins_only_on_the_graphs_gets_the_graphs_it_reads(tiny, monkeypatch):
    """Eagerly the depth predictor loses, so the graphs compiled first return no hidden states;
    on step times where verifying more rows costs more it wins on the compiled graphs, and then
    compile adds the graphs that return them, judges again on those and ships a bundle that runs
    the predictor and generates exactly eager greedy (regression: it failed to load them)."""
    import yggdrasil.runtime.latency as latency
    from helpers import tiny_profile

    recipe_path, bundle = tiny
    assert not any("hidden" in name for name in open_bundle(bundle).manifest.buckets)
    steep = tiny_profile(draft=((1, 0.3), (2, 0.35), (4, 0.4)), verify=((1, 1.0), (2, 1.5), (4, 2.5)))
    monkeypatch.setattr(latency, "measure_profile", lambda *args, **kwargs: steep)
    out = bundle.with_name("judged")
    shutil.copytree(bundle.with_name(f".{bundle.name}.work"), out.with_name(f".{out.name}.work"))
    lines: list[str] = []
    build_bundle(load_recipe(recipe_path), out, log=lines.append)  # reuses calibration and graphs
    assert any("the depth predictor runs: compiling the graphs that also return" in line for line in lines)
    assert "the bundle runs the depth predictor" in [line for line in lines if "compiled graphs' step times" in line][-1]
    rt = open_bundle(out).generator()
    assert "target/prefill_hidden_w16" in rt.manifest.buckets and rt.policy.needs_hidden
    ids = rt.target.tokenizer.encode(PROMPT)
    tokens = rt.speculator().generate(ids, 24, SamplingParams(temperature=0.0)).tokens
    assert tokens == eager_greedy(recipe_path.parent / "tiny-random", ids, 24)


@pytest.mark.slow
def test_stage_plans_are_chosen_stored_and_executed(tiny, monkeypatch):
    """compile searches each bucket's stage plan (stage_plans.yaml); a recipe can force one, and
    then the bundle carries the ahead-of-time head graphs and generates exactly eager greedy."""
    from yggdrasil.policy.auto import policy_from_calibration
    from yggdrasil.runtime.latency import LatencyProfile
    from yggdrasil.runtime.speculative import SpeculativeGenerator
    from yggdrasil.storage.layout import BundleLayout
    from yggdrasil.runtime.stage_plan import StagePlan
    from yggdrasil.trace import Tracer, tracing

    recipe_path, bundle = tiny
    searched = BundleLayout(bundle).read_stage_plans()
    assert searched["source"].startswith("searched") and searched["buckets"]
    assert searched["costs"]["streams"] == 1  # a CPU: no side-stream plans
    forced_recipe = recipe_path.with_name("tiny-planned.yaml")
    raw = yaml.safe_load(recipe_path.read_text())
    forced_recipe.write_text(yaml.safe_dump({**raw, "stage_plan": "aot-head+device-accept"}))
    import yggdrasil.runtime.latency as latency
    from helpers import tiny_profile

    monkeypatch.setattr(latency, "measure_profile", lambda *args, **kwargs: tiny_profile())  # as the tiny bundle's
    out = bundle.with_name("planned")
    shutil.copytree(bundle.with_name(f".{bundle.name}.work"), out.with_name(f".{out.name}.work"))
    build_bundle(load_recipe(forced_recipe), out)  # reuses calibration and graphs, adds the AOT heads
    record = BundleLayout(out).read_stage_plans()
    assert {e["plan"] for e in record["buckets"].values()} == {"aot-head+device-accept"}
    rt = open_bundle(out).generator()
    assert any(name.startswith("draft/draft_ahead_w") for name in rt.manifest.buckets)
    assert rt.plans.possible() == {StagePlan(aot_head=True, accept_on_device=True)}
    # a policy that always speculates (free drafting), so the plans run whatever this machine's timings
    grid = rt.policy.grid
    flat = policy_from_calibration(rt.path / "calibration", grid.widths, grid.verifies,
                                   LatencyProfile(draft=((1, 0.0),), verify=((1, 1.0),)),
                                   rt.target.model.config.dim, rt.manifest.models["target"]["sha256"])
    speculator = SpeculativeGenerator(rt.runner, flat.drafter(rt.draft_runner), policy=flat, plans=rt.plans)
    ids = rt.target.tokenizer.encode(PROMPT)
    tracer = Tracer()
    with tracing(tracer, rt.runner, speculator):
        result = speculator.generate(ids, 24, SamplingParams(temperature=0.0))
    assert result.tokens == eager_greedy(recipe_path.parent / "tiny-random", ids, 24)
    assert any(e["name"].startswith("draft_ahead_w") for e in tracer.events)


@pytest.fixture
def broken(tiny, tmp_path):
    """A private copy of the bundle to break."""
    copy = tmp_path / "bundle"
    shutil.copytree(tiny[1], copy)
    return copy


def _edit_manifest(bundle: Path, change) -> None:
    raw = yaml.safe_load((bundle / "manifest.yaml").read_text())
    change(raw)
    (bundle / "manifest.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))


@pytest.mark.slow
def test_truncated_artifact(broken):
    graph = next((broken / "graphs" / "target").glob("*.pt2"))
    graph.write_bytes(graph.read_bytes()[:1000])
    with pytest.raises(BundleError, match=rf"artifact graphs/target/{graph.name} is corrupt.*yggdrasil compile"):
        open_bundle(broken, quiet=True)


@pytest.mark.slow
def test_missing_artifact(broken):
    (broken / "selection.yaml").unlink()
    with pytest.raises(BundleError, match="missing its artifact selection.yaml"):
        open_bundle(broken, quiet=True)


@pytest.mark.slow
def test_edited_manifest(broken):
    _edit_manifest(broken, lambda raw: raw.update(dtype="bfloat16"))
    with pytest.raises(BundleError, match="edited after it was written"):
        open_bundle(broken, quiet=True)


@pytest.mark.slow
def test_unknown_schema_version(broken):
    _edit_manifest(broken, lambda raw: raw.update(schema="yggdrasil-bundle/99"))
    with pytest.raises(BundleError, match="newer than this yggdrasil understands"):
        open_bundle(broken, quiet=True)


@pytest.mark.slow
def test_other_torch_version(broken, monkeypatch):
    monkeypatch.setattr(torch, "__version__", "2.99.0")
    with pytest.raises(BundleError, match="torch version '2.13.*'2.99.0'.*rebuild with"):
        open_bundle(broken, quiet=True)


@pytest.mark.slow
def test_other_device(broken, monkeypatch):
    # another CPU with every feature the graphs use runs (tests/test_bundle_cpu.py); another
    # architecture does not
    import yggdrasil.cpu as cpu
    import yggdrasil.device as device

    machine = "aarch64" if cpu.cpu_fingerprint().machine != "aarch64" else "x86_64"
    other = cpu.CpuFingerprint(machine, "", "Some Other CPU", None, None, None, (), 64)
    monkeypatch.setattr(device, "device_name", lambda device: "Some Other CPU (64 threads)")
    monkeypatch.setattr(cpu, "cpu_fingerprint", lambda threads=0: other)
    with pytest.raises(BundleError, match=f"CPUs but this machine is {machine}.*rebuild it here"):
        open_bundle(broken, quiet=True)


def test_runs_without_its_source_model_files(tiny, broken, monkeypatch):
    """The bundle carries its deployed weights and tokenizers (yggdrasil/runtime/deployed.py): with the
    model directories it was compiled from gone, it opens without reading or converting any
    model file and generates the source model's own greedy output."""
    models = tiny[0].parent
    prompt = [1, 5, 9, 14, 3]
    want = eager_greedy(models / "tiny-random", prompt, 12)
    away = models.parent / (models.name + "-away")
    models.rename(away)
    try:
        with monkeypatch.context() as guard:
            forbid_model_conversion(guard)
            generator = open_bundle(broken, quiet=True).generator()
        assert greedy_tokens(generator.runner, prompt, 12) == want
        speculator = generator.speculator()
        assert speculator.generate(prompt, 12, SamplingParams(temperature=0.0)).tokens == want
        assert generator.tokenizer.encode("alpha beta") == load_saved_tokenizer(
            broken / "weights" / "tokenizer-target").encode("alpha beta")
    finally:
        away.rename(models)


def test_damaged_weights_are_refused_with_the_rebuild_command(broken):
    """A weights file damaged in place (same size) fails its hash at open; one whose size,
    mtime and inode are those of its last good hash is trusted, and --verify hashes it anyway."""
    weights = broken / "weights" / "models.pt"
    open_bundle(broken, quiet=True)  # a good open: the file is hashed once
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(BundleError, match=r"artifact weights/models.pt is corrupt.*rebuild with `yggdrasil compile"):
        open_bundle(broken, quiet=True)
    with pytest.raises(BundleError, match="weights/models.pt is corrupt"):
        open_bundle(broken, quiet=True, verify=True)


def test_a_large_artifact_is_hashed_once_per_stamp(tmp_path, monkeypatch):
    """storage/manifest.artifact_intact: a large artifact is hashed the first time and trusted on
    its (size, mtime, inode) stamp after; rewriting it (new mtime) hashes it again and catches
    the damage; without stamps (--verify) it is always hashed."""
    from yggdrasil.storage import manifest as manifest_module

    monkeypatch.setattr(manifest_module, "LARGE_ARTIFACT", 16)
    path = tmp_path / "big.bin"
    path.write_bytes(b"x" * 64)
    expected = manifest_module.file_digest(path)
    hashed = []
    real = manifest_module.file_digest
    monkeypatch.setattr(manifest_module, "file_digest", lambda p: hashed.append(p) or real(p))
    stamps = tmp_path / "stamps"
    assert manifest_module.artifact_intact(path, expected, stamps) and len(hashed) == 1
    assert manifest_module.artifact_intact(path, expected, stamps) and len(hashed) == 1  # the stamp holds
    assert manifest_module.artifact_intact(path, expected, None) and len(hashed) == 2  # --verify
    path.write_bytes(b"y" * 64)
    assert not manifest_module.artifact_intact(path, expected, stamps) and len(hashed) == 3


def test_recipe_for_cuda_is_refused_without_cuda(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    raw = yaml.safe_load(RECIPE.read_text())
    raw["device"] = "cuda"
    path = tmp_path / "cuda.yaml"
    path.write_text(yaml.safe_dump(raw))
    from yggdrasil.errors import YggdrasilError

    with pytest.raises(YggdrasilError, match="cuda"):
        build_bundle(load_recipe(path), tmp_path / "bundle")


@pytest.mark.slow
def test_plan_show_measures_costs_and_draws_the_plans(tiny, tmp_path, capsys):
    from yggdrasil.cli import main

    _, bundle = tiny
    out = tmp_path / "plans.png"
    assert main(["plan", "--show", str(bundle), "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "device contention" in text and re.search(r"D\d+xW\d+/V\d+ +[\d.]+ ms", text)
    assert "the bundle runs: D" in text  # the plans compile stored
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
