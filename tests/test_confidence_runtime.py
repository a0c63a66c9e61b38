"""Draft confidence at run time (issue 25): a bundle whose calibration shipped the confidence
policy drafts its one (D, W) tree and lets the nodes' calibrated acceptance pick V through the
runtime's own verify-width objective (speculative.choose_verify_width); greedy output stays the
target's own."""

from __future__ import annotations

import math

import pytest
import torch
import yaml
from test_confidence_policy import STEEP, synthetic_chains, tiny_models  # noqa: F401 (a fixture)

from yggdrasil.policy.auto import policy_from_calibration
from yggdrasil.compile.select import select_buckets
from yggdrasil.runtime.drafters import ModelDrafter
from yggdrasil.runtime.generate import greedy_tokens
from yggdrasil.runtime.latency import LatencyProfile
from yggdrasil.policy import confidence as runtime_conf
from yggdrasil.predictor import confidence as conf
from yggdrasil.predictor.calibration_data import save_run
from yggdrasil.buckets import NO_SPEC
from yggdrasil.policy.auto import AutoPolicy, selector_for
from yggdrasil.policy.depth_model import DepthMLP
from yggdrasil.runtime.policy import BucketPolicy
from yggdrasil.sampling import SamplingParams
from yggdrasil.runtime.speculative import SpeculativeGenerator, choose_verify_width
from yggdrasil.runtime.steps import StepRunner
from yggdrasil.runtime.tree import TokenTree

# a chain of four confident drafts (path probabilities 0.9, 0.81, 0.73, 0.66)
CHAIN_TREE = TokenTree.from_lists([5, 6, 7, 8, 9], [-1, 0, 1, 2, 3], [0.0] + [4 * math.log(0.9) * d / 4 for d in (1, 2, 3, 4)])
LINEAR = LatencyProfile(draft=((1, 0.01e-3),), verify=tuple((v, (1.0 + 0.3 * (v - 1)) * 1e-3) for v in (1, 2, 3, 4, 5)))


def test_calibrated_acceptance_replaces_the_draft_probabilities_in_the_verify_objective():
    widths = (1, 2, 3, 4, 5)
    # the draft's own probabilities make the whole chain worth verifying
    assert choose_verify_width(CHAIN_TREE, widths, LINEAR, 0.0) == 5
    # calibration says this draft is almost never right: verify the root alone
    doubtful = torch.tensor([1.0, 0.05, 0.02, 0.01, 0.01], dtype=torch.float64)
    assert choose_verify_width(CHAIN_TREE, widths, LINEAR, 0.0, doubtful) == 1
    # right at depth 1 only: keep the root and one node
    first_only = torch.tensor([1.0, 0.95, 0.05, 0.02, 0.01], dtype=torch.float64)
    assert choose_verify_width(CHAIN_TREE, widths, LINEAR, 0.0, first_only) == 2


def _map_by_depth_and_rank(values: dict[tuple[int, int], float], depths: int) -> runtime_conf.AcceptanceMap:
    """One constant probability per (depth, rank class): easy to read back."""
    lower, value = [], []
    for d in range(1, depths + 1):
        for r in range(runtime_conf.RANKS):
            lower.append((-math.inf,))
            value.append((values.get((d, r), 0.5),))
    return runtime_conf.AcceptanceMap(tuple(lower), tuple(value))


def test_node_acceptance_ranks_each_depth_in_pruning_order():
    # root; depth 1: nodes 1 (p 0.3) and 2 (p 0.6); depth 2: node 3 under 2 (0.5), node 4 under 1 (0.2)
    logp = [0.0, math.log(0.3), math.log(0.6), math.log(0.5), math.log(0.2)]
    tree = TokenTree.from_lists([1, 2, 3, 4, 5], [-1, 0, 0, 2, 1], logp)
    values = {(1, 0): 0.9, (1, 1): 0.4, (2, 0): 0.7, (2, 1): 0.1}
    policy = runtime_conf.DraftConfidence(2, 2, _map_by_depth_and_rank(values, 2))
    got = policy.node_acceptance(tree).tolist()
    # node 2 is the best at depth 1 (rank 0), node 1 the runner-up; node 3 leads depth 2
    assert got == [1.0, 0.4, 0.9, 0.7, 0.1]


class _RandomConfidence:
    """A DraftConfidence stand-in whose acceptance is random per tree."""

    def __init__(self, depth: int, width: int, generator: torch.Generator) -> None:
        self.depth, self.width, self.generator = depth, width, generator

    def node_acceptance(self, tree) -> torch.Tensor:
        p = torch.rand(tree.size, generator=self.generator, dtype=torch.float64) ** 0.3
        p[0] = 1.0
        return p


def test_confidence_policy_is_greedy_lossless_as_v_changes(tiny_models):
    target, draft = tiny_models
    run = synthetic_chains(learnable=True, n=200, prompts=10)
    grid_policy = AutoPolicy(selector_for(run, torch.ones(200, dtype=torch.bool), LINEAR), None)
    # calibrated probabilities that differ tree by tree (the map itself is tested above): V changes
    confidence = _RandomConfidence(4, 1, torch.Generator().manual_seed(0))
    policy = AutoPolicy(grid_policy.selector, None, confidence)
    chosen: set[str] = set()
    for seed in range(3):
        prompt = torch.randint(0, 256, (6 + 4 * seed,), generator=torch.Generator().manual_seed(seed)).tolist()
        expected = greedy_tokens(StepRunner(target, 256, 8), prompt, 40)
        gen = SpeculativeGenerator(StepRunner(target, 256, 8), ModelDrafter(StepRunner(draft, 256, 8), 4, 1, (1,)),
                                   policy=policy)
        result = gen.generate(prompt, 40, SamplingParams())
        assert result.tokens == expected
        assert sum(result.spec.verifies.values()) == sum(result.spec.shapes.values())
        chosen |= set(result.spec.verifies)
    assert len(chosen) >= 2, chosen  # the calibrated confidence really changes V


def test_every_kind_of_auto_policy_is_the_bucket_policy_the_runtime_types():
    """Constant, depth predictor and draft confidence: one run-time interface (BucketPolicy)."""
    run = synthetic_chains(learnable=True, n=200, prompts=10)
    constant = AutoPolicy(selector_for(run, torch.ones(200, dtype=torch.bool), LINEAR), None)
    predictor = AutoPolicy(constant.selector, DepthMLP(8, constant.grid.max_depth).eval())
    confidence = AutoPolicy(constant.selector, None, _RandomConfidence(4, 1, torch.Generator().manual_seed(0)))
    for policy in (constant, predictor, confidence):
        assert isinstance(policy, BucketPolicy)
        shape = policy.select(policy.predict(torch.zeros(8) if policy.needs_hidden else None))
        grid = policy.grid
        assert shape == NO_SPEC or (shape.depth in grid.depths and shape.width in grid.widths
                                    and shape.verify in grid.verifies), shape
    assert not isinstance(object(), BucketPolicy)


def _calibration_with_verdict(tmp_path, learnable: bool):
    run = synthetic_chains(learnable=learnable)
    save_run(run, tmp_path, {}, STEEP)
    body = conf.record_confidence(tmp_path)
    return run, body


def test_a_shipped_confidence_policy_is_what_the_bundle_runs_and_compiles(tmp_path):
    run, body = _calibration_with_verdict(tmp_path, learnable=True)
    assert body["report"]["shipped"] == "confidence"
    policy = policy_from_calibration(tmp_path, None, None, None, 8, None)
    assert policy.confidence is not None and policy.model is None
    assert (policy.confidence.depth, policy.confidence.width) == (body["policy"]["depth"], body["policy"]["width"])
    # bucket selection keeps its draft width and every verify width it may pick
    selection = select_buckets(policy, run.hidden[:50], run.grid)
    assert selection.widths == (policy.confidence.width,) and selection.verifies == run.grid.verifies
    # a bundle that did not compile its draft width keeps the constant policy
    assert runtime_conf.load_confidence(tmp_path, widths=(2, 4))[0] is None
    # inspect says it ships, and predicted vs realised AAL
    lines = conf.describe_confidence(runtime_conf.load_confidence(tmp_path)[1])
    assert "ships" in lines[0] and "realised" in lines[1]


def test_a_confidence_policy_that_lost_held_out_is_not_run(tmp_path):
    _, body = _calibration_with_verdict(tmp_path, learnable=False)
    assert body["report"]["shipped"] == "constant"
    assert policy_from_calibration(tmp_path, None, None, None, 8, None).confidence is None
    assert "not shipped" in conf.describe_confidence(runtime_conf.load_confidence(tmp_path)[1])[0]


def test_a_foreign_confidence_file_is_refused_with_what_to_do(tmp_path):
    _calibration_with_verdict(tmp_path, learnable=True)
    (tmp_path / "confidence.yaml").write_text(yaml.safe_dump({"schema": "something-else/9"}))
    with pytest.raises(conf.PredictorError, match="re-run calibration"):
        runtime_conf.load_confidence(tmp_path)


def test_when_both_policies_beat_the_constant_one_choice_is_run_inspected_and_recorded(tmp_path):
    """The depth predictor and draft confidence each won held out: the larger gain ships, and the
    bundle's policy, inspect's lines and the manifest's stats all name that one (shipped_policy)."""
    from test_speculation_quality import DIM, calibrated

    from yggdrasil.compile.write import predictor_stats
    from yggdrasil.predictor.pipeline import describe_policy, read_summary
    from yggdrasil.policy.auto import predictor_decision, shipped_policy

    (tmp_path / "confidence").mkdir()
    _, body = _calibration_with_verdict(tmp_path / "confidence", learnable=True)
    _, directory = calibrated(tmp_path, learnable=True)
    summary = read_summary(directory)
    predictor_gain = predictor_decision(summary).gain
    assert predictor_gain >= 0.05 and body["report"]["shipped"] == "confidence"
    for confidence_gain, expected in ((predictor_gain + 0.1, "confidence"), (predictor_gain - 0.01, "predictor")):
        body["report"]["gain"] = confidence_gain
        (directory / "confidence.yaml").write_text(yaml.safe_dump(body, sort_keys=False))
        assert shipped_policy(summary, body["report"]) == expected
        policy = policy_from_calibration(directory, None, None, None, DIM, None)
        assert (policy.confidence is not None, policy.model is not None) == (expected == "confidence",
                                                                               expected == "predictor")
        stats = predictor_stats(directory)
        assert stats["policy_shipped"] == expected
        assert stats["confidence"]["shipped"] == (expected == "confidence") and stats["confidence"]["beat_constant"]
        assert (stats["predictor"] == "used") == (expected == "predictor")
        firsts = [describe_policy(summary, None, expected)[0], conf.describe_confidence(body["report"], expected)[0]]
        ships = [line for line in firsts if "does not ship" not in line and " ships" in line]
        assert len(ships) == 1 and ("depth predictor" in ships[0]) == (expected == "predictor"), firsts
    # neither: the constant
    assert shipped_policy(None, {"shipped": "constant", "gain": 0.5}) == "constant"


def test_compile_logs_the_confidence_verdict_that_ships(tmp_path):
    """compile's log line about draft confidence follows shipped_policy: a depth predictor that
    gained more held out keeps it from shipping even though it beat the constant."""
    from types import SimpleNamespace

    from yggdrasil.compile.calibrate import _judge_confidence

    _calibration_with_verdict(tmp_path, learnable=True)
    lines: list[str] = []
    ctx = SimpleNamespace(log=lines.append)
    _judge_confidence(ctx, tmp_path, None)
    bigger = {"held_out": {"useful": True}, "objective": {"predicted_speedup": 10.0, "constant_speedup": 1.0}}
    _judge_confidence(ctx, tmp_path, bigger)
    assert "; ships:" in lines[0]
    assert "beat the constant but does not ship: the depth predictor gained more" in lines[1]
