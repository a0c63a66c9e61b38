"""The decoder block's nested_compile_region is off while torch.export traces (issue 23): some
torch versions would leave it in the exported program as an invoke_subgraph, which AOTInductor
may not compile. Eager calls (and torch.compile) still go through the region."""

from __future__ import annotations

import torch

from yggdrasil.buckets import GraphKey
from yggdrasil.graphs.aoti import StepModule, example_inputs
from yggdrasil.config import ModelConfig
from yggdrasil.models.model import Block, Transformer


def _tiny_qwen() -> Transformer:
    cfg = ModelConfig("qwen2", vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                      ffn_dim=64, norm_eps=1e-6, rope_theta=1e6, max_position=256, qkv_bias=True,
                      tie_embeddings=True)
    torch.manual_seed(0)
    model = Transformer(cfg)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.05)
    model.eval().setup_cache(1, 128)
    return model


def _counting_region(monkeypatch) -> list[int]:
    """Replace Block.region by a pass-through that counts its calls."""
    calls = []

    def region(self, *args):
        calls.append(1)
        return Block.layer(self, *args)

    monkeypatch.setattr(Block, "region", region)
    return calls


def test_export_does_not_enter_the_compile_region_and_emits_no_invoke_subgraph(monkeypatch):
    model = _tiny_qwen()
    calls = _counting_region(monkeypatch)
    args = example_inputs(GraphKey("verify", 4), 64, "cpu")
    with torch.no_grad():
        exported = torch.export.export(StepModule(model, False), args, strict=False)
    assert calls == []  # the guard took the plain path for every layer
    targets = [str(node.target) for gm in exported.graph_module.modules() if isinstance(gm, torch.fx.GraphModule)
               for node in gm.graph.nodes]
    assert not any("invoke_subgraph" in t for t in targets)
    # the exported program computes what the eager model computes (both write the same cache slots)
    with torch.no_grad():
        want = model(*args[:4])
        got = exported.module()(*args)
    torch.testing.assert_close(got, want)


def test_eager_calls_go_through_the_compile_region(monkeypatch):
    model = _tiny_qwen()
    calls = _counting_region(monkeypatch)
    tokens, positions, slots, mask, _ = example_inputs(GraphKey("verify", 4), 64, "cpu")
    with torch.no_grad():
        model(tokens, positions, slots, mask)
    assert len(calls) == model.config.n_layers


def test_the_region_wraps_the_plain_layer():
    """Unpatched, the region and the plain layer compute the same thing (the region is a no-op
    in eager; torch.compile compiles it once for every layer)."""
    model = _tiny_qwen()
    block = model.layers[0]
    x = torch.randn(1, 3, 32)
    cos, sin = model.rope(torch.arange(3)[None])
    mask = torch.ones(1, 1, 3, 64, dtype=torch.bool)
    slots = torch.arange(3)[None]
    with torch.no_grad():
        plain = block.layer(x, cos, sin, slots, mask, *model.cache.layer(0))
        region = block.region(x, cos, sin, slots, mask, *model.cache.layer(0))
    torch.testing.assert_close(plain, region)
