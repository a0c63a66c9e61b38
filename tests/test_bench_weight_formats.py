"""`yggdrasil bench` on bundles whose weights are not fp32 (issue 22): every suite checks a
bf16/int8/int4 bundle against its own autoregressive graphs (the deployed model) and rows on
other kernels against their own backend, marked "(own reference)"; fp32 keeps the eager
reference; int4 bundles say why the torch.compile rows are not run; bench/formats.py prints no
step times for a bundle without verify graphs."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from helpers import FakeResult

from yggdrasil.bench.harness import BenchOptions, Prompt, Setup


def _tokens(backend: str, ids, n: int) -> list[int]:
    """Fake greedy output per backend: the bundle's graphs and torch.compile agree with each other,
    eager leaves them at the third token of prompt b (a logit near-tie rounded the other way)."""
    tokens = [(ids[-1] + k) % 256 for k in range(n)]
    if backend == "eager" and ids[0] == 4 and n > 2:
        tokens[2] = 255
    return tokens


def _decoder(backend: str, wrong: bool = False):
    """wrong: a speculation bug, one token off on prompt b whatever the backend."""
    def decode(ids, n, sampling):
        tokens = _tokens(backend, ids, n)
        return FakeResult(tokens[:-1] + [254] if wrong and ids[0] == 4 else tokens)
    return decode


def fake_engines(monkeypatch, wrong_width: int | None = None) -> list[str]:
    """Every engine decodes with _tokens of its backend, and its speculation reproduces that
    backend's autoregressive output (except trees of width wrong_width). Returns the runner kinds made."""
    from types import SimpleNamespace

    from yggdrasil.bench import engines

    made = []

    def runners(kind):
        made.append(kind)
        return SimpleNamespace(kind=kind)

    monkeypatch.setattr(engines, "bundle_runners", lambda rt: runners("bundle"))
    monkeypatch.setattr(engines, "fresh_runners",
                        lambda rt, compiled: runners("torch.compile" if compiled else "eager"))
    monkeypatch.setattr(engines, "autoregressive", lambda r: _decoder(r.kind))
    monkeypatch.setattr(engines, "drafter_for", lambda r, depth, width, widths=(): SimpleNamespace(width=width))
    monkeypatch.setattr(engines, "speculative", lambda r, drafter, widths=(), **k: _decoder(
        r.kind, wrong=drafter is not None and drafter.width == wrong_width))
    monkeypatch.setattr(engines, "bundle_policy", lambda rt: _decoder("bundle"))
    return made


def fake_runtime(tmp_path, weights: dict, **parts):
    """A bundle's runtime with no model behind it (the engines are faked): manifest and tokenizer
    (model None: no logits to judge a tie by, so only exact equality passes)."""
    from types import SimpleNamespace

    manifest = SimpleNamespace(
        models={"target": {"name": "tiny", "sha256": "0" * 64}}, recipe={"name": "tiny-lookup", "max_context": 256},
        weight_format=lambda role: weights.get(role, "fp32"), dtype="float32", bundle_id="fake", buckets=(),
        recipe_identity="fake-identity", environment=SimpleNamespace(device="cpu"))
    return SimpleNamespace(manifest=manifest, draft=None, path=tmp_path,
                           target=SimpleNamespace(tokenizer=SimpleNamespace(decode=lambda ids, **k: str(ids)),
                                                  model=None),
                           **{"policy": None, **parts})


def fake_suite_setup(tmp_path, suite: str, runtime, skip: tuple[str, ...] = ()) -> Setup:
    options = BenchOptions(suite, tmp_path, n=1, max_new_tokens=4, out=tmp_path / "out", skip=skip)
    return Setup(options, runtime, [Prompt("set", "a", (1, 2, 3)), Prompt("set", "b", (4, 5))], {})


def fake_compare_setup(tmp_path, monkeypatch, weights: dict, skip: tuple[str, ...] = ("hf-greedy", "hf-assisted")):
    """suite_compare over a fake bundle (no model, no compile): fake_engines."""
    from types import SimpleNamespace

    from yggdrasil.bench import shapes, suite_compare

    made = fake_engines(monkeypatch)
    monkeypatch.setattr(shapes, "full_selector", lambda rt: None)
    monkeypatch.setattr(shapes, "best_chain", lambda selector: SimpleNamespace(depth=2, verify=4))
    monkeypatch.setattr(suite_compare.plots, "compare", lambda rows, heading, path: path.write_bytes(b""))
    return suite_compare, fake_suite_setup(tmp_path, "compare", fake_runtime(tmp_path, weights), skip), made


def test_compare_checks_a_reduced_precision_bundle_against_its_own_graphs(tmp_path, monkeypatch, capsys):
    """An int8 bundle: egt equals the bundle's own autoregressive graphs, so it is exact although
    eager int8 (other kernels) leaves them at a near-tie; eager and torch.compile rows are checked
    against their own backend's autoregressive output and say so."""
    suite_compare, setup, _ = fake_compare_setup(tmp_path, monkeypatch, {"target": "int8"})
    result = suite_compare.run(setup)
    rows = {r["variant"]: r for r in result["rows"]}
    assert list(rows) == ["ar-eager", "ar-torch.compile", "ar-compiled", "chain-D2", "egt"]
    for name in ("ar-compiled", "egt"):
        assert rows[name]["valid"] and rows[name]["status"] == "ok", rows[name]
        assert rows[name]["check"]["reference"] == "ar-compiled"
    for name, reference in (("ar-eager", "ar-eager"), ("ar-torch.compile", "ar-torch.compile"),
                            ("chain-D2", "ar-torch.compile")):
        assert rows[name]["status"] == "ok (own reference)" and rows[name]["check"]["reference"] == reference
    assert setup.reference[1] == tuple(_tokens("bundle", (4, 5), 4))  # llama.cpp's text is checked against it
    table = (tmp_path / "out" / "compare.txt").read_text()
    assert "(int8 weights)" in table.splitlines()[0]
    assert "the deployed int8 model's autoregressive greedy" in table and "(own reference)" in table
    assert result["setup"]["weights"] == "int8" and result["bundle"]["weights"] == {"target": "int8"}


def test_compare_keeps_the_eager_reference_for_an_fp32_bundle(tmp_path, monkeypatch):
    """fp32: every row against eager autoregressive greedy, as before (so the fake's near-tie makes
    the bundle's rows INVALID here: fp32 kernels are expected to agree)."""
    suite_compare, setup, _ = fake_compare_setup(tmp_path, monkeypatch, {})
    rows = {r["variant"]: r for r in suite_compare.run(setup)["rows"]}
    assert rows["ar-eager"]["status"] == "ok" and rows["ar-eager"]["check"]["reference"] == "ar-eager"
    assert rows["egt"]["status"] == "INVALID (1/2)" and rows["egt"]["check"]["differs_on"] == ["b"]
    assert not any(r["check"].get("own_reference") for r in rows.values())


def test_compare_says_why_an_int4_bundle_has_no_torch_compile_rows(tmp_path, monkeypatch):
    """torch.compile cannot lower int4: its rows are not run (no runner is even made), and the table
    and JSON say which rows and why; rows left out by --skip are not listed."""
    suite_compare, setup, made = fake_compare_setup(tmp_path, monkeypatch, {"target": "int4"})
    result = suite_compare.run(setup)
    assert [r["variant"] for r in result["rows"]] == ["ar-eager", "ar-compiled", "egt"]
    assert "torch.compile" not in made
    not_run = result["setup"]["not_run"]
    assert not_run["rows"] == ["ar-torch.compile", "chain-D2"] and "int4" in not_run["why"]
    table = (tmp_path / "out" / "compare.txt").read_text()
    assert "not run: ar-torch.compile, chain-D2 (the target is deployed in int4: torch.compile cannot" in table
    _, skipping, _ = fake_compare_setup(tmp_path, monkeypatch, {"target": "int4"},
                                        skip=("hf-greedy", "hf-assisted", "chain"))
    assert suite_compare.run(skipping)["setup"]["not_run"]["rows"] == ["ar-torch.compile"]


def fake_ablation_setup(tmp_path, monkeypatch, weights: dict):
    """suite_ablation over a fake bundle that speculates (a policy, no predictor, no stage moves)."""
    from types import SimpleNamespace

    from yggdrasil.bench import shapes, suite_ablation

    fake_engines(monkeypatch)
    monkeypatch.setattr(shapes, "best_whole_tree", lambda selector: SimpleNamespace(depth=2, width=2, verify=5))
    monkeypatch.setattr(suite_ablation, "AutoPolicy", lambda selector, model: None)
    monkeypatch.setattr(suite_ablation.plots, "ablation", lambda rows, heading, path: path.write_bytes(b""))
    grid = SimpleNamespace(widths=(1, 2), verifies=(1, 5), max_depth=2, max_width=2)
    policy = SimpleNamespace(grid=grid, model=None, confidence=None,
                             selector=SimpleNamespace(constant=lambda: ("D2xW2/V5", 1.0)))
    runtime = fake_runtime(tmp_path, weights, policy=policy, plans=SimpleNamespace(any_moves=False), latency=None)
    return suite_ablation, fake_suite_setup(tmp_path, "ablation", runtime)


ABLATION_ROWS = ["O1 EGT D2xW2", "O2 +graphs", "O3 +pruning", "O4 +stage plans", "O5 +predictor",
                 "const D2xW2/V5", "ar-eager", "ar-compiled"]


def test_ablation_checks_a_reduced_precision_bundle_against_its_own_graphs(tmp_path, monkeypatch):
    """An int8 bundle whose eager kernels split a near-tie on prompt b: the rows on the bundle's
    graphs are exact against its own autoregressive graphs, the eager rows (O1, ar-eager) against
    eager autoregressive greedy, "(own reference)"; the table says which and where eager differs."""
    suite_ablation, setup = fake_ablation_setup(tmp_path, monkeypatch, {"target": "int8"})
    result = suite_ablation.run(setup)
    rows = {r["variant"]: r for r in result["rows"]}
    assert list(rows) == ABLATION_ROWS
    for name in ABLATION_ROWS:
        eager = name in ("O1 EGT D2xW2", "ar-eager")
        assert rows[name]["status"] == ("ok (own reference)" if eager else "ok"), rows[name]
        assert rows[name]["check"]["reference"] == ("ar-eager" if eager else "ar-compiled")
    assert setup.reference[1] == tuple(_tokens("bundle", (4, 5), 4))
    table = (tmp_path / "out" / "ablation.txt").read_text()
    assert "(int8 weights)" in table.splitlines()[0]
    assert "the deployed int8 model's autoregressive greedy" in table
    assert "equals the deployed model's on 1/2 prompts" in table


def test_ablation_keeps_the_eager_reference_for_an_fp32_bundle(tmp_path, monkeypatch):
    """fp32: every row against eager autoregressive greedy, as before, so the fake's near-tie is a
    real divergence of the bundle's rows and they are INVALID; no footnote is added."""
    suite_ablation, setup = fake_ablation_setup(tmp_path, monkeypatch, {})
    rows = {r["variant"]: r for r in suite_ablation.run(setup)["rows"]}
    assert list(rows) == ABLATION_ROWS
    for name in ABLATION_ROWS:
        eager = name in ("O1 EGT D2xW2", "ar-eager")
        assert rows[name]["status"] == ("ok" if eager else "INVALID (1/2)"), rows[name]
        assert rows[name]["check"]["reference"] == "ar-eager" and "own_reference" not in rows[name]["check"]
    assert "deployed" not in (tmp_path / "out" / "ablation.txt").read_text()


def fake_trees_setup(tmp_path, monkeypatch, weights: dict, wrong_width: int | None = None):
    """suite_trees over a fake bundle: verify widths 1 and 4, draft widths 1 and 2, lookup drafting."""
    from types import SimpleNamespace

    from yggdrasil.bench import shapes, suite_trees
    from yggdrasil.buckets import Bucket
    from yggdrasil.runtime.latency import LatencyProfile

    fake_engines(monkeypatch, wrong_width)
    grid = SimpleNamespace(verifies=(1, 4), widths=(1, 2))
    selector = SimpleNamespace(grid=grid, best_at_verify=lambda v: Bucket(3, 1, v))
    monkeypatch.setattr(shapes, "full_selector", lambda rt: selector)
    monkeypatch.setattr(shapes, "best", lambda sel, allowed: (Bucket(2, 2, 4), 1.0))
    monkeypatch.setattr(suite_trees.plots, "trees", lambda rows, heading, path: path.write_bytes(b""))
    latency = LatencyProfile(draft=((1, 0.001), (2, 0.001)), verify=((1, 0.01), (4, 0.012)))
    return suite_trees, fake_suite_setup(tmp_path, "trees", fake_runtime(tmp_path, weights, latency=latency))


def test_trees_rows_of_a_reduced_precision_bundle_are_checked_against_eager_and_say_so(tmp_path, monkeypatch):
    """Trees run on eager steps: on an int8 bundle they are exact against eager autoregressive greedy
    ("own reference") although the deployed graphs split a near-tie the other way, and a real
    speculation bug (the width-2 tree, one token off) is still INVALID."""
    suite_trees, setup = fake_trees_setup(tmp_path, monkeypatch, {"target": "int8"}, wrong_width=2)
    result = suite_trees.run(setup)
    rows = {r["variant"]: r for r in result["rows"]}
    assert list(rows) == ["chain/V4", "egt/V4", "egt-W2/V4"]
    assert rows["chain/V4"]["status"] == rows["egt/V4"]["status"] == "ok (own reference)"
    assert rows["egt-W2/V4"]["status"] == "INVALID (1/2) (own reference)"
    assert all(r["check"]["reference"] == "ar-eager" for r in rows.values())
    assert "equals the deployed model's on 1/2 prompts" in result["reference"]
    assert result["reference"] in (tmp_path / "out" / "trees.txt").read_text()


def test_trees_keep_the_eager_reference_for_an_fp32_bundle(tmp_path, monkeypatch):
    suite_trees, setup = fake_trees_setup(tmp_path, monkeypatch, {}, wrong_width=2)
    result = suite_trees.run(setup)
    rows = {r["variant"]: r for r in result["rows"]}
    assert [r["status"] for r in rows.values()] == ["ok", "ok", "INVALID (1/2)"]
    assert not any(r["check"].get("own_reference") for r in rows.values()) and result["reference"] is None


@pytest.mark.slow
def test_torch_compile_still_cannot_lower_int4(tmp_path):
    """What engines.TORCH_COMPILE_CANNOT_LOWER claims, on the tiny model: if this fails, torch.compile
    learned to lower the int4 linear; drop int4 from that table so compare runs its rows again."""
    from helpers import save_random_hf_model

    from yggdrasil.runtime.generate import greedy_tokens
    from yggdrasil.models.loader import load
    from yggdrasil.runtime.steps import StepRunner

    save_random_hf_model(tmp_path / "tiny", "llama")
    loaded = load(str(tmp_path / "tiny"), dtype=torch.float32, quiet=True, weights="int4")
    runner = StepRunner(loaded.model, 64, chunk_sizes=(16,), compile=True)
    with pytest.raises(Exception, match="group size must be a scalar"):
        greedy_tokens(runner, [1, 2, 3], 2)


def _formats_module():
    from yggdrasil.bench import formats  # a script too (bench/formats.py): imports its siblings by path

    return formats


class FakeBundle:
    def __init__(self, draft_widths, latency):
        from types import SimpleNamespace

        self.layout = SimpleNamespace(read_selection=lambda: {"draft_widths": draft_widths})
        self.latency = lambda: latency


def test_formats_bench_prints_no_bundle_step_times_for_a_bundle_without_verify_graphs():
    """A bundle that chose no speculation kept no verify graph and measured none: its profile's
    unmeasured default (1 s) must not be reported as T(1) = 1000 ms; a measured one is."""
    import json

    from yggdrasil.runtime.latency import LatencyProfile

    formats = _formats_module()
    plain = formats.bundle_step_times(FakeBundle([], LatencyProfile()))
    assert plain == {"bundle_t1_ms": None, "bundle_widest_verify": None}
    measured = formats.bundle_step_times(FakeBundle([1, 2], LatencyProfile(verify=((1, 0.004), (4, 0.005)))))
    assert measured == {"bundle_t1_ms": 4.0, "bundle_t4_ms": 5.0, "bundle_widest_verify": 4}
    row = {"format": "int8", "eager_t_ms": {1: 5.0, 16: 9.0}, "ar_tpot_ms": 6.7, "spec_tpot_ms": 6.6,
           "agreement": 0.94, "perplexity": 14.6, "weight_bytes": 2.5e8, "compile_seconds": 100.0,
           "passes_recipe_floor": False}
    lines = formats.table([{**row, **plain}, {**row, "format": "int4", **measured}]).splitlines()
    assert "1000" not in lines[-2] and lines[-2].split()[4:6] == ["-", "-"]
    assert lines[-1].split()[4:6] == ["4.0", "5.0"]
    assert '"bundle_t1_ms": null' in json.dumps(plain)


@pytest.mark.slow
def test_compare_on_an_int4_tiny_bundle(tmp_path, monkeypatch):
    """End to end on a real int4 bundle (tiny model, prompt lookup): the bundle's rows are checked
    against its own autoregressive graphs, the eager row against eager int4 ("own reference"), and
    the torch.compile rows, which would crash, are not run and the table says why."""
    import yaml
    from helpers import write_tiny_recipe_dir

    from yggdrasil.runtime import latency
    from yggdrasil.compile.build import build_bundle
    from yggdrasil.compile.recipe import load_recipe

    recipe_path = write_tiny_recipe_dir(tmp_path)
    raw = yaml.safe_load(recipe_path.read_text())
    raw.update(weights="int4", draft="lookup", quality={"min_agreement": 0.01, "allow_int4": True,
                                                        "agreement_tokens": 32, "heldout_tokens": 32})
    raw["buckets"].update(draft_widths=[1], verify_widths=[4])
    raw["calibration"].update(num_prompts=6, max_new_tokens=16)
    recipe_path.write_text(yaml.safe_dump(raw))
    profile = latency.LatencyProfile(draft=((1, 0.0),), verify=((1, 1.0), (4, 1.3)))  # as tiny_bundle's
    monkeypatch.setattr(latency, "measure_profile", lambda *a, **k: profile)
    build_bundle(load_recipe(recipe_path), tmp_path / "bundle", log=lambda m: None)
    run = subprocess.run([sys.executable, "-m", "yggdrasil.cli", "bench", "compare",
                          "--bundle", str(tmp_path / "bundle"), "--prompts", str(tmp_path / "tiny-prompts.jsonl"), "--n", "2", "--max-new-tokens", "8",
                          "--skip", "hf-greedy,hf-assisted", "--out", str(tmp_path / "out")],
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    rows = {r["variant"]: r for r in result["rows"]}
    assert list(rows) == ["ar-eager", "ar-compiled", "egt", "egt-hybrid"]  # a lookup bundle's hybrid: lookup or a plain step
    assert rows["ar-compiled"]["status"] == rows["egt"]["status"] == rows["egt-hybrid"]["status"] == "ok"
    assert rows["egt"]["check"]["reference"] == "ar-compiled"
    assert rows["ar-eager"]["status"] == "ok (own reference)"
    assert result["bundle"]["weights"] == {"target": "int4"}
    table = (tmp_path / "out" / "compare.txt").read_text()
    assert "(int4 weights)" in table and "not run: ar-torch.compile, chain-D" in table
