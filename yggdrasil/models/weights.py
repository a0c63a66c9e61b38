"""Turning checkpoint tensors (Hugging Face names) into a ready Transformer.

Both loaders produce tensors under the HF names (`model.layers.0.self_attn.q_proj.weight`, ...);
this module fuses q/k/v and gate/up the way our model stores them and materialises the model
without ever holding two full copies of the weights.
"""

from __future__ import annotations

from typing import Callable, Iterator

import torch

from yggdrasil.config import ModelConfig
from yggdrasil.errors import ModelFileError
from yggdrasil.models.model import Transformer
from yggdrasil.progress import Progress

TensorGetter = Callable[[str], torch.Tensor]


def _layer_tensors(cfg: ModelConfig, i: int, get: TensorGetter) -> Iterator[tuple[str, torch.Tensor]]:
    hf = f"model.layers.{i}."
    ours = f"layers.{i}."
    yield ours + "attention_norm.weight", get(hf + "input_layernorm.weight")
    yield ours + "ffn_norm.weight", get(hf + "post_attention_layernorm.weight")
    qkv = [get(f"{hf}self_attn.{p}_proj.weight") for p in "qkv"]
    yield ours + "attention.wqkv.weight", torch.cat(qkv, dim=0)
    if cfg.qkv_bias:
        yield ours + "attention.wqkv.bias", torch.cat(
            [get(f"{hf}self_attn.{p}_proj.bias") for p in "qkv"], dim=0)
    yield ours + "attention.wo.weight", get(hf + "self_attn.o_proj.weight")
    if cfg.o_bias:
        yield ours + "attention.wo.bias", get(hf + "self_attn.o_proj.bias")
    gate_up = [get(hf + "mlp.gate_proj.weight"), get(hf + "mlp.up_proj.weight")]
    yield ours + "feed_forward.w13.weight", torch.cat(gate_up, dim=0)
    yield ours + "feed_forward.w2.weight", get(hf + "mlp.down_proj.weight")


def converted_tensors(cfg: ModelConfig, get: TensorGetter) -> Iterator[tuple[str, torch.Tensor]]:
    """Our state-dict entries, one at a time, from a getter of HF-named tensors."""
    yield "tok_embeddings.weight", get("model.embed_tokens.weight")
    for i in range(cfg.n_layers):
        yield from _layer_tensors(cfg, i, get)
    yield "norm.weight", get("model.norm.weight")
    if not cfg.tie_embeddings:
        yield "output.weight", get("lm_head.weight")


def tensor_count(cfg: ModelConfig) -> int:
    """How many tensors converted_tensors yields (for progress bars)."""
    per_layer = 6 + cfg.qkv_bias + cfg.o_bias
    return 2 + (not cfg.tie_embeddings) + cfg.n_layers * per_layer


def _expected_shapes(model: Transformer) -> dict[str, torch.Size]:
    return {name: p.shape for name, p in model.state_dict().items()}


def build_model(cfg: ModelConfig, get: TensorGetter, dtype: torch.dtype,
                device: torch.device | str = "cpu", source: str = "checkpoint",
                progress: Progress | None = None) -> Transformer:
    """Materialise a Transformer from HF-named tensors, converting each to dtype on the fly."""
    with torch.device("meta"):
        model = Transformer(cfg)
    shapes = _expected_shapes(model)
    state: dict[str, torch.Tensor] = {}
    for name, tensor in converted_tensors(cfg, get):
        if tensor.shape != shapes[name]:
            raise ModelFileError(
                f"{source}: tensor for {name} has shape {tuple(tensor.shape)}, the config implies "
                f"{tuple(shapes[name])}; the file does not match its own config"
            )
        state[name] = tensor.to(device=device, dtype=dtype)
        if progress is not None:
            progress.update(step=1)
    model.load_state_dict(state, strict=False, assign=True)
    if cfg.tie_embeddings:
        model.output.weight = model.tok_embeddings.weight
    # non-persistent buffers are not in the state dict: rebuild them off the meta device
    model.inv_freq = torch.tensor(cfg.inv_freq(), dtype=torch.float32, device=device)
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    if missing:
        raise ModelFileError(f"{source}: missing tensors for {', '.join(missing[:5])}")
    return model.eval().requires_grad_(False)
