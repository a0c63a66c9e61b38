"""Draft confidence choosing the verify width (issue 25, item 2): calibration records every
drafted node's path probability and whether the target accepted it; predictor/confidence.py fits
calibrated acceptance per depth and judges the policy held out against the best constant bucket."""

from __future__ import annotations

import math

import pytest
import torch
import yaml
from helpers import save_tiny_pair

from yggdrasil.buckets import Grid
from yggdrasil.runtime.drafters import LookupDrafter, ModelDrafter
from yggdrasil.models.hf_loader import load_hf_model
from yggdrasil.runtime.latency import LatencyProfile
from yggdrasil.policy import confidence as runtime_conf
from yggdrasil.predictor import confidence as conf
from yggdrasil.predictor.calibrate import Calibrator
from yggdrasil.policy.calibration import CalibrationRun
from yggdrasil.predictor.calibration_data import save_run
from yggdrasil.policy.calibration import load_run, restrict
from yggdrasil.predictor.depth import split_by_prompt
from yggdrasil.policy.files import PredictorError
from yggdrasil.runtime.steps import StepRunner

CHAIN = Grid((1, 2, 3, 4), (1,), (1, 2, 3, 4, 5))
# verifying costs grow steeply with rows, drafting is cheap: verifying unlikely nodes does not pay
STEEP = LatencyProfile(draft=((1, 0.05e-3),), verify=tuple((v, (1.0 + 0.5 * (v - 1)) * 1e-3) for v in (1, 2, 3, 4, 5)))


def synthetic_chains(learnable: bool, n: int = 800, prompts: int = 40, seed: int = 0) -> CalibrationRun:
    """Width-1 chains of depth 4. learnable: half the iterations are easy (the draft is confident,
    p = 0.9 per step, and the target accepts 95 % of steps) and half hard (p = 0.2, 5 % accepted);
    otherwise every step is accepted with 60 % whatever the draft's (random) confidence."""
    g = torch.Generator().manual_seed(seed)
    easy = torch.rand(n, generator=g) < 0.5
    if learnable:
        step_p = torch.where(easy, 0.9, 0.2)[:, None].expand(n, 4)
        accept_p = torch.where(easy, 0.95, 0.05)
    else:
        step_p = torch.rand(n, 4, generator=g) * 0.9 + 0.05
        accept_p = torch.full((n,), 0.6)
    step_logp = step_p.log() + 0.05 * torch.randn(n, 4, generator=g)  # a little jitter: distinct scores
    score = torch.cat([torch.full((n, 1), math.inf), step_logp.cumsum(1).clamp(max=0.0)], 1).double()
    steps_ok = torch.rand(n, 4, generator=g) < accept_p[:, None]
    accepted_len = steps_ok.int().cumprod(1).sum(1)  # accepted tokens: the first rejection stops the walk
    depth = torch.arange(5, dtype=torch.int8).expand(n, 5)
    on_path = (torch.arange(5)[None, :] >= 1) & (torch.arange(5)[None, :] <= accepted_len[:, None])
    accepted = torch.zeros(n, len(CHAIN.depths), 1, len(CHAIN.verifies), dtype=torch.int8)
    for i, d in enumerate(CHAIN.depths):
        for k, v in enumerate(CHAIN.verifies):
            accepted[:, i, 0, k] = accepted_len.clamp(max=min(d, v - 1))
    tree_size = torch.tensor([1 + d for d in CHAIN.depths], dtype=torch.int16)[None, :, None].expand(n, 4, 1)
    return CalibrationRun(CHAIN, torch.randn(n, 8, generator=g).half(), accepted_len, accepted,
                          torch.arange(n) % prompts, (0,), 0, n, 0, tree_size.contiguous(), None,
                          node_score=score[:, None], node_depth=depth[:, None].contiguous(),
                          node_step=depth[:, None].contiguous(), node_on_path=on_path[:, None])


def test_confidence_policy_beats_constant_where_draft_confidence_predicts_acceptance():
    run = synthetic_chains(learnable=True)
    train, held = split_by_prompt(run.prompt_index)
    report = conf.judge_confidence(run, STEEP, train, held)
    assert report.shipped == "confidence", report.reason
    assert report.confidence.speedup > 1.05 * report.constant.speedup
    assert report.gain >= conf.CONFIDENCE_MARGIN
    # it verifies the whole chain when confident and only the root when not
    assert set(report.confidence.verify_counts) >= {"V5", "V1"}
    assert report.node_log_loss < report.node_constant_log_loss
    # the calibrated estimate of tokens per iteration is close to what was realised
    assert report.confidence.aal_estimate == pytest.approx(report.confidence.aal_realised, abs=0.15)
    assert report.confidence.speedup <= report.oracle.speedup + 1e-9


def test_compile_keeps_the_constant_policy_where_draft_confidence_is_noise():
    run = synthetic_chains(learnable=False)
    train, held = split_by_prompt(run.prompt_index)
    report = conf.judge_confidence(run, STEEP, train, held)
    assert report.shipped == "constant", report.reason
    assert report.gain < conf.CONFIDENCE_MARGIN
    assert abs(report.node_log_loss - report.node_constant_log_loss) < 0.03  # nothing to learn per node
    assert "must win by 5%" in report.reason


def test_isotonic_map_is_monotone_shrunk_and_per_depth():
    logp = torch.tensor([-3.0, -2.0, -2.0, -1.0, -0.5, -0.1] * 20, dtype=torch.float64)
    y = torch.tensor([0, 0, 1, 0, 1, 1] * 20, dtype=torch.float64)
    lower, value = conf.isotonic(logp, y)
    assert list(lower) == sorted(lower) and list(value) == sorted(value)
    assert 0.0 < value[0] and value[-1] < 1.0  # shrunk toward the mean: never exactly 0 or 1
    # depth 2 is never accepted; at depth 1 the best node is, the runner-up of equal probability is not
    depth = torch.tensor([1] * 120 + [2] * 60)
    rank = torch.tensor([0, 1] * 60 + [0] * 60)
    accepted = torch.cat([torch.tensor([1.0, 0.0] * 60), torch.zeros(60)])
    acceptance = conf.fit_acceptance_map(depth, rank, torch.zeros(180, dtype=torch.float64), accepted, 4)
    p = acceptance.probabilities(torch.tensor([1, 1, 2, 3]), torch.tensor([0, 1, 0, 0]),
                                 torch.zeros(4, dtype=torch.float64))
    assert p[0] > 0.9 and p[1] < 0.1 and p[2] < 0.1 and p[3] == p[2]  # depth 3 was not seen: the deepest map
    assert runtime_conf.AcceptanceMap.from_dict(acceptance.as_dict()) == acceptance


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("confidence-pair")
    save_tiny_pair(root)
    return tuple(load_hf_model(root / name, torch.float32) for name in ("tiny-random", "tiny-draft"))


GRID = Grid((1, 2, 3), (1, 2), (1, 2, 4, 8))
PROMPTS = [[7, 100, 3, 54, 200, 9], [5, 6, 7, 5, 6, 7, 5, 6], [40, 41, 42, 43, 40, 41, 42]]


@pytest.mark.parametrize("kind", ["model", "lookup"])
def test_recorded_nodes_reproduce_calibration_hindsight_of_every_bucket(tiny_models, kind):
    """The per-node arrays say exactly what every (D, W, V) bucket accepted: ranking them as
    top_nodes does and counting path nodes among the top V gives Calibrator's own counts."""
    target, draft = tiny_models
    drafter = (ModelDrafter(StepRunner(draft, 256, 8), 3, 2, (1, 2)) if kind == "model" else LookupDrafter(3, 2))
    run = Calibrator(StepRunner(target, 256, 8), drafter, GRID).run(PROMPTS, 16, frozenset(), show_progress=False)
    assert run.node_score is not None and run.node_score.shape[:2] == (run.accepted.shape[0], 2)
    rows = torch.ones(run.accepted.shape[0], dtype=torch.bool)
    for i, d in enumerate(GRID.depths):
        for j, w in enumerate(GRID.widths):
            view = conf.tree_view(run, d, w, rows)
            assert torch.equal(view.size, run.tree_size[:, i, j].long())
            for k, v in enumerate(GRID.verifies):
                got = conf.accepted_at(view, torch.minimum(view.size, torch.tensor(v)))
                assert torch.equal(got, run.accepted[:, i, j, k].long()), (kind, d, w, v)
    if kind == "model":
        assert int(run.accepted.sum()) > 0  # the tiny draft agrees with its target: something to count


def test_node_arrays_round_trip_and_older_calibrations_still_load(tmp_path):
    run = synthetic_chains(learnable=True, n=40, prompts=4)
    save_run(run, tmp_path / "new", {}, STEEP)
    loaded, _, _ = load_run(tmp_path / "new")
    for name in ("node_score", "node_depth", "node_step", "node_on_path"):
        assert torch.equal(getattr(loaded, name), getattr(run, name)), name
    assert torch.equal(restrict(loaded, (1,), (1, 5)).node_on_path, run.node_on_path)
    older = CalibrationRun(*[getattr(run, f) for f in ("grid", "hidden", "accepted_max", "accepted", "prompt_index",
                                                       "rank_hits", "rank_trials", "generated_tokens",
                                                       "skipped_prompts", "tree_size")])
    save_run(older, tmp_path / "old", {}, STEEP)
    loaded_old, _, _ = load_run(tmp_path / "old")
    assert loaded_old.node_score is None
    with pytest.raises(PredictorError, match="re-run calibration"):
        conf.tree_view(loaded_old, 2, 1)


def test_compile_records_the_confidence_verdict_with_the_calibration(tiny_bundle):
    """compile judges the confidence policy on its calibration (confidence.yaml in the bundle's
    calibration directory), against the same best constant bucket the predictor's report names."""
    _, bundle = tiny_bundle
    body = yaml.safe_load((bundle / "calibration" / "confidence.yaml").read_text())
    assert body["schema"] == runtime_conf.SCHEMA
    report = body["report"]
    predictor = yaml.safe_load((bundle / "calibration" / "predictor.yaml").read_text())
    assert report["constant_shape"] == predictor["objective"]["constant_shape"]
    assert report["shipped"] in ("confidence", "constant")
    assert report["confidence"]["speedup"] <= report["oracle"]["speedup"] + 1e-9
    assert (report["shipped"] == "confidence") == (report["gain"] >= conf.CONFIDENCE_MARGIN)
    acceptance = runtime_conf.AcceptanceMap.from_dict(body["policy"]["acceptance"])
    assert all(list(v) == sorted(v) and 0.0 < min(v) and max(v) < 1.0 for v in acceptance.value)
