"""The compiled fast path against its plain-PyTorch reference: an AOTInductor step graph, bound to
the live model's weights and cache, returns what the eager forward returns, at every attention
span, and writes the KV cache in place exactly as eager does."""

from __future__ import annotations


import pytest
import torch

from helpers import save_random_hf_model

from yggdrasil.graphs.aoti import export_step
from yggdrasil.storage.layout import BundleLayout
from yggdrasil.buckets import GraphKey
from yggdrasil.storage.registry import load_graph_set
from yggdrasil.models.hf_loader import load_hf_model
from yggdrasil.runtime.steps import StepRunner, verify_inputs
from yggdrasil.runtime.tree import TokenTree


@pytest.mark.slow
def test_verify_with_hidden_states_matches_eager_at_every_span(tmp_path):
    save_random_hf_model(tmp_path / "m", "qwen2")
    model = load_hf_model(tmp_path / "m", torch.float32)
    eager = StepRunner(model, 256, 16)
    spec = GraphKey("verify", 4, hidden=True)
    export_step(model, spec, 256, BundleLayout(tmp_path / "b").graph(spec), dynamic_span=True)
    graphs = load_graph_set(tmp_path / "b", "target", model, [spec.name], "rebuild", "the recipe")
    compiled = StepRunner(model, 256, 16, graphs=graphs)
    tree = TokenTree.with_root(4, 7, model.device)
    tree.add(torch.tensor([0, 0, 1]), torch.tensor([11, 12, 13]), torch.tensor([-0.1, -0.2, -0.3]))
    kept = torch.arange(4)
    for base in (3, 70, 200):  # spans of 64, 128 and 256 slots
        eager.prefill(list(range(1, base + 1)))
        want_logits, want_hidden = eager.run(verify_inputs(eager, tree, kept, base, 4), key="verify", hidden=True)
        want_cache = model.cache.stacked()
        got_logits, got_hidden = compiled.run(verify_inputs(compiled, tree, kept, base, 4), key="verify",
                                              hidden=True)
        torch.testing.assert_close(got_logits, want_logits, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(got_hidden, want_hidden, rtol=1e-4, atol=1e-4)
        for got, want in zip(model.cache.stacked(), want_cache):  # same slots written, same values
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert graphs.calls == 3
    with pytest.raises(Exception, match="not compiled.*verify_w2"):
        compiled.run(verify_inputs(compiled, tree, kept[:2], 3, 2), key="verify")


@pytest.mark.slow
def test_one_row_verify_runs_on_the_decode_graph(tmp_path):
    """Bundles compile no verify_w1: a one-row verify is the decode step, same logits as eager."""
    save_random_hf_model(tmp_path / "m", "qwen2")
    model = load_hf_model(tmp_path / "m", torch.float32)
    eager = StepRunner(model, 256, 16)
    spec = GraphKey("decode", 1)
    export_step(model, spec, 256, BundleLayout(tmp_path / "b").graph(spec), dynamic_span=True)
    graphs = load_graph_set(tmp_path / "b", "target", model, [spec.name], "rebuild", "the recipe")
    compiled = StepRunner(model, 256, 16, graphs=graphs)
    root_only = TokenTree.with_root(1, 7, model.device)
    kept = torch.arange(1)
    for base in (3, 90):
        eager.prefill(list(range(1, base + 1)))
        want = eager.run(verify_inputs(eager, root_only, kept, base, 1), key="verify")
        got = compiled.run(verify_inputs(compiled, root_only, kept, base, 1), key="verify")
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert graphs.calls == 2
    with pytest.raises(Exception, match="not compiled.*verify_hidden_w1"):  # hidden states need their own
        compiled.run(verify_inputs(compiled, root_only, kept, 3, 1), key="verify", hidden=True)
