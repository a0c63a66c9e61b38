"""Bitwise, enforced (issue 53): a bundle claims `bitwise` only when its steps were measured
batch-invariant where that breaks most likely (odd row counts, a prompt filling the context) and
its graphs hold nothing outside the fixed-order ops but exact elementwise arithmetic (the
SiLU, the one transcendental, is an invariant op now); otherwise it says `up to ties (max gap G)`
and the tie rule applies."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from kernel_fixtures import needs_kernels, tiny_dir  # noqa: F401 (a pytest fixture)

from yggdrasil.compile import pointwise
from yggdrasil.compile.invariance import Invariance, long_probe, measure_invariance
from yggdrasil.storage.manifest import Manifest
from yggdrasil.models.hf_loader import load_hf_model
from yggdrasil.models.quant import apply_weight_format
from yggdrasil.runtime.steps import StepRunner




def _model(tiny_dir, fmt: str):
    model = load_hf_model(tiny_dir, torch.float32)
    apply_weight_format(model, fmt)
    return model


@needs_kernels
def test_a_q4_step_holds_only_fixed_order_ops_and_exact_elementwise_arithmetic(tiny_dir):
    proof = pointwise.prove(_model(tiny_dir, "q4"), 128)
    assert proof == {"exact": True, "unproven_ops": [], "inductor": []}, proof


def test_a_float_step_is_not_proven_exact(tiny_dir):
    """fp32 runs torch's matmul, softmax and SiLU: where a vector body and a scalar tail, or a
    blocking by rows, can each round differently."""
    proof = pointwise.prove(_model(tiny_dir, "fp32"), 128)
    assert not proof["exact"] and any("silu" in op or "linear" in op or "mm" in op for op in proof["unproven_ops"])


@needs_kernels
def test_contraction_or_unsafe_math_in_inductor_voids_the_proof(tiny_dir, monkeypatch):
    from torch._inductor import config

    monkeypatch.setattr(config.cpp, "enable_floating_point_contract_flag", "fast")
    proof = pointwise.prove(_model(tiny_dir, "q4"), 128)
    assert not proof["exact"] and "fused multiply-adds" in proof["inductor"][0]


@needs_kernels
def test_a_q4_model_is_invariant_at_every_row_count_1_to_17_and_at_a_full_context(tiny_dir):
    model = _model(tiny_dir, "q4")
    runner = StepRunner(model, 128, chunk_sizes=(8,))
    tokenizer = SimpleNamespace(encode=lambda text: [ord(c) % 256 for c in text])
    longest = long_probe(tokenizer, 128, 17)
    assert 100 < len(longest) <= 128 - 17
    invariance = measure_invariance(runner, [[5, 17, 99, 3, 42, 7, 11, 64, 2, 9, 30], longest], tuple(range(1, 18)))
    assert {"verify17", "tree17", "verify3", "tree5"} <= set(invariance.ways) and invariance.longest == len(longest)
    assert invariance.measured_bitwise and invariance.bitwise, invariance.ways


def test_the_claim_needs_the_measurement_and_the_proof():
    exact = {"exact": True, "unproven_ops": [], "inductor": []}
    assert Invariance(True, 0.0, 0, 4, {"prefill": 0.0}, 300, exact).bitwise
    unproven = Invariance(True, 0.0, 0, 4, {"prefill": 0.0}, 300, {"exact": False, "unproven_ops": ["aten.exp.default"],
                                                                  "inductor": []})
    assert not unproven.bitwise and unproven.verdict().startswith("up to ties")
    assert "aten.exp.default" in unproven.summary() and unproven.as_dict()["bitwise"] is False
    differs = Invariance(False, 0.0625, 1, 4, {"verify4": 0.0625}, 300, None)
    assert differs.verdict() == "up to ties (max gap 0.062)" and "worst: verify4" in differs.summary()
    # a record written before the proof (its `bitwise` is what was measured) still reads
    old = Invariance.from_dict({"bitwise": True, "max_abs_diff": 0.0, "argmax_changed": 0, "prompts": 3, "ways": {}})
    assert old.measured_bitwise and old.bitwise and old.proof is None


def test_the_manifest_says_bitwise_only_when_the_claim_was_recorded():
    def manifest(stats):
        return SimpleNamespace(stats=stats, bitwise=Manifest.bitwise.fget(SimpleNamespace(stats=stats)))

    claim = Invariance(True, 0.0, 0, 4, {}, 300, {"exact": True, "unproven_ops": [], "inductor": []})
    said = Manifest.exactness(manifest({"batch_invariance": claim.summary(), "batch_invariance_measured": claim.as_dict()}))
    assert said.startswith("bitwise")
    ties = Invariance(False, 0.5, 0, 4, {"tree8": 0.5}, 300, None)
    said = Manifest.exactness(manifest({"batch_invariance": ties.summary(), "batch_invariance_measured": ties.as_dict()}))
    assert said.startswith("up to ties (max gap 0.5)")
    assert Manifest.exactness(manifest({})).startswith("not measured")


@pytest.mark.slow
def test_the_invariance_suite_measures_a_bundle_where_it_breaks_most_likely(tiny_bundle, tmp_path):
    """bench invariance on the tiny (fp32) bundle: eager rows 1..17 and a full-context prompt,
    the compiled widths, and speculative against plain output, recorded beside the bundle's claim."""
    import json
    import subprocess
    import sys

    from yggdrasil.bench.provenance import invalid_values, missing_fields

    recipe, bundle = tiny_bundle
    out = tmp_path / "invariance.json"
    done = subprocess.run([sys.executable, "-m", "yggdrasil", "bench", "invariance", "--bundle", str(bundle),
                           "--prompts", str(recipe.parent / "tiny-prompts.jsonl"), "--n", "3", "--max-new-tokens", "24",
                           "--out", str(out)], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert missing_fields(result) == [] and invalid_values(result) == []
    assert result["provenance"]["command"].startswith("yggdrasil bench invariance")
    assert {"verify17", "tree17", "verify3"} <= set(result["eager_rows"]["ways"])
    assert result["eager_rows"]["longest"] > 200 and result["graphs"]["ways"]  # a prompt near the 256 context
    assert result["claim"].startswith("up to ties") and result["bitwise"] is False  # fp32: not proven exact
    generated = result["generation"]
    assert generated["speculates"] and generated["of"] == 3 and len(generated["rows"]) == 3
