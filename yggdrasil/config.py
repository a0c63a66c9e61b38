"""Model configuration: one frozen dataclass for the Llama and Qwen2 families.

Built either from a Hugging Face `config.json` or from GGUF metadata, so the model code never
needs to know where its weights came from.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

from yggdrasil.errors import UnsupportedModelError

SUPPORTED_ARCHS = ("llama", "qwen2")


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling. kind is "llama3" (Llama-3.1 style smooth) or "linear"."""

    kind: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    arch: str
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    norm_eps: float
    rope_theta: float
    max_position: int
    qkv_bias: bool = False
    o_bias: bool = False
    tie_embeddings: bool = False
    rope_scaling: RopeScaling | None = None
    # per-frequency divisors from a GGUF `rope_freqs.weight` tensor (Llama-3.1 GGUFs)
    rope_freq_factors: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        if self.arch not in SUPPORTED_ARCHS:
            raise UnsupportedModelError(
                f"model architecture {self.arch!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_ARCHS)}"
            )
        if self.n_heads % self.n_kv_heads:
            raise UnsupportedModelError(
                f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}"
            )

    @property
    def n_params(self) -> int:
        """Parameter count (embedding and head counted once when tied)."""
        qkv = self.dim * (self.n_heads + 2 * self.n_kv_heads) * self.head_dim
        attn = qkv + self.n_heads * self.head_dim * self.dim
        mlp = 3 * self.dim * self.ffn_dim
        per_layer = attn + mlp + 2 * self.dim
        embed = self.vocab_size * self.dim * (1 if self.tie_embeddings else 2)
        return self.n_layers * per_layer + embed + self.dim

    def inv_freq(self) -> list[float]:
        """RoPE inverse frequencies, after scaling, as plain floats (fp64 math)."""
        half = self.head_dim // 2
        base = [1.0 / (self.rope_theta ** (2 * i / self.head_dim)) for i in range(half)]
        if self.rope_freq_factors is not None:
            return [f / s for f, s in zip(base, self.rope_freq_factors)]
        scaling = self.rope_scaling
        if scaling is None:
            return base
        if scaling.kind == "linear":  # positions / factor == frequencies / factor
            return [f / scaling.factor for f in base]
        return [_llama3_scale(f, scaling) for f in base]


def _llama3_scale(freq: float, s: RopeScaling) -> float:
    # Llama-3.1: keep high frequencies, divide low ones by factor, blend in between
    wavelen = 2 * math.pi / freq
    low_wavelen = s.original_max_position / s.low_freq_factor
    high_wavelen = s.original_max_position / s.high_freq_factor
    if wavelen < high_wavelen:
        return freq
    if wavelen > low_wavelen:
        return freq / s.factor
    smooth = (s.original_max_position / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    return (1 - smooth) * freq / s.factor + smooth * freq


def _rope_scaling_from_hf(cfg: Mapping[str, Any]) -> RopeScaling | None:
    # transformers 4.x writes `rope_scaling`; 5.x folds it into `rope_parameters`
    params = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    kind = params.get("rope_type", params.get("type", "default"))
    if kind in (None, "default"):
        return None
    if kind == "llama3":
        return RopeScaling(
            kind="llama3",
            factor=float(params["factor"]),
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
            original_max_position=int(params.get("original_max_position_embeddings", 8192)),
        )
    if kind == "linear":
        return RopeScaling(kind="linear", factor=float(params["factor"]))
    raise UnsupportedModelError(f"RoPE scaling type {kind!r} is not supported (llama3, linear are)")


def _rope_theta_from_hf(cfg: Mapping[str, Any]) -> float:
    params = cfg.get("rope_parameters") or {}
    return float(cfg.get("rope_theta", params.get("rope_theta", 10000.0)))


def config_from_hf(cfg: Mapping[str, Any]) -> ModelConfig:
    """ModelConfig from a parsed HF `config.json`."""
    arch = cfg.get("model_type")
    if arch not in SUPPORTED_ARCHS:
        raise UnsupportedModelError(
            f"config.json model_type {arch!r} is not supported; supported: {', '.join(SUPPORTED_ARCHS)}"
        )
    if cfg.get("mlp_bias"):
        raise UnsupportedModelError("Llama configs with mlp_bias=true are not supported")
    n_heads = int(cfg["num_attention_heads"])
    dim = int(cfg["hidden_size"])
    attention_bias = bool(cfg.get("attention_bias", False))
    return ModelConfig(
        arch=arch,
        vocab_size=int(cfg["vocab_size"]),
        dim=dim,
        n_layers=int(cfg["num_hidden_layers"]),
        n_heads=n_heads,
        n_kv_heads=int(cfg.get("num_key_value_heads") or n_heads),
        head_dim=int(cfg.get("head_dim") or dim // n_heads),
        ffn_dim=int(cfg["intermediate_size"]),
        norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=_rope_theta_from_hf(cfg),
        max_position=int(cfg.get("max_position_embeddings", 4096)),
        # Qwen2 always has q/k/v bias and no o bias; Llama's attention_bias covers all four
        qkv_bias=True if arch == "qwen2" else attention_bias,
        o_bias=False if arch == "qwen2" else attention_bias,
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        rope_scaling=_rope_scaling_from_hf(cfg),
    )


def config_from_gguf(meta: Mapping[str, Any], tensor_names: set[str],
                     rope_freq_factors: tuple[float, ...] | None = None) -> ModelConfig:
    """ModelConfig from GGUF metadata and the set of tensor names in the file."""
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise UnsupportedModelError(
            f"GGUF architecture {arch!r} is not supported; supported: {', '.join(SUPPORTED_ARCHS)}"
        )

    def key(name: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{name}", default)
        if value is None:
            raise UnsupportedModelError(f"GGUF metadata is missing {arch}.{name}")
        return value

    dim = int(key("embedding_length"))
    n_heads = int(key("attention.head_count"))
    vocab = meta.get(f"{arch}.vocab_size") or len(meta.get("tokenizer.ggml.tokens", []))
    head_dim = int(meta.get(f"{arch}.attention.key_length") or meta.get(f"{arch}.rope.dimension_count")
                   or dim // n_heads)
    return ModelConfig(
        arch=arch,
        vocab_size=int(vocab),
        dim=dim,
        n_layers=int(key("block_count")),
        n_heads=n_heads,
        n_kv_heads=int(key("attention.head_count_kv", n_heads)),
        head_dim=head_dim,
        ffn_dim=int(key("feed_forward_length")),
        norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        max_position=int(key("context_length", 4096)),
        qkv_bias="blk.0.attn_q.bias" in tensor_names,
        o_bias="blk.0.attn_output.bias" in tensor_names,
        tie_embeddings="output.weight" not in tensor_names,
        rope_freq_factors=rope_freq_factors,
    )
