"""Autoregressive generation: sampling distribution, seeds, stop tokens, context limit, streaming."""

from __future__ import annotations

import pytest
import torch

from helpers import hf_greedy, save_random_hf_model
from yggdrasil.errors import InvalidRequestError
from yggdrasil.runtime.generate import generate, greedy_tokens
from yggdrasil.models.hf_loader import load_hf_model
from yggdrasil.sampling import SamplingParams, sample, target_probs
from yggdrasil.runtime.steps import StepRunner
from yggdrasil.models.tokenizer import TextStream, tokenizer_from_hf_dir


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-qwen")
    reference = save_random_hf_model(directory, "qwen2", seed=8)
    return directory, reference, load_hf_model(directory, torch.float32)


def test_greedy_matches_transformers_generate(tiny):
    _, reference, model = tiny
    prompt = [3, 17, 42, 99, 7]
    runner = StepRunner(model, max_context=128, chunk_size=4)
    assert greedy_tokens(runner, prompt, 40) == hf_greedy(reference, prompt, 40)


def test_seeded_sampling_is_reproducible(tiny):
    *_, model = tiny
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234)
    runs = [generate(StepRunner(model, 64, 8), [1, 2, 3], 20, params).tokens for _ in range(2)]
    assert runs[0] == runs[1]
    other = generate(StepRunner(model, 64, 8), [1, 2, 3], 20,
                     SamplingParams(temperature=1.0, top_p=0.9, seed=99)).tokens
    assert other != runs[0]


def test_stop_token_ends_reply_and_is_not_emitted(tiny):
    *_, model = tiny
    runner = StepRunner(model, 64, 8)
    free = greedy_tokens(runner, [5, 6, 7], 10)
    stop = free[4]
    result = generate(StepRunner(model, 64, 8), [5, 6, 7], 10, SamplingParams(),
                      stop_ids=frozenset({stop}))
    assert result.stop_reason == "stop"
    assert result.tokens == free[:free.index(stop)]


def test_generation_stops_at_context_end(tiny):
    *_, model = tiny
    result = generate(StepRunner(model, max_context=12, chunk_size=4), [1, 2, 3, 4, 5], 50,
                      SamplingParams())
    assert result.stop_reason == "context" and len(result.tokens) == 7


def test_bad_lengths(tiny):
    *_, model = tiny
    runner = StepRunner(model, max_context=8, chunk_size=4)
    with pytest.raises(InvalidRequestError, match="context holds 8"):
        generate(runner, list(range(9)), 4, SamplingParams())
    with pytest.raises(InvalidRequestError, match="empty"):
        generate(runner, [], 4, SamplingParams())


def test_target_probs_top_k_top_p():
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.125, 0.0625, 0.0625]]))
    top_k = target_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    torch.testing.assert_close(top_k, torch.tensor([[2 / 3, 1 / 3, 0, 0, 0]]))
    # top_p 0.7: 0.5 alone is below 0.7, so 0.25 joins; 0.75 >= 0.7 stops there
    top_p = target_probs(logits, SamplingParams(temperature=1.0, top_p=0.7))
    torch.testing.assert_close(top_p, torch.tensor([[2 / 3, 1 / 3, 0, 0, 0]]))
    greedy = target_probs(logits, SamplingParams())
    assert greedy.tolist() == [[1.0, 0, 0, 0, 0]]


def test_sampling_frequencies_follow_the_distribution():
    probs = torch.tensor([0.5, 0.3, 0.2, 0.0])
    params = SamplingParams(temperature=1.0, seed=0)
    draws = sample(torch.log(probs).expand(20000, 4), params, params.generator())
    freq = torch.bincount(draws, minlength=4).float() / draws.numel()
    torch.testing.assert_close(freq, probs, atol=0.015, rtol=0)


def test_text_stream_holds_back_partial_characters(tiny):
    directory, *_ = tiny
    tokenizer = tokenizer_from_hf_dir(directory)
    text = "naïve 🙂 数据!"
    ids = tokenizer.encode(text)
    stream = TextStream(tokenizer)
    pieces = [stream.push([i]) for i in ids]
    assert "".join(pieces) + stream.finish() == text
    assert all("\ufffd" not in piece for piece in pieces)
