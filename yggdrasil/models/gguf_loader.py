"""Load a GGUF file: metadata → ModelConfig, quantized tensors → dequantized torch weights.

Tensors are dequantized one at a time straight from the memory-mapped file, so peak memory stays
near the size of the dequantized model (plus one tensor), never two copies of it.
"""

from __future__ import annotations

import numpy as np
import torch

from yggdrasil.config import ModelConfig, config_from_gguf
from yggdrasil.errors import ModelFileError
from yggdrasil.models.gguf_file import GGUFFile
from yggdrasil.models.model import Transformer
from yggdrasil.progress import Progress
from yggdrasil.models.weights import build_model

# GGUF tensor name stem → HF name stem (the block index is substituted in)
_BLOCK_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_output.bias": "self_attn.o_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def hf_name(gguf_name: str) -> str | None:
    """The HF tensor name for a GGUF tensor name, or None for tensors we do not load."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _BLOCK_NAMES:
        return f"model.layers.{parts[1]}.{_BLOCK_NAMES[parts[2]]}"
    return None


def _unpermute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    # llama.cpp interleaves each head's two rotary halves for its RoPE; restore HF's layout
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def read_gguf_config(gguf_file: GGUFFile) -> ModelConfig:
    names = {t.name for t in gguf_file.tensors}
    factors = next((tuple(float(x) for x in gguf_file.dequantize(t).ravel())
                    for t in gguf_file.tensors if t.name == "rope_freqs.weight"), None)
    return config_from_gguf(gguf_file.metadata, names, factors)


def load_gguf_model(gguf_file: GGUFFile, dtype: torch.dtype, device: str = "cpu",
                    progress: Progress | None = None) -> Transformer:
    cfg = read_gguf_config(gguf_file)
    by_hf_name = {hf_name(t.name): t for t in gguf_file.tensors if hf_name(t.name)}
    permute_heads = {"self_attn.q_proj.weight": cfg.n_heads, "self_attn.k_proj.weight": cfg.n_kv_heads}

    def get(name: str) -> torch.Tensor:
        info = by_hf_name.get(name)
        if info is None:
            raise ModelFileError(f"{gguf_file.path}: GGUF has no tensor for {name}")
        weights = gguf_file.dequantize(info)
        stem = name.split(".", 3)[-1]
        if cfg.arch == "llama" and stem in permute_heads:
            weights = _unpermute_rows(weights, permute_heads[stem])
        return torch.from_numpy(weights)

    return build_model(cfg, get, dtype, device, source=str(gguf_file.path), progress=progress)
