"""A trimmed draft vocabulary (issue 51): the draft proposes only from K tokens, the target
verifies over all of them, so speculative greedy output stays the target's own."""

from __future__ import annotations

import pytest
import torch

from helpers import save_random_hf_model
from yggdrasil.kernels import pack
from yggdrasil.models.hf_loader import load_hf_model
from yggdrasil.models.quant import apply_weight_format
from yggdrasil.models.quant_q4 import Q4Linear, Q8Linear, kernels_available
from yggdrasil.models.vocab import (TrimmedHead, head_token_ids, merge_ranks, ranked_vocabulary, trim_head,
                                    trim_linear, untrim_head)
from yggdrasil.runtime.drafters import ModelDrafter
from yggdrasil.runtime.generate import greedy_tokens
from yggdrasil.runtime.speculative import SpeculativeGenerator
from yggdrasil.runtime.steps import StepRunner
from yggdrasil.sampling import SamplingParams


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    target_dir, draft_dir = tmp_path_factory.mktemp("target"), tmp_path_factory.mktemp("draft")
    save_random_hf_model(target_dir, "qwen2", seed=11)
    save_random_hf_model(draft_dir, "qwen2", seed=12, num_hidden_layers=1)
    return load_hf_model(target_dir, torch.float32), load_hf_model(draft_dir, torch.float32)


def _subset(k: int, seed: int = 0) -> torch.Tensor:
    return torch.randperm(256, generator=torch.Generator().manual_seed(seed))[:k].sort().values


@pytest.mark.parametrize("fmt", ["fp32", "int8", "bf16", "q4"])
def test_trimmed_head_logits_are_the_full_heads_columns(tmp_path, fmt):
    """Each kept column is bitwise the full head's logit for that token, in every format."""
    if fmt == "q4" and kernels_available():
        pytest.skip(f"q4 kernels unavailable: {kernels_available()}")
    save_random_hf_model(tmp_path, "qwen2", seed=3, num_hidden_layers=1)
    model = load_hf_model(tmp_path, torch.float32)
    apply_weight_format(model, fmt)
    ids = _subset(48)
    full = model.output
    x = torch.randn(3, 5, model.config.dim)
    expected = full(x)[..., ids]
    trim_head(model, ids)
    assert isinstance(model.output, TrimmedHead) and torch.equal(head_token_ids(model), ids)
    assert torch.equal(model.output(x), expected)
    untrim_head(model)
    assert model.output is full
    assert "_full_head" not in dict(model.named_modules())  # the kept full head is never saved


@pytest.mark.parametrize("bits", [4, 8])
def test_packed_trim_is_a_row_gather_of_the_blocks(bits):
    """The kept rows' blocks as stored, never requantized."""
    weight, ids = torch.randn(64, 64), torch.tensor([0, 3, 17, 18, 40, 41, 42, 43, 44, 50, 51, 52, 60, 61, 62, 63])
    module = Q8Linear(pack.quantize_q8(weight), None) if bits == 8 else Q4Linear(pack.quantize_q4(weight), None)
    trimmed = trim_linear(module, ids)
    assert trimmed.out_features == 16 and type(trimmed) is type(module)
    assert torch.equal(trimmed.dequantized_weight(), module.dequantized_weight()[ids])


@pytest.mark.parametrize("k, depth, width", [(16, 4, 1), (32, 3, 2), (64, 4, 3)])
def test_trimmed_draft_greedy_is_lossless(tiny_pair, k, depth, width):
    """Speculative greedy output equals plain greedy output with a tiny K, and tokens outside the
    subset are still produced whenever the target chooses them."""
    target, draft = tiny_pair
    ids = _subset(k, seed=k)
    draft_model = draft
    trim_head(draft_model, ids)
    try:
        outside = 0
        for seed in range(3):
            prompt = torch.randint(0, 256, (6 + 5 * seed,), generator=torch.Generator().manual_seed(seed)).tolist()
            expected = greedy_tokens(StepRunner(target, 256, 8), prompt, 48)
            drafter = ModelDrafter(StepRunner(draft_model, 256, 8), depth, width)
            result = SpeculativeGenerator(StepRunner(target, 256, 8), drafter, [1 + depth * width]).generate(
                prompt, 48, SamplingParams())
            assert result.tokens == expected
            outside += sum(t not in set(ids.tolist()) for t in result.tokens)
        assert outside > 0  # most of this random target's tokens lie outside a 16-64 token subset
    finally:
        untrim_head(draft_model)


def test_trimmed_draft_proposes_only_kept_tokens(tiny_pair):
    target, draft = tiny_pair
    ids = _subset(32, seed=5)
    trim_head(draft, ids)
    try:
        drafter = ModelDrafter(StepRunner(draft, 256, 8), 3, 4)
        drafter.start([1, 2, 3])
        tree = drafter.build([1, 2, 3, 4])
        assert set(tree.tokens[1:].tolist()) <= set(ids.tolist())
    finally:
        untrim_head(draft)


def test_ranked_vocabulary_puts_required_then_counted_then_merges_first():
    counts = torch.tensor([0, 5, 0, 9, 0, 0])
    ranks = torch.tensor([4, 3, 2, 1, 0, 5])
    order = ranked_vocabulary(counts, ranks, {5}).tolist()
    assert order == [5, 3, 1, 4, 2, 0]


def test_merge_ranks_of_a_bpe_tokenizer():
    from tokenizers import Tokenizer, models

    from yggdrasil.models.tokenizer import Tokenizer as Ours

    vocab = {"a": 0, "b": 1, "ab": 2, "abb": 3, "<x>": 4}
    inner = Tokenizer(models.BPE(vocab=vocab, merges=[("a", "b"), ("ab", "b")]))
    ranks = merge_ranks(Ours(inner, bos_token=None, eos_token=None, stop_ids=(), chat_template=None), 6)
    assert ranks.tolist() == [0, 0, 1, 2, 7, 7]


def _trimmed_recipe(root, kept: str) -> "Path":
    import yaml
    from helpers import write_tiny_recipe_dir

    raw = yaml.safe_load(write_tiny_recipe_dir(root).read_text())
    raw.update(draft_vocab=kept, selection="objective")
    raw["buckets"].update(depths=[1, 2, 3], draft_widths=[1, 2], verify_widths=[1, 4])
    raw["calibration"].update(num_prompts=6, max_new_tokens=16)
    path = root / "tiny-trimmed.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_compile_chooses_records_and_deploys_a_trimmed_vocabulary(tmp_path, monkeypatch):
    """compile's phases up to the choice: K from the full head's calibration, calibrated again
    with the trimmed head in a work cache of its own, the choice reproducible from the work
    cache; the deployed weights carry the trimmed head, and speculative greedy output over them
    equals plain greedy output."""
    from helpers import tiny_profile

    import yggdrasil.runtime.latency as latency
    from yggdrasil.compile.build import PHASE_STEPS, Build, PhaseClock, run_phases
    from yggdrasil.compile.context import load_context
    from yggdrasil.compile.draft_vocab import TIMES_FILE, replay
    from yggdrasil.compile.recipe import load_recipe
    from yggdrasil.graphs.describe import describe_draft_vocab
    from yggdrasil.runtime.deployed import DeployedWeights, save_deployed

    monkeypatch.setattr(latency, "measure_profile", lambda *args, **kwargs: tiny_profile())
    log: list[str] = []
    ctx = load_context(load_recipe(_trimmed_recipe(tmp_path, "64")), tmp_path / "bundle", log.append)
    main = ctx.work.root
    build = run_phases(Build(ctx, False), PHASE_STEPS[:3], PhaseClock(0.0))
    choice = build.draft_vocab
    assert choice.kept == 64 and choice.vocab_size == 256 and "named by the recipe" in choice.reason
    assert {c.kept for c in choice.candidates} == {64, 256}
    assert any("calibrating again" in line for line in log), log
    assert build.ctx.work.root.parent == main and build.calibration.parent == build.ctx.work.root
    assert head_token_ids(build.ctx.draft.model).numel() == 64
    shown = describe_draft_vocab(choice.as_dict())
    assert shown[0].startswith("draft vocab 64 of 256 tokens") and len(shown) == 3, shown

    # the choice again from the main cache's full-head calibration and recorded step times
    again, candidates = replay(main / "calibration", main / TIMES_FILE, ctx.draft.tokenizer, 256)
    assert candidates == choice.candidates
    assert build_again(ctx, main).draft_vocab.as_dict() == choice.as_dict()  # and from a fresh compile

    save_deployed(tmp_path / "weights", {"target": build.ctx.target, "draft": build.ctx.draft})
    weights = DeployedWeights(tmp_path / "weights")
    target, draft = weights.load("target", "cpu").model, weights.load("draft", "cpu").model
    assert torch.equal(head_token_ids(draft), head_token_ids(build.ctx.draft.model))
    for text in ("alpha beta", "tree leaf root graph", "zz qq"):
        ids = ctx.target.tokenizer.encode(text)
        plain = greedy_tokens(StepRunner(target, 256, 16), ids, 32)
        drafter = ModelDrafter(StepRunner(draft, 256, 16), 3, 2, (1, 2))
        spec = SpeculativeGenerator(StepRunner(target, 256, 16), drafter, [1, 4]).generate(ids, 32, SamplingParams())
        assert spec.tokens == plain


def build_again(ctx, main):
    """The first phases again in a new context over the same work cache (all of it cached)."""
    from yggdrasil.compile.build import PHASE_STEPS, Build, PhaseClock, run_phases
    from yggdrasil.compile.context import load_context

    fresh = load_context(ctx.recipe, ctx.out, lambda line: None)
    assert fresh.work.root == main
    return run_phases(Build(fresh, False), PHASE_STEPS[:3], PhaseClock(0.0))


@pytest.mark.parametrize("value, draft, message", [(100, "tiny-draft", "multiple of 16"),
                                                   ("half", "tiny-draft", "full, auto"),
                                                   ("auto", "lookup", "prompt lookup")])
def test_a_bad_draft_vocab_is_one_clear_error(tmp_path, value, draft, message):
    import yaml
    from helpers import TINY_RECIPE

    from yggdrasil.compile.recipe import RecipeError, load_recipe

    raw = yaml.safe_load(TINY_RECIPE.read_text())
    raw.update(draft_vocab=value, draft=draft)
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(RecipeError, match=message):
        load_recipe(path)


def test_trimmed_run_cuts_each_accepted_length_at_the_first_token_outside_the_subset():
    from yggdrasil.buckets import Grid
    from yggdrasil.compile.draft_vocab import trimmed_run
    from yggdrasil.policy.calibration import CalibrationRun

    grid = Grid((1, 2, 3), (1,), (1, 4))
    accepted = torch.tensor([3, 3, 1, 0], dtype=torch.int8)[:, None, None, None].expand(4, 3, 1, 2).clone()
    follows = torch.tensor([[5, 6, 7], [5, 9, 7], [9, 5, 5], [5, 5, 5]], dtype=torch.int32)
    run = CalibrationRun(grid, torch.zeros(4, 2), torch.tensor([3, 3, 1, 0]), accepted, torch.zeros(4, dtype=torch.long),
                         (0,), 0, 12, 0, continuation=follows,
                         node_depth=torch.tensor([[[0, 1, 2, 3]]] * 4, dtype=torch.int8),
                         node_on_path=torch.ones(4, 1, 4, dtype=torch.bool))
    keep = torch.zeros(16, dtype=torch.bool)
    keep[[5, 6, 7]] = True  # 9 is outside
    cut = trimmed_run(run, keep)
    assert cut.accepted_max.tolist() == [3, 1, 0, 0]
    assert cut.accepted[:, 0, 0, 0].tolist() == [3, 1, 0, 0]
    assert cut.node_on_path[1, 0].tolist() == [True, True, False, False]  # depths 0, 1 kept


@pytest.mark.parametrize("kept_tokens, expected", [([5, 6, 7, 9], 16), ([1, 2], None)])
def test_the_objective_keeps_the_head_with_the_lowest_expected_time_per_token(kept_tokens, expected):
    """A cheap head that loses nothing wins; one whose subset misses the target's tokens loses
    its acceptance, and the full head wins."""
    from yggdrasil.buckets import Grid
    from yggdrasil.compile.draft_vocab import choose
    from yggdrasil.policy.calibration import CalibrationRun
    from yggdrasil.runtime.latency import LatencyProfile

    grid = Grid((1, 2, 3), (1,), (1, 4))
    accepted = torch.tensor([[0, 0], [0, 1], [0, 2]], dtype=torch.int8)[None, :, None, :].expand(4, 3, 1, 2).clone()
    follows = torch.tensor([[5, 6, 7]] * 4, dtype=torch.int32)
    run = CalibrationRun(grid, torch.zeros(4, 2), torch.tensor([3, 3, 3, 3]), accepted,
                         torch.zeros(4, dtype=torch.long), (0,), 0, 12, 0, continuation=follows)
    keep = torch.zeros(256, dtype=torch.bool)
    keep[kept_tokens] = True
    verify = LatencyProfile(draft=((1, 0.0),), verify=((1, 0.020), (4, 0.022)))
    kept, candidates = choose(run, verify, {16: {1: 0.001}, 256: {1: 0.004}}, {16: keep}, 256)
    assert kept == expected
    assert [c.kept for c in candidates] == [16, 256]
