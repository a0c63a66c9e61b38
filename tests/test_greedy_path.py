"""compile/greedy_path.py: the formats phase's fp32 continuations, every prompt decoded in the
same forward over packed slot ranges, equal plain one-prompt greedy decoding (a divergence is
allowed only at a tie of the model's logits, as compile's check allows, since rows are grouped
differently), for prompts of different lengths and counts, and with prompts longer than a chunk."""

from __future__ import annotations

import pytest
import torch

from helpers import save_random_hf_model

from yggdrasil.compile.check import compare_greedy
from yggdrasil.compile.greedy_path import greedy_paths
from yggdrasil.runtime.generate import greedy_tokens
from yggdrasil.models.hf_loader import load_hf_model
from yggdrasil.runtime.steps import StepRunner


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    directory = tmp_path_factory.mktemp("greedy-path") / "m"
    save_random_hf_model(directory, "qwen2", seed=3)
    return load_hf_model(directory, torch.float32)


def test_packed_continuations_equal_one_prompt_greedy_decoding(model):
    generator = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    prompts = [torch.randint(0, vocab, (length,), generator=generator).tolist() for length in (3, 21, 9, 40, 1)]
    counts = [12, 5, 0, 17, 9]
    got = greedy_paths(model, prompts, counts, chunk=8)
    assert [len(g) for g in got] == counts
    runner = StepRunner(model, 128, 16)
    for prompt, n, continuation in zip(prompts, counts, got):
        if n == 0:
            continue
        expected = greedy_tokens(runner, prompt, n)
        agreement = compare_greedy(model, prompt, expected, continuation)
        assert agreement.ok, (prompt, expected, continuation, agreement)


def test_one_prompt_alone_is_plain_greedy(model):
    prompt = list(range(5, 30))
    got = greedy_paths(model, [prompt], [10], chunk=4)[0]
    expected = greedy_tokens(StepRunner(model, 128, 16), prompt, 10)
    assert compare_greedy(model, prompt, expected, got).ok
