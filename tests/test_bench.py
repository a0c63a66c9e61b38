"""`yggdrasil bench`: each suite end to end on the tiny bundle (--n 2), and the checks the suites
rely on: rows whose output differs from autoregressive greedy are marked invalid, shapes come
from the objective, bad options get clear errors."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import FakeResult

from yggdrasil.bench import common
from yggdrasil.bench.provenance import missing_fields
from yggdrasil.bench.harness import (BenchOptions, Prompt, Run, Setup, compute_reference, measure, summary_row,
                                     variant)
from yggdrasil.bundle import open_bundle
from yggdrasil.errors import InvalidRequestError

SUITES = ("compare", "ablation", "trees", "sensitivity")


def run_suite(suite: str, bundle: Path, prompts: Path, out: Path) -> tuple[dict, subprocess.CompletedProcess]:
    run = subprocess.run([sys.executable, "-m", "yggdrasil.cli", "bench", suite, "--bundle", str(bundle),
                          "--prompts", str(prompts), "--n", "2", "--max-new-tokens", "8", "--out", str(out)],
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    last = run.stdout.strip().splitlines()[-1]
    return json.loads(last), run


def check_files(result: dict, suite: str, out: Path, prompts: Path) -> None:
    """Every result file exists and is well formed: CSV rows = JSON rows, a real PNG, a Markdown table."""
    for kind in ("txt", "csv", "json", "md", "png"):
        assert (out / f"{suite}.{kind}").is_file(), kind
    assert json.loads((out / f"{suite}.json").read_text())["rows"] == result["rows"]
    with open(out / f"{suite}.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["variant"] for r in rows] == [r["variant"] for r in result["rows"]]
    png = (out / f"{suite}.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 10_000
    md = (out / f"{suite}.md").read_text().splitlines()
    assert md[0].startswith("| variant") and len(md) == 2 + len(result["rows"])
    env = result["environment"]
    assert env["torch"] == torch.__version__ and env["dtype"] == "float32" and env["device"]
    assert set(result["models"]) == {"target", "draft"} and all(m["sha256"] for m in result["models"].values())
    assert len(result["prompts"]["ids"]) == 2 and result["prompts"]["sets"] == [str(prompts)]
    assert missing_fields(result) == [], missing_fields(result)  # issue 39: every result's provenance
    prov = result["provenance"]
    assert prov["command"].startswith(f"yggdrasil bench {suite} --bundle ") and prov["bundle"]["id"]
    assert prov["machine_before"]["verdict"] in ("quiet", "noisy") and prov["machine_after"]["verdict"]


@pytest.mark.slow
@pytest.mark.parametrize("suite", SUITES)
def test_suite_end_to_end_on_the_tiny_bundle(suite, tiny_bundle, tmp_path):
    recipe_path, bundle = tiny_bundle
    result, run = run_suite(suite, bundle, recipe_path.parent / "tiny-prompts.jsonl", tmp_path)
    assert result["benchmark"] == suite
    check_files(result, suite, tmp_path, recipe_path.parent / "tiny-prompts.jsonl")
    assert "warm-up" in run.stderr and "timing" in run.stderr  # progress lines
    rows = {r["variant"]: r for r in result["rows"]}
    greedy = [r for r in rows.values() if r["valid"] is not None]
    assert greedy and all(r["valid"] for r in greedy)  # the suite compared every greedy row's tokens
    # TPOT is a difference of two wall times: on a loaded machine a run's can be clipped to 0,
    # which its row must then say; some row of every suite measures a positive one
    assert all(r["tpot_ms"] >= 0 and (r["tpot_ms"] > 0 or r["tpot_clipped"] > 0) for r in rows.values())
    assert any(r["tpot_ms"] > 0 for r in rows.values())
    if suite == "compare":
        assert {"hf-greedy", "hf-assisted", "ar-eager", "ar-torch.compile", "ar-compiled", "egt"} <= set(rows)
        assert any(v.startswith("chain-D") for v in rows) and any(v.startswith("sequoia-V") for v in rows)
        assert rows["hf-greedy"]["aal"] == 1.0 and rows["egt"]["aal"] > 1.0
        assert rows["egt"]["x_hf-greedy"] is not None and rows["ar-compiled"]["x_ar-compiled"] is None
    elif suite == "ablation":
        steps = [v for v in rows if v.startswith("O")]
        assert [s[:2] for s in steps] == ["O1", "O2", "O3", "O4", "O5"]
        # a speed-up over O1 is a ratio of TPOTs: 0 where O1's were clipped, undefined (None) only
        # where every run of the row was
        assert rows[steps[0]]["x_O1"] == 1.0
        assert all(rows[s]["x_O1"] >= 0 if rows[s]["x_O1"] is not None else rows[s]["tpot_clipped"] == rows[s]["runs"]
                   for s in steps)
        assert {"ar-eager", "ar-compiled"} <= set(rows)
        # the shipped policy against the best constant: "same policy" when it is the constant one
        # (then there is nothing to test), else the one-sided test with its margin and statistic
        verdict = result["policy_vs_constant"]
        policy = open_bundle(bundle, quiet=True).policy()
        if policy.model is None and policy.confidence is None:
            assert verdict["same_policy"] and verdict["verdict"] == "no difference: same policy"
        elif verdict is not None:
            assert {"lower_95_one_sided", "margin", "never_slower", "statistic"} <= set(verdict)
    elif suite == "trees":
        assert {"chain", "egt", "egt-W2", "sequoia"} <= {r["structure"] for r in rows.values()}
        assert all(r["aal"] >= 1.0 and r["objective_speedup"] > 0 for r in rows.values())
        # issue 25: the EGT the objective picks at each V is never capped below the plain chain
        for v in {r["verify"] for r in rows.values()}:
            assert rows[f"egt/V{v}"]["aal"] >= rows[f"chain/V{v}"]["aal"], v
    else:
        temps = {(r["kind"], r["temperature"]) for r in result["temperatures"]}
        assert temps == {(k, t) for k in ("ar-compiled", "egt") for t in (0.0, 0.6, 1.0)}
        assert all(r["valid"] is None for r in result["temperatures"] if r["temperature"] > 0)
        assert {(r["depth"], r["width"], r["verify"]) for r in result["grid"]} >= {(3, 1, 4), (1, 1, 2)}
        assert result["fastest_bucket"] in rows


# ---------------------------------------------------------------- fast checks

def fake_setup(tmp_path) -> Setup:
    options = BenchOptions("compare", tmp_path, n=1, max_new_tokens=4, repeats=2, out=tmp_path)
    prompts = [Prompt("set", "a", (1, 2, 3)), Prompt("set", "b", (4, 5))]
    return Setup(options, None, prompts, {})


def test_a_row_whose_tokens_differ_from_greedy_is_marked_invalid(tmp_path):
    setup = fake_setup(tmp_path)

    def greedy(ids, n, sampling):
        return FakeResult([ids[-1] + k for k in range(n)])

    def wrong_on_b(ids, n, sampling):  # right on prompt a, one token off on prompt b
        tokens = greedy(ids, n, sampling).tokens
        return FakeResult(tokens if ids[0] == 1 else tokens[:-1] + [0])

    compute_reference(setup, greedy)
    samples = measure(setup, {"good": variant(setup, greedy), "bad": variant(setup, wrong_on_b)})
    good, bad = (summary_row(setup, samples, name, ("good",)) for name in ("good", "bad"))
    assert good["valid"] and good["check"]["exact"] == 2
    assert bad["valid"] is False and bad["check"] == {"valid": False, "exact": 1, "of": 2, "differs_on": ["b"],
                                                      "reference": "autoregressive greedy"}
    assert good["runs"] == bad["runs"] == 4  # 2 prompts x 2 repeats, interleaved
    sampled = summary_row(setup, samples, "bad", (), greedy=False)
    assert sampled["valid"] is None  # sampled rows are not compared token for token


@pytest.mark.parametrize("gap, valid", [(0.0, True), (0.9, False)])
def test_a_low_precision_row_leaving_its_reference_at_a_logit_tie_stays_valid(tmp_path, monkeypatch, gap, valid):
    """Reduced-precision bundles: a divergence where the deployed model's logits tie (compile's
    rule) is named, not invalid; a divergence at a clear gap is invalid as ever."""
    from yggdrasil.bench import harness
    from yggdrasil.compile.check import Agreement

    setup = fake_setup(tmp_path)
    seen = []

    def judge(model, prompt, reference, candidate):
        seen.append((model, prompt, len(reference)))
        return Agreement(False, 3, gap, 0.5)

    monkeypatch.setattr(harness, "compare_greedy", judge)

    def greedy(ids, n, sampling):
        return FakeResult([ids[-1] + k for k in range(n)])

    def split_on_b(ids, n, sampling):
        tokens = greedy(ids, n, sampling).tokens
        return FakeResult(tokens if ids[0] == 1 else tokens[:3] + [0] * (n - 3))

    compute_reference(setup, greedy)
    setup.tie_model = "the deployed model"
    samples = measure(setup, {"split": variant(setup, split_on_b)})
    row = summary_row(setup, samples, "split", ())
    assert seen and all(model == "the deployed model" for model, _, _ in seen)
    assert row["valid"] is valid and row["check"]["exact"] == 1
    if valid:
        assert row["check"]["differs_on"] == [] and row["check"]["ties"] == ["b at token 3 (gap 0 <= 0.5)"]
        assert harness.status(row) == "ok (1/2 exact, tie on 1)"
    else:
        assert row["check"]["differs_on"] == ["b"] and "ties" not in row["check"]
        assert harness.status(row) == "INVALID (1/2)"


def test_short_generations_are_an_error_not_a_wrong_tpot(tmp_path):
    setup = fake_setup(tmp_path)
    with pytest.raises(RuntimeError, match="emitted 3 tokens, expected 4"):
        variant(setup, lambda ids, n, s: FakeResult([0] * min(n, 3)))(0)


def test_speedups_are_paired_per_prompt_and_repeat():
    from yggdrasil.bench.harness import _values, speedup

    samples = [common.Sample(r, i, v, _values(Run((), t))) for r in range(2) for i in range(2)
               for v, t in (("base", 0.02 * (i + 1)), ("fast", 0.01 * (i + 1)))]

    assert speedup(samples, "base", "fast") == pytest.approx(2.0)
    assert speedup(samples, "fast", "fast") is None and speedup(samples, "missing", "fast") is None


def test_shapes_come_from_the_objective():
    from yggdrasil.bench import shapes
    from yggdrasil.runtime.latency import LatencyProfile
    from yggdrasil.buckets import Bucket, Grid
    from yggdrasil.policy.select import Selector

    grid = Grid((1, 2, 3), (1, 2), (1, 2, 4))
    latency = LatencyProfile(draft=((1, 0.01), (2, 0.012)), verify=((1, 0.1), (2, 0.11), (4, 0.13)))
    # accepted tokens grow with depth and verify width; width 2 adds a little
    accepted = torch.tensor([[[0.0, 0.8, 0.8], [0.0, 0.9, 0.95]],
                             [[0.0, 0.8, 1.5], [0.0, 0.9, 1.7]],
                             [[0.0, 0.8, 2.1], [0.0, 0.9, 2.2]]])
    selector = Selector(grid, latency, accepted, accepted[:, 1, 2].clone())
    chain = shapes.best_chain(selector)
    assert chain == Bucket(3, 1, 4)  # the deepest chain that fits V=4 wins on these numbers
    whole = shapes.best_whole_tree(selector)
    assert shapes.whole_tree(whole) and whole.verify >= 1 + whole.depth * whole.width
    value = shapes.objective(selector, Bucket(3, 1, 4))
    assert value == pytest.approx((1 + 2.1) * 0.1 / (3 * 0.01 + 0.13))


def test_the_command_line_reaches_the_options(tmp_path, monkeypatch):
    """Every bench flag ends up in BenchOptions (a flag lost on the way silently runs defaults)."""
    from yggdrasil.cli import bench as bench_cmd
    from yggdrasil.bench import run as run_mod
    from yggdrasil.cli import build_parser

    seen = []
    monkeypatch.setattr(run_mod, "run_bench", lambda options, command=None: seen.append(options) or 0)
    args = build_parser().parse_args(["bench", "sensitivity", "--bundle", str(tmp_path), "--prompts", "a.jsonl, mtbench",
                                      "--n", "3", "--max-new-tokens", "9", "--repeats", "2", "--temperatures", "0,0.5",
                                      "--skip", "hf-assisted", "--out", str(tmp_path / "out"), "--threads", "1"])
    assert bench_cmd.main(args) == 0
    assert seen == [BenchOptions("sensitivity", tmp_path, ("a.jsonl", "mtbench"), 3, 9, 2, tmp_path / "out",
                                 temperatures=(0.0, 0.5), skip=("hf-assisted",), threads=1)]


def test_bad_options_get_clear_errors(tmp_path):
    with pytest.raises(InvalidRequestError, match="unknown suite 'speed'"):
        BenchOptions("speed", tmp_path)
    with pytest.raises(InvalidRequestError, match="--max-new-tokens must be >= 2"):
        BenchOptions("compare", tmp_path, max_new_tokens=1)
    with pytest.raises(InvalidRequestError, match="--n and --repeats must be >= 1"):
        BenchOptions("compare", tmp_path, n=0)
    run = subprocess.run([sys.executable, "-m", "yggdrasil.cli", "bench", "compare", "--bundle", str(tmp_path)],
                         capture_output=True, text=True)
    assert run.returncode != 0 and "is not a bundle (no manifest.yaml)" in run.stderr
    assert "yggdrasil compile RECIPE" in run.stderr


@pytest.mark.slow
def test_a_fixed_tree_smaller_than_a_compiled_verify_width_runs_padded_on_the_bundle(tiny_bundle):
    """The ablation's O2 verifies a whole tree in the smallest compiled width that holds it: a
    3-node tree in the 4-row verify graph (no 3-row graph exists), with the same greedy output."""
    from yggdrasil.runtime.drafters import ModelDrafter
    from yggdrasil.runtime.generate import greedy_tokens
    from yggdrasil.runtime.latency import LatencyProfile
    from yggdrasil.sampling import SamplingParams
    from yggdrasil.runtime.speculative import SpeculativeGenerator

    _, bundle = tiny_bundle
    rt = open_bundle(bundle, quiet=True).generator()
    ids = rt.target.tokenizer.encode("alpha beta gamma tree")
    expected = greedy_tokens(rt.runner, ids, 16)
    drafter = ModelDrafter(rt.draft_runner, 1, 2, (1, 2))
    spec = SpeculativeGenerator(rt.runner, drafter, [4], profile=LatencyProfile())
    assert drafter.capacity == 3 and spec.verify_widths == [1, 4]
    result = spec.generate(ids, 16, SamplingParams())
    assert result.tokens == expected and set(result.spec.shapes) <= {"D1xW2/V4", "D1xW2/V1"}


def test_a_tpot_clipped_by_timing_noise_is_flagged_not_hidden(tmp_path, monkeypatch):
    """When the N-token run takes no longer than the 1-token run (a loaded machine), TPOT is 0 and
    the run and its row say it was clipped; a real difference is not flagged."""
    from yggdrasil.bench import harness

    clock = iter([0.0, 0.005, 1.0, 1.010])  # N tokens in 5 ms, then 1 token in 10 ms: noise
    monkeypatch.setattr(harness.time, "perf_counter", lambda: next(clock))
    greedy = lambda ids, n, sampling: FakeResult(list(range(n)))  # noqa: E731
    clipped = harness.timed_run(greedy, (1,), 4)
    assert clipped.tpot == 0.0 and clipped.clipped
    clock = iter([0.0, 0.040, 1.0, 1.010])
    timed = harness.timed_run(greedy, (1,), 4)
    assert timed.tpot == pytest.approx(0.010) and not timed.clipped
    setup = fake_setup(tmp_path)
    samples = [common.Sample(0, i, "v", harness._values(run)) for i, run in enumerate((clipped, timed))]
    compute_reference(setup, lambda ids, n, s: FakeResult(list(range(n))))
    row = summary_row(setup, samples, "v", ())
    assert row["tpot_clipped"] == 1 and row["tpot_min_ms"] == 0.0 and row["tpot_max_ms"] == 10.0
    assert harness.clipped_note([row, {**row, "variant": "w", "tpot_clipped": 0}]).endswith("in runs of v (1/2)")
    assert harness.clipped_note([{**row, "tpot_clipped": 0}]) == ""


@pytest.mark.parametrize("bitwise", [False, True])
def test_a_batch_invariant_bundle_is_judged_exactly_with_no_tie_rule(tmp_path, monkeypatch, bitwise):
    """Issue 40: for a bundle whose steps are batch-invariant (q4), the deployed reference has no
    tie model, so a row that leaves it even at a logit tie is INVALID; other reduced-precision
    bundles keep the tie rule. (This fails if a tie rule is applied to a bitwise bundle.) Issue 53:
    what decides is the manifest's measured claim, not that the invariant ops are on."""
    from types import SimpleNamespace

    from yggdrasil.bench import harness
    from yggdrasil.compile.check import Agreement

    setup = fake_setup(tmp_path)
    model = SimpleNamespace(batch_invariant=True)  # the ops are on either way: the manifest's measurement decides
    setup.runtime = SimpleNamespace(target=SimpleNamespace(model=model), manifest=SimpleNamespace(bitwise=bitwise))
    monkeypatch.setattr(harness, "compare_greedy", lambda *a: Agreement(False, 3, 0.0, 0.5))  # an exact tie

    def greedy(ids, n, sampling):
        return FakeResult([ids[-1] + k for k in range(n)])

    def split_on_b(ids, n, sampling):
        tokens = greedy(ids, n, sampling).tokens
        return FakeResult(tokens if ids[0] == 1 else tokens[:3] + [0] * (n - 3))

    note = harness.deployed_reference(setup, "q4", greedy, greedy, [])
    assert (setup.tie_model is None) == bitwise and ("no tie rule" in note) == bitwise
    # compare's own footnote describes the tie rule only for a bundle that needs it
    from yggdrasil.bench.suite_compare import reference_note

    footnote = reference_note("q4", setup.tie_model is not None)
    assert ("no tie rule" in footnote) == bitwise and (harness.TIE_NOTE in footnote) != bitwise
    row = summary_row(setup, measure(setup, {"split": variant(setup, split_on_b)}), "split", ())
    assert row["valid"] is (not bitwise)


def test_a_cold_compile_pairs_its_bundle_with_an_earlier_one_on_held_out_prompts(tiny_bundle, tmp_path):
    """bench/cold_compile --compare-with: the new and the old bundle run the same held-out
    prompts interleaved; a bundle against a copy of itself generates the same tokens, and the
    ratio of each prompt's TPOT is reported (its median and quartiles named as such)."""
    import shutil

    from yggdrasil.bench.cold_compile import paired_tpot

    _, bundle = tiny_bundle
    copy = tmp_path / "copy"
    shutil.copytree(bundle, copy, symlinks=True)
    paired = paired_tpot(copy, bundle, prompts=2, tokens=8)
    # a tiny model's run can take no longer than its 1-token run on a busy machine: that pair is left out
    assert paired["same_greedy_tokens"] and len(paired["prompts"]) == len(paired["ratios"]) + paired["clipped_pairs"] == 2
    assert all(r > 0 for r in paired["ratios"]) and paired["tpot_ratio_new_over_old"]["n"] == len(paired["ratios"])
    assert "median" in paired["statistic"] and "paired" in paired["statistic"]
