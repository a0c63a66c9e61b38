"""Weight formats in compile (issue 22, part 3): the recipe keys, the quality gate, the choice
recorded in the manifest and printed by inspect, bundles deployed in each format generating
their own autoregressive greedy output, and `generate --weights`."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import yaml
from helpers import forbid_model_conversion, format_profile, write_tiny_recipe_dir
from helpers import write_formats_recipe as _recipe

from yggdrasil.runtime import latency
from yggdrasil.bundle import open_bundle
from yggdrasil.compile.build import build_bundle
from yggdrasil.compile.check import compare_greedy
from yggdrasil.compile.context import load_context
from yggdrasil.compile.format_choice import choose_format, prefer_by_objective
from yggdrasil.compile.formats import FormatChoice, FormatError, FormatMeasurement
from yggdrasil.compile.recipe import RecipeError, load_recipe, parse_recipe
from yggdrasil.runtime.generate import greedy_tokens
from yggdrasil.storage.manifest import BundleError, read_manifest
from yggdrasil.models.loader import load
from yggdrasil.models.quant import weight_format
from yggdrasil.sampling import SamplingParams
from yggdrasil.runtime.steps import StepRunner

RECIPES = Path(__file__).parent.parent / "recipes"
PROFILE = format_profile()


def _raw(**changes) -> dict:
    raw = yaml.safe_load((RECIPES / "smollm2-lookup-cpu.yaml").read_text())
    raw.pop("weights", None), raw.pop("quality", None)  # the defaults are under test, not the shipped choice
    raw.update(changes)
    return raw


# -- recipe keys -----------------------------------------------------------------------------
def test_weight_keys_parse_and_default_to_fp32_without_changing_identity():
    plain = parse_recipe(_raw(), "r.yaml")
    assert plain.weights == "fp32" and plain.quality.min_agreement == 0.98 and not plain.quality.allow_int4
    assert parse_recipe(_raw(weights="fp32", quality={"min_agreement": 0.98}), "r").identity() == plain.identity()
    auto = parse_recipe(_raw(weights="auto", quality={"allow_int4": True, "heldout_tokens": 128}), "r")
    assert auto.identity() != plain.identity() and auto.quality.heldout_tokens == 128
    assert auto.candidate_formats(("fp32", "bf16", "int8", "int4")) == ("fp32", "bf16", "int8", "int4")
    no_int4 = parse_recipe(_raw(weights="auto"), "r")
    assert no_int4.candidate_formats(("fp32", "bf16", "int8", "int4")) == ("fp32", "bf16", "int8")
    assert parse_recipe(_raw(weights="int8"), "r").candidate_formats(("fp32",)) == ("int8",)
    pair = parse_recipe(yaml.safe_load((RECIPES / "qwen-pair-cpu.yaml").read_text()) | {"weights": "int8",
                                                                                          "draft_weights": "bf16"}, "r")
    assert pair.draft_format("int8") == "bf16"


@pytest.mark.parametrize("changes, message", [
    ({"weights": "int3"}, "weights must be one of fp32, bf16, int8, int4, q4, auto"),
    ({"weights": 8}, "weights must be one of"),
    ({"draft_weights": "int8"}, "draft_weights is set but the recipe drafts by lookup"),
    ({"draft_weights": "auto"}, "draft_weights must be same"),
    ({"quality": 0.98}, "quality must be a mapping"),
    ({"quality": {"min_agreemnt": 0.9}}, "unknown key 'min_agreemnt'"),
    ({"quality": {"min_agreement": 1.5}}, r"min_agreement must be a number in \(0, 1\].*got 1.5"),
    ({"quality": {"min_agreement": 0}}, "min_agreement must be a number"),
    ({"quality": {"min_agreement": True}}, "min_agreement must be a number"),
    ({"quality": {"allow_int4": "yes"}}, "allow_int4 must be true or false"),
    ({"quality": {"heldout_tokens": 4}}, "heldout_tokens must be an integer >= 16"),
    ({"quality": {"agreement_tokens": 2.5}}, "agreement_tokens must be an integer"),
])
def test_weight_key_mistakes_name_the_problem(changes, message):
    with pytest.raises(RecipeError, match=message):
        parse_recipe(_raw(**changes), "r.yaml")


# -- the tiny model in each format -----------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("formats")
    write_tiny_recipe_dir(root)
    return root


@pytest.fixture(scope="module")
def verdicts_dir(tmp_path_factory) -> Path:
    """The 8-layer pair the formats phase's quality verdicts were written on (bf16 agrees with
    fp32 above the 0.98 floor on it; on the 2-layer default it falls below); eager, so its layers
    cost no compile time, where the bundle tests keep the 2-layer pair."""
    from helpers import EIGHT_LAYER_PAIR

    root = tmp_path_factory.mktemp("formats-verdicts")
    write_tiny_recipe_dir(root, **EIGHT_LAYER_PAIR)
    return root


def test_quality_gate_refuses_a_named_format_below_the_floor_naming_its_agreement(verdicts_dir, monkeypatch):
    """int4 on the tiny random model (64-wide rows: a group of 32 holds half a row) picks other
    greedy tokens than fp32 at many positions: compile stops before calibrating, naming it."""
    monkeypatch.setattr(latency, "measure_profile", lambda *a, **k: PROFILE)
    recipe = load_recipe(_recipe(verdicts_dir, "int4-gated", "int4"))
    with pytest.raises(FormatError, match=r"weights int4 is below the quality floor: greedy next-token agreement "
                                          r"with fp32 0\.\d{4} over 64 positions < quality.min_agreement 0.98"):
        build_bundle(recipe, verdicts_dir / "never", log=lambda m: None)
    assert not (verdicts_dir / "never").exists()


def test_auto_measures_every_format_and_refuses_the_damaged_one(verdicts_dir, monkeypatch):
    """A deliberately damaged int8 (its weights' signs flipped after packing) is measured and
    refused with its agreement; the others pass and the choice is one of them."""
    monkeypatch.setattr(latency, "measure_profile", lambda *a, **k: PROFILE)
    from yggdrasil.compile import formats

    real_load_in = formats.load_in

    def damaged(ctx, role, fmt):
        loaded = real_load_in(ctx, role, fmt)
        if fmt == "int8":
            with torch.no_grad():
                for name, tensor in loaded.model.named_buffers():
                    if "scale" in name:
                        tensor.neg_()
        return loaded

    monkeypatch.setattr(formats, "load_in", damaged)
    recipe = load_recipe(_recipe(verdicts_dir, "auto", "auto"))
    ctx = load_context(recipe, verdicts_dir / "auto-bundle", log=lambda m: None)
    ctx, choice = choose_format(ctx)
    verdicts = {c.format: c for c in choice.candidates}
    assert set(verdicts) == {"fp32", "bf16", "int8"}  # no int4: allow_int4 is false
    # fp32's teacher-forced argmax against its own packed-decode continuation: equal up to ties
    # of fp32 logits (rows grouped differently), so at most a position or two on some CPU
    assert verdicts["fp32"].verdict == "reference" and verdicts["fp32"].agreement >= 0.99
    assert verdicts["int8"].verdict == "refused" and verdicts["int8"].agreement < 0.98
    low, high = verdicts["int8"].agreement_interval
    assert low <= verdicts["int8"].agreement <= high
    assert (f"agreement {verdicts['int8'].agreement:.4f} (95 % {low:.3f}-{high:.3f} over {verdicts['int8'].positions} "
            "positions) < quality.min_agreement 0.98") in verdicts["int8"].note
    assert verdicts["bf16"].verdict == "passes" and verdicts["bf16"].perplexity > 1.0
    assert choice.chosen in ("fp32", "bf16") and ctx.weights["target"] == choice.chosen
    assert weight_format(ctx.target.model) == choice.chosen
    assert verdicts["bf16"].weight_bytes < verdicts["fp32"].weight_bytes


def test_without_a_compiler_auto_skips_q4_in_one_line_and_keeps_atens_int4(verdicts_dir, monkeypatch):
    """Where our kernels cannot be built (no C++ compiler: simulated), `weights: auto` records q4
    as unsupported with the reason in one line, logs it, and chooses among the others (ATen's
    int4 still measured); nothing crashes."""
    from yggdrasil.models import quant

    monkeypatch.setattr(latency, "measure_profile", lambda *a, **k: PROFILE)
    monkeypatch.setattr(quant, "kernels_available", lambda: "cannot build the yggdrasil CPU kernels: no C++ "
                                                            "compiler ('c++') on PATH (install g++ or set CXX)")
    recipe = load_recipe(_recipe(verdicts_dir, "auto-nocxx", "auto", allow_int4=True, min_agreement=0.5))
    log: list[str] = []
    ctx = load_context(recipe, verdicts_dir / "auto-nocxx-bundle", log=log.append)
    ctx, choice = choose_format(ctx)
    verdicts = {c.format: c for c in choice.candidates}
    assert set(verdicts) == {"fp32", "bf16", "int8", "int4", "q4"}
    q4 = verdicts["q4"]
    assert q4.verdict == "unsupported" and "no C++ compiler" in q4.note and "\n" not in q4.note
    assert verdicts["int4"].verdict in ("passes", "refused") and choice.chosen != "q4"
    assert any("q4" in line and "unsupported" in line and "no C++ compiler" in line for line in log), log


def test_each_format_records_whether_its_steps_are_batch_invariant(verdicts_dir, monkeypatch):
    """The formats phase measures every usable format's eager steps for batch invariance (a row
    by decode vs prefill vs chain and tree verify, bitwise) and the manifest's formats table and
    `inspect` say per format "bitwise" or "up to ties"; q4 (fixed-order kernels) is bitwise, and
    an op made to depend on the number of rows is caught."""
    from yggdrasil.models import quant
    from yggdrasil.compile import formats
    from yggdrasil.graphs.describe import describe_formats

    if quant.kernels_available() is not None:
        pytest.skip(f"q4 kernels unavailable here: {quant.kernels_available()}")
    monkeypatch.setattr(latency, "measure_profile", lambda *a, **k: PROFILE)
    recipe = load_recipe(_recipe(verdicts_dir, "auto-invariance", "auto", allow_int4=True, min_agreement=0.5))
    ctx = load_context(recipe, verdicts_dir / "auto-invariance-bundle", log=lambda m: None)
    measured = {m.format: m for m in formats.measure_formats(ctx)}
    for m in measured.values():
        assert m.invariance is not None and {"prefill", "verify16", "tree16"} <= set(m.invariance["ways"]), m
        assert m.invariance_verdict() == ("bitwise" if m.invariance["bitwise"] else
                                          f"up to ties (max gap {m.invariance['max_abs_diff']:.2g})")
    assert measured["q4"].invariance["bitwise"], measured["q4"].invariance
    table = describe_formats(formats.FormatChoice("q4", "test", tuple(measured.values())).as_dict())
    assert any(line.split()[0] == "q4" and "bitwise" in line for line in table), table

    real_load_in = formats.load_in

    def row_dependent(ctx, role, fmt):  # q4 whose final norm's rounding depends on the row count
        loaded = real_load_in(ctx, role, fmt)
        norm = loaded.model.norm
        forward = norm.forward
        norm.forward = lambda x: forward(x) * (1 + 2.0 ** -20 * (x.shape[-2] > 1))
        return loaded

    monkeypatch.setattr(formats, "load_in", row_dependent)
    skewed = formats.measure_format(ctx, "q4", formats.build_reference(ctx, StepRunner(
        ctx.target.model, recipe.max_context, chunk_sizes=recipe.buckets.prefill_chunks)))
    assert not skewed.invariance["bitwise"] and skewed.invariance_verdict().startswith("up to ties")


def test_reprofile_times_the_formats_again_and_keeps_their_quality(verdicts_dir, monkeypatch):
    """--reprofile re-measures each format's step times (a busy machine spoils those) but keeps
    the agreement and perplexity (which it does not): no teacher-forced pass runs again."""
    from yggdrasil.compile import formats

    monkeypatch.setattr(latency, "measure_profile", lambda *a, **k: PROFILE)
    recipe = load_recipe(_recipe(verdicts_dir, "auto-reprofile", "auto"))
    ctx = load_context(recipe, verdicts_dir / "auto-reprofile-bundle", log=lambda m: None)
    first = formats.measure_formats(ctx)
    faster = latency.LatencyProfile(draft=PROFILE.draft, verify=tuple((n, t / 2) for n, t in PROFILE.verify))
    monkeypatch.setattr(latency, "measure_profile", lambda *a, **k: faster)
    monkeypatch.setattr(formats, "agreement", lambda *a: pytest.fail("agreement measured again"))
    log: list[str] = []
    again = formats.measure_formats(replace(ctx, log=log.append), reprofile=True)
    assert any("keeping their measured agreement and perplexity" in m for m in log)
    assert [m.format for m in again] == [m.format for m in first]
    for old, new in zip(first, again):
        assert (new.agreement, new.perplexity, new.verdict) == (old.agreement, old.perplexity, old.verdict)
        assert new.t_ms(1) == pytest.approx(old.t_ms(1) / 2)
    assert formats.measure_formats(ctx) == again  # what a later compile reuses


def test_reprofile_holds_one_format_at_a_time_and_lets_fp32_go(verdicts_dir, monkeypatch):
    """--reprofile times fp32 on compile's own models first and then lets them go, and frees
    every other format's models once they are timed (holding them all beside fp32 ran a 24 GB
    machine out of memory on the Qwen pair)."""
    from yggdrasil.compile import formats

    monkeypatch.setattr(latency, "measure_profile", lambda *a, **k: PROFILE)
    recipe = load_recipe(_recipe(verdicts_dir, "auto-reprofile-memory", "auto"))
    ctx = load_context(recipe, verdicts_dir / "auto-reprofile-memory-bundle", log=lambda m: None)
    first = formats.measure_formats(ctx)
    ctx = load_context(recipe, verdicts_dir / "auto-reprofile-memory-bundle", log=lambda m: None)  # fp32 loaded again
    loaded, timed = [], []
    real_load_in = formats.load_in

    def recorded_load_in(ctx_, role, fmt):
        assert all(formats.released(m) for m in loaded), f"{fmt} loaded while an earlier format is still held"
        model = real_load_in(ctx_, role, fmt)
        if model is not ctx_.target and model is not ctx_.draft:
            loaded.append(model)
        return model

    def recorded_profile(ctx_, target, draft, what):
        timed.append((what, formats.released(ctx.target)))
        return PROFILE

    monkeypatch.setattr(formats, "load_in", recorded_load_in)
    monkeypatch.setattr(formats, "step_profile", recorded_profile)
    again = formats.measure_formats(ctx, reprofile=True, let_go=True)
    assert [m.format for m in again] == [m.format for m in first]
    retimed = [m.format for m in first if m.verdict not in (formats.UNSUPPORTED, formats.PRICED)]
    assert timed[0] == ("fp32", False) and all(released for _, released in timed[1:]) and len(timed) == len(retimed)
    assert loaded and all(formats.released(m) for m in loaded)


def test_the_objective_prefers_the_format_with_the_lower_expected_time_per_token(tiny_bundle):
    """On the same calibration, the format whose verify steps are cheaper wins even when its
    plain decode step is not the fastest."""
    _, bundle = tiny_bundle
    steep = {"draft": [[1, 0.02], [2, 0.025], [4, 0.03]], "verify": [[1, 1.0], [2, 2.0], [4, 4.0]]}
    flat = {"draft": [[1, 0.02], [2, 0.025], [4, 0.03]], "verify": [[1, 1.05], [2, 1.1], [4, 1.2]]}
    choice = FormatChoice("fp32", "provisional", (FormatMeasurement("fp32", "reference", profile=steep),
                                                  FormatMeasurement("int8", "passes", profile=flat),
                                                  FormatMeasurement("int4", "refused", "agreement 0.5", profile=flat)))
    preferred = prefer_by_objective(choice, bundle / "calibration")
    assert preferred.chosen == "int8" and "latency objective" in preferred.reason
    assert preferred.get("int8").expected_tpot_ms < preferred.get("fp32").expected_tpot_ms
    assert preferred.get("int4").expected_tpot_ms is None


# bf16 and int8 bundles run eager steps: each format through an exported, compiled graph is
# tests/test_quant.py's (test_model_in_each_format_runs_through_an_exported_graph_like_eager),
# what a bundle adds (its record, packed weights mapped without conversion, its speculative
# output) is the same for both kinds of steps, and each graph set cost CI a minute or more
EAGER_BUNDLE_FORMATS = ("bf16", "int8")


@pytest.mark.parametrize("fmt", ["bf16", "int8", "int4", "q4"])
def test_bundle_in_each_format_generates_its_own_greedy_output(tiny_dir, monkeypatch, fmt, capsys):
    """A bundle compiled in a format records it, loads its models in it, and its speculative
    greedy output equals plain greedy decoding of the same format's eager model, token for
    token (the compile check compares against that same format too)."""
    monkeypatch.setattr(latency, "measure_profile", lambda *a, **k: PROFILE)
    path = _recipe(tiny_dir, fmt, fmt, min_agreement=0.5)  # exactness, not quality, here
    if fmt in EAGER_BUNDLE_FORMATS:
        path.write_text(yaml.safe_dump({**yaml.safe_load(path.read_text()), "steps": "eager"}))
    recipe = load_recipe(path)
    out = tiny_dir / f"bundle-{fmt}"
    result = build_bundle(recipe, out, log=lambda m: None)
    assert result.manifest.steps == ("eager" if fmt in EAGER_BUNDLE_FORMATS else "aoti")
    assert not any(name.endswith("/serve") for name in result.manifest.buckets)  # serve_graphs: false
    if fmt == "q4":  # ... a bundle without serve graphs is up to date as it is (no rebuild for them),
        assert build_bundle(recipe, out, log=lambda m: None).reused
        from yggdrasil.serve.setup import ServeSettings  # and its server runs eager forwards

        assert not open_bundle(out, quiet=True).engine(ServeSettings(max_batch=1)).compiled
    manifest, raw = read_manifest(out, "x")
    assert manifest.weights == {"target": fmt} and raw["formats"]["chosen"] == fmt
    (measured,) = raw["formats"]["candidates"]
    assert measured["format"] == fmt and 0.5 <= measured["agreement"] <= 1.0 and measured["weight_bytes"] > 0
    assert result.manifest.weight_format("target") == fmt
    if fmt == "q4":  # invariant linears, RMSNorm and attention: compile measures the steps bitwise
        assert result.manifest.bitwise and result.manifest.stats["batch_invariance"].startswith("bitwise")

    with monkeypatch.context() as guard:  # the bundle maps its packed weights: nothing is converted
        forbid_model_conversion(guard)
        generator = open_bundle(out, quiet=True).generator()
    assert weight_format(generator.target.model) == fmt
    eager = load(str(tiny_dir / "tiny-random"), dtype=torch.float32, quiet=True, weights=fmt)
    runner = StepRunner(eager.model, 256, chunk_sizes=(16,))
    for text in ("alpha beta gamma", "tree leaf root graph tree leaf", "delta"):
        ids = generator.tokenizer.encode(text)
        speculator = generator.speculator()
        assert speculator is not None  # the bundle speculates (selection: all, the fixed profile)
        result = speculator.generate(ids, 24, SamplingParams(temperature=0.0))
        assert result.tokens == greedy_tokens(runner, ids, 24), (fmt, text)

    from yggdrasil.cli import main as cli_main

    assert cli_main(["inspect", str(out)]) == 0
    printed = capsys.readouterr().out
    assert f"weights    target {fmt}" in printed and f"chose {fmt}" in printed and "agreement:" in printed
    assert (out / "kernels" / "yggdrasil_kernels.so").is_file() == (fmt == "q4")  # q4's graphs call our kernels
    if fmt == "q4":
        _runs_in_a_fresh_process_without_building_the_kernels(out, tiny_dir, generator)


def _runs_in_a_fresh_process_without_building_the_kernels(bundle: Path, tmp: Path, generator) -> None:
    """The bundle's own copy of the kernel library is what a new process loads (an empty cache
    would otherwise mean building them: a compiler on the edge box), and it gives the same text."""
    ids = generator.tokenizer.encode("alpha beta gamma")
    want = generator.tokenizer.decode(greedy_tokens(generator.runner, ids, 12))
    cache = tmp / "empty-cache"
    run = subprocess.run([sys.executable, "-m", "yggdrasil", "generate", "--bundle", str(bundle), "--prompt",
                          "alpha beta gamma", "--max-new-tokens", "12", "--no-spec", "--no-stats"],
                         capture_output=True, text=True, timeout=300, check=False,
                         env={**__import__("os").environ, "YGGDRASIL_CACHE_DIR": str(cache)})
    assert run.returncode == 0, run.stderr
    assert "building the CPU kernels" not in run.stderr and not (cache / "kernels").exists()
    assert run.stdout.rstrip("\n") == want


def test_an_older_bundle_schema_asks_for_a_recompile(tiny_bundle, tmp_path):
    _, bundle = tiny_bundle
    copy = tmp_path / "old"
    subprocess.run(["cp", "-r", str(bundle), str(copy)], check=True)
    path = copy / "manifest.yaml"
    raw = yaml.safe_load(path.read_text())
    raw["schema"] = "yggdrasil-bundle/2"
    raw.pop("weights")
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    with pytest.raises(BundleError, match="older than this yggdrasil reads.*rebuild with"):
        open_bundle(copy)


def test_generate_takes_the_weight_format(tiny_dir):
    """`generate --model DIR --weights int8` decodes with the int8 model: its output is the int8
    model's greedy continuation; --weights with --bundle is refused."""
    model = tiny_dir / "tiny-random"
    eager = load(str(model), dtype=torch.float32, quiet=True, weights="int8")
    ids = eager.tokenizer.encode("alpha beta")
    expected = eager.tokenizer.decode(greedy_tokens(StepRunner(eager.model, 256, chunk_size=64), ids, 12))
    run = subprocess.run([sys.executable, "-m", "yggdrasil", "generate", "--model", str(model), "--prompt",
                          "alpha beta", "--max-new-tokens", "12", "--weights", "int8", "--no-stats"],
                         capture_output=True, text=True, timeout=300, check=False)
    assert run.returncode == 0, run.stderr
    assert run.stdout.rstrip("\n") == expected
    refused = subprocess.run([sys.executable, "-m", "yggdrasil", "generate", "--bundle", str(tiny_dir),
                              "--prompt", "x", "--weights", "int8"], capture_output=True, text=True, timeout=300, check=False)
    assert refused.returncode != 0 and "drop --weights" in refused.stderr


SMOLLM2_RECIPE = RECIPES / "smollm2-lookup-cpu.yaml"
# the SmolLM2 bundles' context: compile's batch-invariance probe runs a prompt as long as the
# context through eager and compiled steps (at 2048, most of the int8 bundle's 104 s check here)
CHECKED_CONTEXT = 512


@pytest.mark.slow
def test_smollm2_int8_bundle_generates_its_own_greedy_output(tmp_path, monkeypatch):
    """The int8 bundle's speculative output equals its own autoregressive output wherever its
    graphs' logits do not tie. int8 multiplies in bf16 and its graphs are not batch-invariant
    (compile measures it: "up to ties" in the manifest): a 16-row verify step computes a row a
    little differently from a 1-row decode step. Issue 40 found the divergence a Zen 4 and a
    Zen 5 both showed (token 19 of the second prompt, 5805 vs 1537) to be an exact tie: the
    decode graph's two best logits are both 31.625, the verify graph's 31.625 and 31.5. So the
    comparison here is exact where the bundle is bitwise and the tie rule otherwise, and every
    tie it accepts must be within the rule's tolerance (_pin_the_tie pins the one found)."""
    from helpers import tiny_profile
    from yggdrasil.runtime import latency
    from yggdrasil.models.catalog import model_statuses

    if not any(s.name == "smollm2-135m" and (s.installed or s.ready) for s in model_statuses()):
        pytest.skip("smollm2-135m not installed")
    raw = yaml.safe_load(SMOLLM2_RECIPE.read_text())
    # Exactness, not quality, is under test: SmolLM2's int8 agrees with fp32 on ~0.94 of greedy
    # tokens (measured), below the default floor of 0.98. Short calibration and quality runs and
    # fixed step times where speculation pays: without VNNI torch's int8 kernel takes ~2.6 s per
    # 16-row verify, and the recipe's own measurement made this one test run over 15 minutes.
    raw.update(weights="int8", quality={"min_agreement": 0.9, "agreement_tokens": 32, "heldout_tokens": 32},
               calibration={**raw["calibration"], "num_prompts": 1, "max_new_tokens": 16},
               serve_graphs=False,  # generated from, never served: the costliest graph left out
               max_context=CHECKED_CONTEXT)
    cheap_verify = tiny_profile(draft=((4, 0.01),), verify=((1, 1.0), (16, 1.1)))
    monkeypatch.setattr(latency, "measure_profile", lambda *args, **kwargs: cheap_verify)
    recipe_path = tmp_path / "smollm2-int8.yaml"
    recipe_path.write_text(yaml.safe_dump(raw))
    build_bundle(load_recipe(recipe_path), tmp_path / "b", log=lambda m: None)
    opened = open_bundle(tmp_path / "b", quiet=True)
    generator = opened.generator()
    assert weight_format(generator.target.model) == "int8"
    assert not opened.manifest.bitwise  # measured: int8's steps differ (bf16 GEMMs blocked by rows)
    eager = load("smollm2-135m", dtype=torch.float32, quiet=True, weights="int8")
    runner = StepRunner(eager.model, 512, chunk_size=64)
    for text in ("def fibonacci(n):", "import json\n\ndef load(path):\n    with open(path) as f:"):
        ids = generator.tokenizer.encode(text)
        speculator = generator.speculator()
        tokens = (speculator.generate(ids, 48, SamplingParams(temperature=0.0)).tokens if speculator
                  else greedy_tokens(generator.runner, ids, 48))
        own = greedy_tokens(generator.runner, ids, 48)
        agreement = compare_greedy(generator.target.model, ids, own, tokens)
        assert agreement.ok, (text, agreement)  # equal, or apart only at a tie of the deployed model
        assert compare_greedy(eager.model, ids, greedy_tokens(runner, ids, 48), own).ok, text
    _pin_the_tie(generator)


def _pin_the_tie(generator) -> None:
    """Issue 40's divergence, pinned: where the verify step and the plain loop part on the
    second prompt, the decode graph's two best logits are exactly equal (argmax takes the
    lower id), and the 16-row verify graph computes that row a little differently."""
    from yggdrasil.compile.invariance import _verify_logits

    ids = generator.tokenizer.encode("import json\n\ndef load(path):\n    with open(path) as f:")
    own = greedy_tokens(generator.runner, ids, 48)
    prefix = ids + own[:19]
    generator.runner.prefill(prefix[:-1])
    decode = generator.runner.decode(prefix[-1], len(prefix) - 1).float()
    verify = _verify_logits(generator.runner, prefix, 16)
    best = decode.topk(2)
    if int(decode.argmax()) != int(verify.argmax()):  # where the steps part (Zen 4 and 5 do), it is at a tie
        assert float(best.values[0] - best.values[1]) <= 0.125, best  # one bf16 ulp at |31.6|


@pytest.mark.slow
def test_formats_bench_runs_on_the_tiny_model(tiny_dir, tmp_path, capsys):
    """`yggdrasil bench formats` end to end on the tiny model, one format: the table, JSON and PNG."""
    import json

    from yggdrasil.bench.provenance import missing_fields
    from yggdrasil.bench.run import run_measurement

    recipe = _recipe(tiny_dir, "bench-source", "fp32")
    out = tmp_path / "formats-tiny.json"
    assert run_measurement("formats", ["--recipe", str(recipe), "--formats", "int8", "--sizes", "1,2,4", "--tokens",
                                       "6", "--repeats", "1", "--work", str(tmp_path / "work"), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "weight formats for bench-source.yaml on" in printed and "int8" in printed
    result = json.loads(printed.strip().splitlines()[-1])
    (row,) = result["rows"]
    assert row["format"] == "int8" and set(row["eager_t_ms"]) == {"1", "2", "4"}
    assert row["ar_tpot_ms"] > 0 and row["spec_tpot_ms"] > 0 and 0 < row["agreement"] <= 1
    assert json.loads(out.read_text())["rows"][0]["weight_bytes"] == row["weight_bytes"]
    assert out.with_suffix(".png").stat().st_size > 1000
    assert missing_fields(result) == []


@pytest.mark.slow
def test_smollm2_q4_bundle_is_bitwise_and_speculation_changes_nothing(tmp_path, monkeypatch):
    """Issue 40's target on the real small model: a q4 SmolLM2 bundle measures its steps
    bitwise, and speculative greedy output equals the bundle's own autoregressive output exactly
    (no tie rule) on prompts where lookup speculation really drafts."""
    from helpers import tiny_profile
    from yggdrasil.runtime import latency
    from yggdrasil.models import quant_q4
    from yggdrasil.models.catalog import model_statuses

    if not any(s.name == "smollm2-135m" and (s.installed or s.ready) for s in model_statuses()):
        pytest.skip("smollm2-135m not installed")
    if quant_q4.kernels_available() is not None:
        pytest.skip("no C++ compiler for the kernels")
    raw = yaml.safe_load(SMOLLM2_RECIPE.read_text())
    raw.update(weights="q4", quality={"min_agreement": 0.9, "agreement_tokens": 32, "heldout_tokens": 32,
                                      "allow_int4": True},
               calibration={**raw["calibration"], "num_prompts": 4, "max_new_tokens": 64},
               serve_graphs=False,  # generated from, never served: the costliest graph left out
               max_context=CHECKED_CONTEXT)
    cheap_verify = tiny_profile(draft=((4, 0.0),), verify=((1, 1.0), (16, 1.05)))  # speculation pays
    monkeypatch.setattr(latency, "measure_profile", lambda *args, **kwargs: cheap_verify)
    recipe_path = tmp_path / "smollm2-q4.yaml"
    recipe_path.write_text(yaml.safe_dump(raw))
    build_bundle(load_recipe(recipe_path), tmp_path / "b", log=lambda m: None)
    opened = open_bundle(tmp_path / "b", quiet=True)
    assert opened.manifest.bitwise
    generator = opened.generator()
    speculator = generator.speculator()
    assert speculator is not None
    texts = ("def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\n"
             "def fib_list(n):\n    return [fibonacci(i) for i in range(n)]\n\ndef fibonacci_memo(n):",
             "import json\n\ndef load(path):\n    with open(path) as f:")
    drafted = 0
    for text in texts:
        ids = generator.tokenizer.encode(text)
        result = speculator.generate(ids, 48, SamplingParams(temperature=0.0))
        assert result.tokens == greedy_tokens(generator.runner, ids, 48), text  # exact: no tie rule
        drafted += result.spec.committed - result.spec.iterations
    assert drafted > 0  # speculation accepted tokens: verify steps really ran
