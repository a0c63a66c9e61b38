"""The q4 format keeps a GGUF's weights as the file has them (issue 53): each tensor in the block
kind the kernels take for its type (Q4_0 without its offset, Q4_1, Q4_K, Q6_K, Q8_0), every
other type requantized, the head at least 6-bit, a fused linear of mixed types one op per run of
equal parts; each module's weights are the file's own dequantized weights bit for bit, and a
bundle's deployed weights map back to the same modules."""

from __future__ import annotations

from types import SimpleNamespace

import gguf
import numpy as np
import pytest
import torch
from helpers import save_random_hf_model
from test_kernels_k import raw_blocks

from yggdrasil.models import quant_q4
from yggdrasil.models.hf_loader import load_hf_model
from yggdrasil.models.loader import LoadedModel
from yggdrasil.models.quant import apply_weight_format, big_linears, weight_format
from yggdrasil.models.quant_blocks import MixedLinear, Q4KLinear, Q4Linear, Q6KLinear, Q8Linear, Q40Linear
from yggdrasil.runtime.deployed import DeployedWeights, save_deployed

Q = gguf.GGMLQuantizationType
pytestmark = pytest.mark.skipif(quant_q4.kernels_available() is not None, reason="no C++ compiler for the kernels")
DIM, FFN = 256, 512  # whole super-blocks, so every K-quant applies
TYPES = {"attn_q": Q.Q4_K, "attn_k": Q.Q4_K, "attn_v": Q.Q6_K, "attn_output": Q.Q4_0, "ffn_gate": Q.Q4_K,
         "ffn_up": Q.Q4_K, "ffn_down": Q.Q6_K}


class FakeGGUF:
    """What q4_modules reads of a GGUFFile: the tensor directory and each tensor's raw blocks."""

    def __init__(self, model, types: dict[str, Q], head: Q, layer1_down: Q) -> None:
        cfg = model.config
        self.tensors, self._raw = [], {}
        rows = {"attn_q": cfg.n_heads * cfg.head_dim, "attn_k": cfg.n_kv_heads * cfg.head_dim,
                "attn_v": cfg.n_kv_heads * cfg.head_dim, "attn_output": cfg.dim, "ffn_gate": cfg.ffn_dim,
                "ffn_up": cfg.ffn_dim, "ffn_down": cfg.dim}
        cols = {**{k: cfg.dim for k in rows}, "attn_output": cfg.n_heads * cfg.head_dim, "ffn_down": cfg.ffn_dim}
        for layer in range(cfg.n_layers):
            for stem, qtype in types.items():
                if layer == 1 and stem == "ffn_down":
                    qtype = layer1_down
                self._add(f"blk.{layer}.{stem}.weight", qtype, (rows[stem], cols[stem]), seed=len(self.tensors))
        self._add("token_embd.weight", head, (cfg.vocab_size, cfg.dim), seed=99)

    def _add(self, name, qtype, shape, seed):
        info = SimpleNamespace(name=name, qtype=Q(qtype), shape=shape)
        if qtype in (Q.Q4_0, Q.Q4_K, Q.Q6_K):
            self._raw[name] = raw_blocks(qtype, *shape, seed=seed)
        else:  # Q8_0, Q5_0: quantized from random floats (their bytes are plain)
            floats = np.random.default_rng(seed).standard_normal(shape).astype(np.float32) * 0.05
            self._raw[name] = gguf.quants.quantize(floats, qtype)
        self.tensors.append(info)

    def raw(self, info):
        return self._raw[info.name]

    def dequantized(self, name: str) -> torch.Tensor:
        info = next(t for t in self.tensors if t.name == name)
        return torch.from_numpy(gguf.quants.dequantize(self._raw[name], Q(info.qtype)).astype(np.float32))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("kinds") / "m"
    save_random_hf_model(path, "qwen2", hidden_size=DIM, intermediate_size=FFN, vocab_size=256)
    return path


def _q4(model_dir, head=Q.Q6_K, layer1_down=Q.Q5_0):
    model = load_hf_model(model_dir, torch.float32)
    fake = FakeGGUF(model, TYPES, head, layer1_down)
    apply_weight_format(model, "q4", gguf=fake)
    return model, fake


def test_each_tensor_keeps_its_files_kind_and_weights_bit_for_bit(model_dir):
    model, fake = _q4(model_dir)
    assert weight_format(model) == "q4"
    wqkv = model.get_submodule("layers.0.attention.wqkv")
    assert isinstance(wqkv, MixedLinear) and wqkv.kinds == ("q4_k", "q6_k")  # q and k merged, v its own
    want = torch.cat([fake.dequantized(f"blk.0.{s}.weight") for s in ("attn_q", "attn_k", "attn_v")])
    assert torch.equal(wqkv.dequantized_weight(), want)
    kinds = {"layers.0.attention.wo": (Q40Linear, "attn_output"), "layers.0.feed_forward.w2": (Q6KLinear, "ffn_down"),
             "output": (Q6KLinear, None)}
    for name, (cls, stem) in kinds.items():
        module = model.get_submodule(name)
        source = f"blk.0.{stem}.weight" if stem else "token_embd.weight"
        assert isinstance(module, cls) and torch.equal(module.dequantized_weight(), fake.dequantized(source)), name
    w13 = model.get_submodule("layers.0.feed_forward.w13")
    assert isinstance(w13, Q4KLinear)
    assert torch.equal(w13.dequantized_weight(), torch.cat([fake.dequantized(f"blk.0.{s}.weight")
                                                           for s in ("ffn_gate", "ffn_up")]))
    # a type the kernels do not take (Q5_0) is requantized into 4-bit blocks from the loaded weights
    assert isinstance(model.get_submodule("layers.1.feed_forward.w2"), Q4Linear)


def test_the_head_is_kept_as_stored_at_6_bits_or_more_and_never_narrower(model_dir):
    for head, cls in ((Q.Q8_0, Q8Linear), (Q.Q4_K, Q6KLinear), (Q.Q4_0, Q6KLinear)):
        model, _ = _q4(model_dir, head=head)
        assert isinstance(model.output, cls), head.name


def test_a_mixed_linear_computes_each_part_with_its_own_op(model_dir):
    model, _ = _q4(model_dir)
    wqkv = model.get_submodule("layers.0.attention.wqkv")
    x = torch.randn(3, DIM)
    parts = [torch.ops.yggdrasil.q4_k_linear(x, *wqkv.part_tensors(0)),
             torch.ops.yggdrasil.q6_k_linear(x, *wqkv.part_tensors(1))]
    assert torch.equal(wqkv(x), torch.cat(parts, -1) + wqkv.bias)
    alone = torch.cat([wqkv(x[i:i + 1]) for i in range(3)])
    assert torch.equal(wqkv(x), alone)  # batch-invariant like its parts


def test_deployed_weights_map_back_to_the_same_kinds(model_dir, tmp_path):
    model, _ = _q4(model_dir)
    from yggdrasil.models.catalog import ResolvedModel
    from yggdrasil.models.tokenizer import tokenizer_from_hf_dir

    loaded = LoadedModel(ResolvedModel("m", model_dir, "hf", None), model, tokenizer_from_hf_dir(model_dir), 0.0)
    save_deployed(tmp_path / "weights", {"target": loaded})
    mapped = DeployedWeights(tmp_path / "weights").load("target", "cpu").model
    for name in big_linears(model):
        assert type(mapped.get_submodule(name)) is type(model.get_submodule(name)), name
    assert mapped.get_submodule("layers.0.attention.wqkv").kinds == ("q4_k", "q6_k")
    model.setup_cache(1, 32)
    mapped.setup_cache(1, 32)
    tokens = torch.tensor([[5, 9, 77, 3]])
    positions = torch.arange(4)[None]
    mask = torch.ones(1, 4, 4, dtype=torch.bool).tril()
    assert torch.equal(mapped(tokens, positions, positions.clone(), mask), model(tokens, positions, positions.clone(), mask))
