"""Speculation quality (issue 25), on synthetic calibration data:

- the depth predictor ships only when it beats the best constant bucket on held-out prompts by
  PREDICTOR_MARGIN, and the summary (so `inspect`) says which policy shipped, why, and the
  predicted vs realised AAL of both;
- trees are never capped below a chain: a grid with width 1 calibrates depth V - 1 (the chain
  that fills V), and the shape chosen at each verify width accepted at least the chain's tokens.
"""

from __future__ import annotations

import pytest
import torch
import yaml
from yggdrasil.compile.recipe import parse_recipe
from yggdrasil.storage.layout import PREDICTOR_SUMMARY, BundleLayout
from yggdrasil.policy.calibration import CalibrationRun
from yggdrasil.predictor.calibration_data import save_run
from yggdrasil.predictor.pipeline import describe_policy, train_and_report
from yggdrasil.policy.auto import PREDICTOR_MARGIN, decide_policy, predictor_pays
from yggdrasil.policy.select import Selector

from yggdrasil.buckets import Bucket, Grid, chain_depths
from yggdrasil.cli.inspect import _print_policy, describe_policy_buckets
from yggdrasil.compile.write import predictor_stats
from yggdrasil.runtime.latency import LatencyProfile

GRID = Grid((1, 2, 3, 4), (1,), (1, 2, 4, 5))
# drafting is cheap, a verify costs more with every row: speculating on an iteration that
# accepts nothing loses, so knowing which iterations accept pays
LATENCY = LatencyProfile(draft=((1, 0.05),), verify=((1, 1.0), (2, 1.3), (4, 1.6), (5, 1.8)))
PROMPTS, PER_PROMPT, DIM = 16, 40, 8


def synthetic_run(learnable: bool, seed: int = 0) -> CalibrationRun:
    """Chains only (width 1): a depth-d chain pruned to V accepts min(a, d, V - 1) of the a
    tokens the deepest chain accepted. learnable: a is 4 when the hidden state's first
    coordinate is positive and 0 otherwise; else a is uniform noise over 0..4."""
    generator = torch.Generator().manual_seed(seed)
    n = PROMPTS * PER_PROMPT
    hidden = torch.randn(n, DIM, generator=generator)
    if learnable:
        accepted_max = torch.where(hidden[:, 0] > 0, 4, 0)
    else:
        accepted_max = torch.randint(0, 5, (n,), generator=generator)
    depths = torch.tensor(GRID.depths)[None, :, None, None]
    verifies = torch.tensor(GRID.verifies)[None, None, None, :]
    accepted = torch.minimum(torch.minimum(accepted_max[:, None, None, None], depths), verifies - 1)
    prompt_index = torch.arange(n) // PER_PROMPT
    return CalibrationRun(GRID, hidden.half(), accepted_max, accepted.to(torch.int8), prompt_index,
                          (0,), 0, n, 0)


def calibrated(tmp_path, learnable: bool) -> tuple[dict, object]:
    directory = tmp_path / ("learnable" if learnable else "noise")
    save_run(synthetic_run(learnable), directory, {"draft": "tiny-draft"}, LATENCY)
    return train_and_report(directory), directory


@pytest.fixture(scope="module")
def learnable(tmp_path_factory):
    return calibrated(tmp_path_factory.mktemp("quality"), learnable=True)


@pytest.fixture(scope="module")
def noise(tmp_path_factory):
    return calibrated(tmp_path_factory.mktemp("quality"), learnable=False)


def test_a_predictor_that_can_learn_acceptance_ships_and_wins_held_out(learnable):
    summary, _ = learnable
    objective, policy = summary["objective"], summary["policy"]
    assert policy["shipped"] == "predictor" and predictor_pays(summary)
    assert objective["predicted_speedup"] >= objective["constant_speedup"] * (1 + PREDICTOR_MARGIN)
    assert policy["gain"] >= PREDICTOR_MARGIN and policy["margin"] == PREDICTOR_MARGIN
    # it speculates deep where the hidden state says the chain will be accepted, and not at all
    # where it will not: both kinds of pick appear on the held-out prompts
    assert {"no-spec", "D4xW1/V5"} <= set(objective["predicted_shapes"])
    # held out, half the iterations accept 4 tokens: the predictor realises nearly
    # 0.5 * 1 + 0.5 * 5 = 3 tokens per iteration, and its estimate agrees with what it realised
    assert objective["predictor_aal_realised"] == pytest.approx(3.0, abs=0.3)
    assert objective["predictor_aal_estimate"] == pytest.approx(objective["predictor_aal_realised"], abs=0.3)
    assert objective["constant_aal_estimate"] == pytest.approx(objective["constant_aal_realised"], abs=0.3)


def test_a_predictor_of_noise_does_not_ship_and_the_summary_says_why(noise):
    summary, directory = noise
    policy = summary["policy"]
    assert policy["shipped"] == "constant" and not predictor_pays(summary)
    assert "best constant bucket" in policy["reason"] and f"{PREDICTOR_MARGIN:.0%}" in policy["reason"]
    saved = yaml.safe_load((directory / "predictor.yaml").read_text())
    assert saved["policy"] == policy  # recorded with the predictor, which the bundle copies


def test_the_rule_needs_the_margin_and_a_better_log_loss():
    assert decide_policy(True, 1.06, 1.0).shipped == "predictor"
    assert decide_policy(True, 1.04, 1.0).shipped == "constant"  # a win below the margin is a tie
    assert decide_policy(False, 2.0, 1.0).shipped == "constant"  # calibrated tails are worse
    assert decide_policy(True, None, 1.0).shipped == "constant"
    # summaries written before the rule existed are judged by it too
    assert not predictor_pays({"held_out": {"useful": True},
                               "objective": {"predicted_speedup": 1.02, "constant_speedup": 1.0}})


def test_inspect_prints_which_policy_ships_and_predicted_vs_realised_aal(learnable, noise, tmp_path, capsys):
    for name, (summary, _) in (("kept", learnable), ("constant", noise)):
        layout = BundleLayout(tmp_path / name)
        layout.calibration.mkdir(parents=True)
        (layout.calibration / PREDICTOR_SUMMARY).write_text(yaml.safe_dump(summary))
        _print_policy(layout)
        out = capsys.readouterr().out
        objective = summary["objective"]
        shipped = "depth predictor ships" if name == "kept" else "best constant bucket ships"
        assert out.startswith(f"policy     {shipped}: ")
        assert f"constant {objective['constant_shape']}: AAL predicted " \
               f"{objective['constant_aal_estimate']:.3f}, realised {objective['constant_aal_realised']:.3f}" in out
        assert f"predictor: AAL predicted {objective['predictor_aal_estimate']:.3f}, " \
               f"realised {objective['predictor_aal_realised']:.3f}" in out
    assert "no depth predictor: too few iterations" in describe_policy(None, "too few iterations")[0]
    old = describe_policy({"held_out": {"useful": True},
                           "objective": {"predicted_speedup": 1.3, "constant_speedup": 1.0}})
    assert "depth predictor ships" in old[0] and "not recorded" in old[1]


# ---------------------------------------------------------------- trees not capped below a chain

def test_grids_with_width_one_calibrate_the_chain_of_every_verify_width():
    assert chain_depths((1, 2, 3, 4, 5, 6), (1, 2, 4), (1, 2, 4, 8, 16)) == (1, 2, 3, 4, 5, 6, 7, 15)
    assert chain_depths((1, 2, 3), (2, 4), (1, 8, 16)) == (1, 2, 3)  # no width 1: no chain to hold
    recipe = parse_recipe({"schema": "yggdrasil-recipe/1", "name": "r", "target": "t", "draft": "d",
                           "dtype": "float32", "device": "cpu", "max_context": 256,
                           "buckets": {"depths": [1, 2, 3], "draft_widths": [1, 2], "verify_widths": [1, 4, 8],
                                       "prefill_chunks": [16]},
                           "calibration": {"prompts": ["humaneval"]}})
    assert recipe.buckets.depths == (1, 2, 3, 7)


def tree_selector() -> Selector:
    """Width 2 is best at small V, but its acceptance saturates with depth while the chain's
    keeps growing: at V = 8 the depth-7 chain accepts more than any tree of the grid."""
    grid = Grid(chain_depths((1, 2, 3), (1, 2), (1, 2, 4, 8)), (1, 2), (1, 2, 4, 8))
    assert grid.depths == (1, 2, 3, 7)
    table = torch.zeros(len(grid.depths), len(grid.widths), len(grid.verifies), dtype=torch.double)
    for i, d in enumerate(grid.depths):
        for k, v in enumerate(grid.verifies):
            table[i, 0, k] = min(d, v - 1) * 0.9  # the chain: 0.9 tokens per drafted token
            table[i, 1, k] = min(d, v - 1, 3) * 0.98  # the tree: surer, but saturating at 3 tokens
    profile = LatencyProfile(draft=((1, 0.01), (2, 0.011)), verify=((1, 1.0), (2, 1.02), (4, 1.05), (8, 1.1)))
    return Selector(grid, profile, table, table.amax((1, 2)).clamp(min=1e-3))


def test_at_each_verify_width_the_chosen_tree_accepts_at_least_the_chain():
    selector = tree_selector()
    grid = selector.grid
    for v in grid.verifies[1:]:
        chosen = selector.best_at_verify(v)
        chain = Bucket(v - 1, 1, v)
        k = grid.verifies.index(v)
        aal = selector.mean_accepted[grid.depths.index(chosen.depth), grid.widths.index(chosen.width), k]
        chain_aal = selector.mean_accepted[grid.depths.index(chain.depth), 0, k]
        assert chosen.verify == v and float(aal) >= float(chain_aal), (v, chosen)
    assert selector.best_at_verify(4).width == 2  # the tree wins where it is not capped
    assert selector.best_at_verify(8) == Bucket(7, 1, 8)  # the chain wins at large V, and can be chosen
    # the run-time objective over the whole grid can choose it too
    assert selector.constant()[0] == Bucket(7, 1, 8)
    assert selector.best_at_verify(1) is None and selector.best_at_verify(16) is None


# ---------------------------------------------------------------- the verdict in the manifest

def test_the_manifest_records_aal_and_step_time_per_bucket_predicted_and_realised(learnable, noise):
    profile = LatencyProfile(draft=((1, 0.04),), verify=((1, 0.9), (5, 1.5)))  # as if measured on graphs
    for summary, directory in (learnable, noise):
        stats = predictor_stats(directory, profile)
        assert stats["policy"] == summary["policy"]
        buckets = stats["policy_buckets"]
        assert set(buckets) == {"constant", "predictor"}
        objective = summary["objective"]
        for policy, rows in buckets.items():
            assert sum(r["picked"] for r in rows.values()) == objective["held_out_records"]
            realised = sum(r["aal_realised"] * r["picked"] for r in rows.values()) / objective["held_out_records"]
            assert realised == pytest.approx(objective[f"{policy}_aal_realised"], abs=1e-3)
            for name, row in rows.items():
                shape = Bucket.parse(name)
                graphs = profile.t_verify(1) if shape.depth == 0 else \
                    shape.depth * profile.t_draft(shape.width) + profile.t_verify(shape.verify)
                assert row["step_ms_graphs"] == pytest.approx(1e3 * graphs, abs=1e-3)
                # every synthetic tree is full, so the realised eager cost is the estimated one
                assert row["step_ms_realised"] == pytest.approx(row["step_ms_predicted"], abs=1e-3)
        assert list(buckets["constant"]) == [objective["constant_shape"]]
    # the learnable predictor's deep picks realise what it promised; it never speculates where
    # nothing is accepted (those iterations take no-spec)
    rows = predictor_stats(learnable[1], profile)["policy_buckets"]["predictor"]
    assert rows["D4xW1/V5"]["aal_realised"] == pytest.approx(5.0, abs=0.3)
    assert rows["no-spec"]["aal_realised"] == 1.0


def test_inspect_prints_the_per_bucket_verdict(learnable, tmp_path, capsys):
    summary, directory = learnable
    layout = BundleLayout(tmp_path / "bundle")
    layout.calibration.mkdir(parents=True)
    (layout.calibration / PREDICTOR_SUMMARY).write_text(yaml.safe_dump(summary))
    stats = predictor_stats(directory, LATENCY)
    _print_policy(layout, stats)
    out = capsys.readouterr().out
    assert "per bucket, held out: AAL predicted/realised" in out
    row = stats["policy_buckets"]["predictor"]["D4xW1/V5"]
    assert (f"predictor {'D4xW1/V5':<12} x{row['picked']:<5} AAL {row['aal_predicted']:.2f}/{row['aal_realised']:.2f}; "
            f"step {row['step_ms_predicted']:.2f}/{row['step_ms_realised']:.2f}/{row['step_ms_graphs']:.2f} ms") in out
    assert describe_policy_buckets(None) == []


@pytest.mark.slow
def test_the_tiny_bundle_manifest_has_the_policy_verdict(tiny_bundle):
    from yggdrasil.graphs.describe import describe
    from yggdrasil.storage.manifest import read_manifest

    _, bundle = tiny_bundle
    manifest, raw = read_manifest(bundle, "rebuild")
    stats = manifest.stats
    if (BundleLayout(bundle).calibration / PREDICTOR_SUMMARY).is_file():
        assert stats["policy"]["shipped"] in ("predictor", "constant") and stats["policy"]["reason"]
        summary = yaml.safe_load((BundleLayout(bundle).calibration / PREDICTOR_SUMMARY).read_text())
        if BundleLayout(bundle).read_selection().get("draft_widths"):  # it speculates: judged on its graphs
            assert "compiled graphs" in summary["judged_on"] and "gain" in summary["policy_eager"]
        for rows in stats["policy_buckets"].values():
            assert all({"aal_predicted", "aal_realised", "step_ms_predicted", "step_ms_realised",
                        "step_ms_graphs"} <= set(r) for r in rows.values())
    else:
        assert stats["predictor"].startswith("not trained")
    assert "policy_buckets" not in describe(manifest, raw)  # printed as inspect's own table instead


def test_the_ablation_interval_of_the_policy_over_the_constant():
    from yggdrasil.bench.suite_ablation import never_slower

    assert never_slower([1.1]) is None
    same = never_slower([1.1, 1.1, 1.1])
    assert same["speedup"] == pytest.approx(1.1) and same["ci95"] == [pytest.approx(1.1), pytest.approx(1.1)]
    noisy = never_slower([0.9, 1.0, 1.1, 1.05, 0.95, 1.0])
    low, high = noisy["ci95"]
    assert low < noisy["speedup"] < high and low < 1.0 < high  # noise: the interval includes 1
    assert never_slower([0.9, 1.0, 1.1, 1.05, 0.95, 1.0]) == noisy  # seeded


def test_never_slower_is_a_one_sided_test_with_a_stated_margin():
    from yggdrasil.bench.suite_ablation import NEVER_SLOWER_MARGIN, never_slower

    assert never_slower([1.0]) is None  # one pair tests nothing
    tied = never_slower([1.0] * 6)
    assert tied["never_slower"] and tied["lower_95_one_sided"] == 1.0 and tied["margin"] == NEVER_SLOWER_MARGIN
    assert never_slower([0.99, 0.991, 0.989, 0.99, 0.99, 0.992])["never_slower"]  # within the margin
    assert not never_slower([0.95, 0.96, 0.94, 0.95, 0.955, 0.95])["never_slower"]  # reliably 5 % slower
    # noisy and a little slower: a two-sided interval reaching 1.0 would have called it never slower
    noisy = never_slower([0.85, 1.13, 0.9, 1.1, 0.93, 1.0])
    assert noisy["speedup"] < 1.0 and not noisy["never_slower"]
    assert "geometric mean" in noisy["statistic"] and noisy["pairs"] == 6
    low, high = noisy["ci95"]
    assert low <= noisy["lower_95_one_sided"] <= noisy["speedup"] <= high  # one bootstrap gives them all


def test_the_bundle_policy_reads_the_predictor_only_where_it_won(learnable, noise):
    """What compile ships: the bundle's policy carries the predictor for learnable acceptance and
    runs the best constant bucket (no hidden-state reads) for noise."""
    from yggdrasil.policy.auto import policy_from_calibration

    kept = policy_from_calibration(learnable[1], None, None, None, DIM, None)
    constant = policy_from_calibration(noise[1], None, None, None, DIM, None)
    assert kept.needs_hidden and not constant.needs_hidden
    assert constant.choose(torch.randn(DIM)) == constant.selector.constant()[0]
    shapes = {str(kept.choose(h)) for h in torch.randn(64, DIM, generator=torch.Generator().manual_seed(1))}
    assert {"no-spec", "D4xW1/V5"} <= shapes  # per iteration, from the hidden state
