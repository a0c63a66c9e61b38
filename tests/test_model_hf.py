"""Our decoder equals the transformers reference on the same (random) weights."""

from __future__ import annotations

import pytest
import torch

from helpers import save_random_hf_model
from yggdrasil.models.hf_loader import load_hf_model
from yggdrasil.runtime.steps import StepRunner

VARIANTS = {
    "llama": ("llama", {}),
    "llama-tied-bias": ("llama", {"tie_word_embeddings": True, "attention_bias": True}),
    "llama3-rope-scaling": ("llama", {"rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}}),
    "qwen2": ("qwen2", {}),
    "qwen2-untied": ("qwen2", {"tie_word_embeddings": False}),
}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def model_pair(request, tmp_path_factory):
    arch, overrides = VARIANTS[request.param]
    directory = tmp_path_factory.mktemp(request.param)
    reference = save_random_hf_model(directory, arch, seed=1, **overrides)
    ours = load_hf_model(directory, torch.float32)
    return reference, ours


def _reference_logits(reference, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return reference(ids[None]).logits[0]


def test_prompt_logits_match(model_pair):
    reference, ours = model_pair
    ids = torch.randint(0, ours.config.vocab_size, (37,), generator=torch.Generator().manual_seed(0))
    runner = StepRunner(ours, max_context=128, chunk_size=64)
    inputs = runner.prefill_inputs(ids.tolist(), 0)
    with torch.inference_mode():
        logits = ours(inputs.tokens, inputs.positions, inputs.slots, inputs.mask)[0, :len(ids)]
    expected = _reference_logits(reference, ids)
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)


def test_incremental_decode_matches(model_pair):
    reference, ours = model_pair
    ids = torch.randint(0, ours.config.vocab_size, (24,), generator=torch.Generator().manual_seed(1))
    expected = _reference_logits(reference, ids)
    runner = StepRunner(ours, max_context=96, chunk_size=8)
    prompt = 11
    last = runner.prefill(ids[:prompt].tolist())
    torch.testing.assert_close(last, expected[prompt - 1], rtol=1e-4, atol=1e-4)
    for pos in range(prompt, len(ids)):
        step = runner.decode(int(ids[pos]), pos)
        torch.testing.assert_close(step, expected[pos], rtol=1e-4, atol=1e-4)


def test_hidden_states_are_final_norm_output(model_pair):
    reference, ours = model_pair
    ids = torch.arange(9) % ours.config.vocab_size
    runner = StepRunner(ours, max_context=32, chunk_size=16)
    inputs = runner.prefill_inputs(ids.tolist(), 0)
    with torch.inference_mode():
        logits, hidden = ours(inputs.tokens, inputs.positions, inputs.slots, inputs.mask,
                              logit_index=inputs.logit_index, return_hidden=True)
        ref = reference(ids[None], output_hidden_states=True)
    torch.testing.assert_close(hidden[0, 0], ref.hidden_states[-1][0, -1], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(logits[0, 0], ref.logits[0, -1], rtol=1e-4, atol=1e-4)
