"""What rounding the activations to int8 costs, apart from the weights (issue 53).

The q4 format multiplies its block weights by activations rounded to int8 per block of 32. A
4-bit x int8 kernel can flip an argmax where float activations would not, so the formats phase
measures the q4 weights twice, with the same quality measures (compile/format_quality.py):

    int8 activations    the q4 format as it runs (its own agreement and perplexity)
    float activations   a float twin: the same model with each linear's q4 weights dequantized
                        to float32 and multiplied in float32 by torch (no int8 rounding)

beside the GGUF's own dequantized model, which is the fp32 reference itself where the model came
from a GGUF file (its agreement is 1 by definition). Where every linear keeps the file's blocks as
stored (quant_q4.py), the float twin *is* that model, weight for weight (tests/test_activation_cost.py
checks it bit for bit on SmolLM2; so does the Qwen 1.5B here): then the twin is not built from the
packed weights (40 s for the Qwen 1.5B) but the fp32 model is used, loaded from the file where
compile has let it go, and its agreement is 1 by construction (the reference's argmax are its
own), so only its perplexity is measured. Where a tensor was requantized, the twin is built and
measured in full: it shows what the requantization costs, and the GGUF model's perplexity is the
fp32 candidate's, when measured.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from yggdrasil.models.model import KVCache, Transformer
from yggdrasil.models.quant_base import PackedLinear
from yggdrasil.runtime.steps import StepRunner

from .format_quality import Reference, agreement, perplexity


def float_twin(model: Transformer) -> tuple[Transformer, bool]:
    """The model with float32 linears holding its packed weights dequantized, torch's own float
    ops throughout (RMSNorm, SDPA, SiLU), and a dense embedding; and whether every linear kept the
    file's blocks as stored (then the twin is the GGUF's dequantized model itself)."""
    cfg = model.config
    with torch.device("meta"):
        twin = Transformer(cfg)
    twin.to_empty(device="cpu")
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, KVCache):  # the twin sets up its own
                continue
            target = twin.get_submodule(name) if name else twin
            if isinstance(module, PackedLinear):
                parent, _, attr = name.rpartition(".")
                # on the meta device, then materialised: no random init of weights overwritten next
                linear = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None,
                                   device="meta").to_empty(device="cpu")
                linear.weight.copy_(module.dequantized_weight())
                if module.bias is not None:
                    linear.bias.copy_(module.bias)
                setattr(twin.get_submodule(parent) if parent else twin, attr, linear)
            elif hasattr(module, "weight") and isinstance(getattr(module, "weight", None), torch.Tensor) \
                    and not list(module.children()) and hasattr(target, "weight"):
                target.weight = nn.Parameter(module.weight.detach().float().clone(), requires_grad=False)
        twin.inv_freq = model.inv_freq.clone()
    if cfg.tie_embeddings and isinstance(model.output, nn.Linear):
        twin.output.weight = twin.tok_embeddings.weight
    return twin.eval().requires_grad_(False), weights_as_stored(model)


def weights_as_stored(model: Transformer) -> bool:
    """Every packed linear holds the file's blocks as stored (quant_q4.py)."""
    packed = [m for m in model.modules() if isinstance(m, PackedLinear)]
    return bool(packed) and all(getattr(m, "as_stored", False) for m in packed)


def measure(model: Transformer, runner: StepRunner, reference: Reference,
            gguf_model: Callable[[], Transformer] | None = None) -> dict:
    """The float-activation model's agreement with the reference and held-out perplexity (the q4
    runner's own, int8 activations, are the format's measurement); released before returning.
    gguf_model: the file's own fp32 model (the reference's), which is the float twin where the
    weights are as stored: then it is measured instead of building the twin."""
    as_stored = weights_as_stored(model)
    if as_stored and gguf_model is not None:
        twin, by_construction = gguf_model(), True
    else:
        twin, by_construction = float_twin(model)[0], False
    twin_runner = StepRunner(twin, runner.cache.max_context, chunk_sizes=runner.chunk_sizes)
    if by_construction:  # the reference's continuations are this model's own argmax
        agreed, positions = 1.0, sum(len(expected) for expected in reference.argmax)
    else:
        agreed, positions = agreement(twin_runner, reference)
    held_out = perplexity(twin_runner, reference)
    del twin_runner, twin
    return {"float_activations": {"agreement": round(agreed, 6), "positions": positions,
                                  "perplexity": None if held_out is None else round(held_out, 4),
                                  **({"agreement_by": "construction: the twin is the fp32 reference model"}
                                     if by_construction else {})},
            "weights_as_stored": as_stored,
            "gguf_model": ("the float twin's weights are the file's own: its numbers are the GGUF model's"
                           if as_stored else "some tensors were requantized: the GGUF model is the fp32 candidate")}
