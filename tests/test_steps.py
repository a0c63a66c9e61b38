"""Fixed-shape steps: chunked prefill, caller masks (trees) and compiled graphs agree with eager."""

from __future__ import annotations

import pytest
import torch

from helpers import save_random_hf_model
from yggdrasil.models.hf_loader import load_hf_model
from yggdrasil.runtime.steps import StepRunner


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-llama")
    save_random_hf_model(directory, "llama", seed=3)
    return load_hf_model(directory, torch.float32)


def _ids(n: int, seed: int = 0, vocab: int = 256) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("prompt_len", [1, 7, 16, 45])
@pytest.mark.parametrize("chunk", [4, 16, 32])
def test_chunked_prefill_equals_one_shot(tiny_model, prompt_len, chunk):
    ids = _ids(prompt_len, seed=prompt_len)
    one_shot = StepRunner(tiny_model, max_context=128, chunk_size=64)
    expected = one_shot.prefill(ids)
    chunked = StepRunner(tiny_model, max_context=128, chunk_size=chunk)
    got = chunked.prefill(ids)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    # and the cache it leaves behind serves the next decode step identically
    torch.testing.assert_close(chunked.decode(5, prompt_len), one_shot.decode(5, prompt_len),
                               rtol=1e-5, atol=1e-5)


def test_padding_rows_never_touch_real_slots(tiny_model):
    runner = StepRunner(tiny_model, max_context=64, chunk_size=16)
    runner.prefill(_ids(5))
    k_before = runner.cache.stacked()[0][:, :, :, 5:runner.cache.scratch_slot]
    runner.prefill(_ids(3, seed=9), start=5)  # 13 padding rows
    assert torch.equal(runner.cache.stacked()[0][:, :, :, 8:runner.cache.scratch_slot],
                       k_before[:, :, :, 3:])


def _tree():
    """A small tree hanging off the prefix: parent index per node (-1 = child of the prefix)."""
    parents = [-1, 0, 0, 1, 1, 2, 5]
    tokens = [11, 23, 42, 7, 99, 3, 150]
    return parents, tokens


def _path(parents: list[int], node: int) -> list[int]:
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def test_tree_mask_equals_separate_paths(tiny_model):
    prefix = _ids(10, seed=4)
    parents, tokens = _tree()
    n = len(tokens)
    runner = StepRunner(tiny_model, max_context=64, chunk_size=16)
    runner.prefill(prefix)
    start = len(prefix)
    depth = torch.tensor([len(_path(parents, i)) - 1 for i in range(n)])
    span = 32
    mask = torch.zeros(n, span, dtype=torch.bool)
    mask[:, :start] = True
    for node in range(n):
        mask[node, [start + a for a in _path(parents, node)]] = True
    with torch.inference_mode():
        tree_logits = tiny_model(torch.tensor([tokens]), (start + depth)[None],
                                 torch.arange(start, start + n)[None], mask[None])[0]
    for node in range(n):
        path_tokens = [tokens[a] for a in _path(parents, node)]
        reference = StepRunner(tiny_model, max_context=64, chunk_size=16)
        reference.prefill(prefix)
        for offset, token in enumerate(path_tokens):
            expected = reference.decode(token, start + offset)
        torch.testing.assert_close(tree_logits[node], expected, rtol=1e-4, atol=1e-4)


def test_compiled_equals_eager_without_recompiles(tiny_model, monkeypatch):
    """... and each step shape compiles once, with the CPU ISA in Inductor's cache key: its own
    key lacks it, and AVX-512 code cached by one run crashed a run forced to AVX2 (issue 40)."""
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    from yggdrasil.runtime import steps

    tags = []

    def keyed():
        context = real()
        context.__enter__()
        tags.append(torch.compiler.config.cache_key_tag)
        context.__exit__(None, None, None)
        return real()

    real = steps.isa_keyed_cache
    monkeypatch.setattr(steps, "isa_keyed_cache", keyed)
    ids = _ids(21, seed=6)
    eager = StepRunner(tiny_model, max_context=64, chunk_size=16)
    compiled = StepRunner(tiny_model, max_context=64, chunk_size=16, compile=True)
    compiled.warm_up()  # after this, any recompile raises (fail_on_recompile stance)
    assert tags and all(f"cpu-isa={pick_vec_isa()}" in tag for tag in tags)
    assert len(tags) == len(compiled._ran)  # the first call of each shape only
    assert "cpu-isa" not in torch.compiler.config.cache_key_tag  # set for the compile, not for the process
    torch.testing.assert_close(compiled.prefill(ids), eager.prefill(ids), rtol=1e-4, atol=1e-4)
    token = 17
    for pos in range(len(ids), len(ids) + 6):
        got, expected = compiled.decode(token, pos), eager.decode(token, pos)
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
        token = int(expected.argmax())
