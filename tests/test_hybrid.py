"""Hybrid drafting (issue 51): prompt lookup where the context matches, the draft model
elsewhere, verified in the bundle's compiled buckets; greedy output stays the target's."""

from __future__ import annotations

import torch

from yggdrasil.bundle import open_bundle
from yggdrasil.runtime.drafters import ModelDrafter
from yggdrasil.runtime.generate import greedy_tokens
from yggdrasil.runtime.hybrid import HybridDrafter, hybrid_drafter
from yggdrasil.runtime.latency import LatencyProfile
from yggdrasil.runtime.speculative import SpeculativeGenerator
from yggdrasil.runtime.speculator import build_speculator
from yggdrasil.runtime.steps import StepRunner
from yggdrasil.sampling import SamplingParams

FLAT = LatencyProfile(draft=((1, 0.3), (2, 0.3)), verify=((1, 1.0), (4, 1.05), (8, 1.1)))


def _repetitive(seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    phrase = torch.randint(0, 256, (12,), generator=g).tolist()
    return phrase + torch.randint(0, 256, (3,), generator=g).tolist() + phrase[:5]


def test_hybrid_bundle_trees_verify_in_its_buckets_and_stay_lossless(tiny_bundle):
    """On the tiny bundle's graphs (a verify width not compiled would raise): lookup-only and
    model-led iterations both happen, and greedy output equals the bundle's plain output."""
    _, path = tiny_bundle
    generator = open_bundle(path, quiet=True).generator()
    policy = generator.policy
    assert policy is not None
    for seed in range(3):
        ids = _repetitive(seed)
        plain = greedy_tokens(generator.runner, ids, 40)
        drafter = hybrid_drafter(policy, generator.draft_runner)
        drafter.model_speedup = 1.0  # make lookup-only pay whenever it matches: both kinds run
        spec = build_speculator(generator.runner, drafter, policy=policy, plans=generator.plans)
        result = spec.generate(ids, 40, SamplingParams())
        assert result.tokens == plain
    assert drafter.lookup_iterations > 0 and drafter.model_iterations > 0


def test_hybrid_merges_lookup_branches_into_the_model_tree(tmp_path):
    from helpers import save_random_hf_model
    from yggdrasil.models.hf_loader import load_hf_model

    save_random_hf_model(tmp_path / "t", "qwen2", seed=11)
    save_random_hf_model(tmp_path / "d", "qwen2", seed=12, num_hidden_layers=1)
    target, draft = load_hf_model(tmp_path / "t", torch.float32), load_hf_model(tmp_path / "d", torch.float32)
    model = ModelDrafter(StepRunner(draft, 256, 8), 2, 2, (1, 2))
    hybrid = HybridDrafter(model, 4, 1)  # no pricing: the model always drafts, lookup adds branches
    ids = _repetitive(0)
    hybrid.start(ids[:-1])
    tree = hybrid.build(ids)
    hybrid.rewind(ids)
    alone = model.build(ids)
    assert tree.tokens[:alone.size].tolist() == alone.tokens.tolist()  # the model's nodes first, as built
    follow = hybrid.lookup.continuations(ids)[0][0]
    assert follow == ids[5:9]  # the phrase's continuation after its earlier occurrence
    node, tokens, parents = 0, tree.tokens.tolist(), tree.parents.tolist()
    for token in follow:  # ... merged in as a path from the root
        node = next(j for j in range(1, tree.size) if parents[j] == node and tokens[j] == token)
    assert tree.size > alone.size
    for seed in range(3):
        prompt = _repetitive(seed)
        plain = greedy_tokens(StepRunner(target, 256, 8), prompt, 40)
        drafter = HybridDrafter(ModelDrafter(StepRunner(draft, 256, 8), 3, 2, (1, 2)), 6, 1, FLAT, (1, 4, 8), 1.0)
        result = SpeculativeGenerator(StepRunner(target, 256, 8), drafter, [1, 4, 8], FLAT).generate(
            prompt, 40, SamplingParams())
        assert result.tokens == plain


def test_host_time_and_draft_cost_suites_on_the_tiny_bundle(tiny_bundle, tmp_path):
    """The suites behind issue 51's measurements run end to end on a bundle and say what they
    measured (the numbers themselves are bench's, not a test's)."""
    import json

    from yggdrasil.bench.run import run_measurement

    _, path = tiny_bundle
    out = tmp_path / "host.json"
    assert run_measurement("host-time", ["--bundle", str(path), "--prompt", "alpha beta gamma alpha beta",
                                         "--max-new-tokens", "16", "--repeats", "1", "--hybrid",
                                         "--out", str(out)]) == 0
    host = json.loads(out.read_text())
    assert host["drafter"] == "hybrid" and host["total"]["iterations"] > 0
    assert {"draft", "verify", "accept", "runner staging and dispatch"} <= set(host["ms_per_iteration_by_stage"])
    assert run_measurement("draft-cost", ["--bundle", str(path), "--prompts", "1", "--max-new-tokens", "8",
                                          "--rows", "3", "--repeats", "1", "--out", str(tmp_path / "cost")]) == 0
    cost = json.loads((tmp_path / "cost" / "draft-cost.json").read_text())
    assert (tmp_path / "cost" / "draft-cost.png").is_file()
    assert 0.0 <= cost["draft_weights"]["as deployed"]["agreement"] <= 1.0  # an fp32 draft: no 8-bit linears
    assert set(cost["t_ms"]) == {"draft, full head 256", "target (verify)"}  # the tiny draft's head is whole
    assert all(row["outputs_equal_plain"].startswith(str(cost["prompts"]["count"]))
               for row in cost["acceptance"].values())


def test_lookup_hybrid_without_a_draft_model_is_lossless_and_falls_back_to_plain_steps(tmp_path):
    """A lookup bundle's hybrid: lookup where it is priced above plain decoding, else the root
    alone (a plain step), with the objective choosing each tree's verify width."""
    from helpers import save_random_hf_model
    from yggdrasil.models.hf_loader import load_hf_model

    save_random_hf_model(tmp_path, "qwen2", seed=11)
    target = load_hf_model(tmp_path, torch.float32)
    for seed in range(3):
        prompt = _repetitive(seed)
        plain = greedy_tokens(StepRunner(target, 256, 8), prompt, 40)
        drafter = HybridDrafter(None, 7, 1, FLAT, (1, 4, 8), 1.0)
        result = SpeculativeGenerator(StepRunner(target, 256, 8), drafter, [1, 4, 8], FLAT).generate(
            prompt, 40, SamplingParams())
        assert result.tokens == plain
        assert drafter.lookup_iterations > 0 and drafter.model_iterations > 0  # both kinds of step ran
