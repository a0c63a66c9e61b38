"""Executed stage plans (issue 6): every plan gives exactly the sequential plan's tokens, and
the ahead-of-time moves leave the draft in exactly the state the sequential plan does."""

from __future__ import annotations

import json

import pytest
import torch
import yaml

from helpers import save_random_hf_model

from yggdrasil.runtime.drafters import LookupDrafter, ModelDrafter
from yggdrasil.errors import InvalidRequestError, YggdrasilError
from yggdrasil.runtime.generate import greedy_tokens
from yggdrasil.models.hf_loader import load_hf_model
from yggdrasil.runtime.latency import LatencyProfile
from yggdrasil.sampling import SamplingParams
from yggdrasil.runtime.speculative import SpeculativeGenerator
from yggdrasil.storage.layout import STAGE_PLANS as PLANS_FILE
from yggdrasil.runtime.stage_plan import SEQUENTIAL, PlanTable, StagePlan, all_plans
from yggdrasil.runtime.steps import StepRunner
from yggdrasil.trace import Tracer, tracing

PROMPT = list(range(3, 20))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A tiny random target, an unrelated random draft (rejections) and a draft that is the
    target itself (acceptance all the way down the tree)."""
    root = tmp_path_factory.mktemp("plans")
    save_random_hf_model(root / "target", "qwen2", seed=11)
    save_random_hf_model(root / "draft", "qwen2", seed=12, num_hidden_layers=1)
    target = load_hf_model(root / "target", torch.float32)
    return {"target": target, "random": load_hf_model(root / "draft", torch.float32),
            "self": target.truncated(target.config.n_layers)}


def _run(models, draft: str, plan, sampling: SamplingParams, new_tokens: int = 48, context: int = 256):
    drafter = ModelDrafter(StepRunner(models[draft], context, 8), 3, 2)
    # a fixed profile: the verify width each iteration picks must not depend on timing noise
    generator = SpeculativeGenerator(StepRunner(models["target"], context, 8), drafter, [1, 3, 5],
                                     LatencyProfile(), plans=plan)
    return generator.generate(PROMPT, new_tokens, sampling)


@pytest.mark.parametrize("draft", ["random", "self"])
@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=0.8, top_p=0.95, seed=3)],
                         ids=["greedy", "seeded-sampling"])
def test_every_plan_equals_the_sequential_plan(models, draft, sampling):
    sequential = _run(models, draft, SEQUENTIAL, sampling)
    if sampling.greedy:
        assert sequential.tokens == greedy_tokens(StepRunner(models["target"], 256, 8), PROMPT, 48)
    if draft == "self" and sampling.greedy:
        assert sequential.spec.aal > 2.5  # the walks do reach the last level, where the moves act
    for plan in all_plans():
        result = _run(models, draft, plan, sampling)
        assert result.tokens == sequential.tokens, plan
        # the same trees were drafted and accepted: AOT work left the draft cache exactly right
        assert result.spec.accepted_at_depth == sequential.spec.accepted_at_depth, plan
        assert result.spec.iterations == sequential.spec.iterations, plan


def test_plans_per_bucket_and_the_context_edge(models):
    """A plan table keyed by bucket name is followed; with the ahead-of-time head the
    candidates' K/V slots fit before the context ends (the generation stops for context)."""
    table = PlanTable({"D3xW2/V5": StagePlan(aot_head=True), "D3xW2/V3": StagePlan(aot_tail=True)})
    context = 96
    expected = _run(models, "self", SEQUENTIAL, SamplingParams(), new_tokens=200, context=context)
    result = _run(models, "self", table, SamplingParams(), new_tokens=200, context=context)
    assert result.stop_reason == expected.stop_reason == "context"
    assert result.tokens[:len(expected.tokens)] == expected.tokens[:len(result.tokens)]
    assert len(result.tokens) >= len(expected.tokens) - 8  # only the candidates' slots are reserved


def test_ahead_of_time_stages_show_in_the_trace(models):
    drafter = ModelDrafter(StepRunner(models["random"], 256, 8), 3, 2)
    generator = SpeculativeGenerator(StepRunner(models["target"], 256, 8), drafter, [5], LatencyProfile(),
                                     plans=StagePlan(aot_tail=True, aot_head=True, accept_on_device=True))
    tracer = Tracer()
    with tracing(tracer, generator.target, generator):
        result = generator.generate(PROMPT, 16, SamplingParams())
    events = json.loads(json.dumps(tracer.to_json()))["traceEvents"]
    names = [e["name"] for e in events if e["ph"] == "X" and e.get("cat") == "iteration"]
    assert names.count("tail") == names.count("ahead") == result.spec.iterations
    # after the first iteration the head was drafted ahead: no head forward runs any more
    heads = [e for e in events if e["ph"] == "X" and e["name"].startswith("draft_head")]
    assert len(heads) == 1
    assert any(e["name"].startswith("draft_ahead_w5") for e in events)


def test_plans_that_draft_ahead_need_a_draft_model(models):
    target = StepRunner(models["target"], 256, 8)
    with pytest.raises(InvalidRequestError, match="need a draft model"):
        SpeculativeGenerator(target, LookupDrafter(3, 2), [4], LatencyProfile(), plans=StagePlan(aot_tail=True))
    # the device walk alone needs no draft model
    prompt = [5, 6, 7, 5, 6, 7, 5, 6]
    lookup = SpeculativeGenerator(target, LookupDrafter(3, 2), [4], LatencyProfile(),
                                  plans=StagePlan(accept_on_device=True))
    assert lookup.generate(prompt, 20, SamplingParams()).tokens == greedy_tokens(
        StepRunner(models["target"], 256, 8), prompt, 20)


def test_plan_names_and_the_bundle_table(tmp_path):
    assert len(all_plans()) == 14 and len(all_plans(streams=1)) == 8
    assert not any(p.side_stream for p in all_plans(streams=1))
    for plan in all_plans():
        assert StagePlan.parse(str(plan)) == plan
    with pytest.raises(ValueError, match="unknown stage plan part"):
        StagePlan.parse("aot-tail+warp-drive")
    assert PlanTable.load(tmp_path).for_bucket("D3xW2/V4") == SEQUENTIAL  # an older bundle
    (tmp_path / PLANS_FILE).write_text(yaml.safe_dump({"buckets": {"D3xW2/V4": {"plan": "aot-tail+device-accept"}}}))
    table = PlanTable.load(tmp_path)
    assert table.for_bucket("D3xW2/V4") == StagePlan(aot_tail=True, accept_on_device=True)
    assert table.for_bucket("D1xW1/V2") == SEQUENTIAL
    (tmp_path / PLANS_FILE).write_text(yaml.safe_dump({"buckets": {"D3xW2/V4": {"plan": "fast"}}}))
    with pytest.raises(YggdrasilError, match="corrupt.*recompile"):
        PlanTable.load(tmp_path)


@pytest.mark.gpu
def test_every_plan_equals_sequential_on_cuda_with_a_side_stream(tmp_path):
    """On CUDA the side-stream plans really run the ahead-of-time drafts on a second stream;
    events must order them so that nothing changes."""
    save_random_hf_model(tmp_path / "target", "qwen2", seed=11)
    target = load_hf_model(tmp_path / "target", torch.float32, device="cuda")
    models = {"target": target, "self": target.truncated(target.config.n_layers)}
    for sampling in (SamplingParams(), SamplingParams(temperature=0.8, seed=3)):
        sequential = _run(models, "self", SEQUENTIAL, sampling)
        for plan in all_plans(streams=2):
            result = _run(models, "self", plan, sampling)
            assert result.tokens == sequential.tokens, plan
            assert result.spec.accepted_at_depth == sequential.spec.accepted_at_depth, plan
