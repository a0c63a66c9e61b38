"""One entry point for loading a model by catalog name or path: weights + tokenizer."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from yggdrasil.models.catalog import ResolvedModel, resolve_model
from yggdrasil.user_dirs import cache_dir
from yggdrasil.config import ModelConfig
from yggdrasil.errors import InvalidRequestError
from yggdrasil.models.gguf_file import GGUFFile
from yggdrasil.models.gguf_loader import load_gguf_model, read_gguf_config
from yggdrasil.models.hf_loader import load_hf_model, read_hf_config
from yggdrasil.models.model import Transformer
from yggdrasil.progress import Progress
from yggdrasil.models.quant import apply_weight_format, check_weight_format
from yggdrasil.models.tokenizer import Tokenizer, tokenizer_from_gguf, tokenizer_from_hf_dir
from yggdrasil.models.weights import tensor_count

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


@dataclass(frozen=True)
class LoadedModel:
    source: ResolvedModel
    model: Transformer
    tokenizer: Tokenizer
    load_seconds: float

    @property
    def config(self) -> ModelConfig:
        return self.model.config


def parse_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise InvalidRequestError(f"unknown dtype {name!r}; use one of {', '.join(DTYPES)}") from None


def default_dtype(device: str) -> torch.dtype:
    return torch.bfloat16 if device.startswith("cuda") else torch.float32


def _join_progress():
    state: dict[str, Progress] = {}

    def report(message: str, done: int, total: int) -> None:
        bar = state.get(message)
        if bar is None:
            bar = state[message] = Progress(message, total)
        bar.update(done)
        if done >= total:
            bar.close()
    return report


def load_tokenizer(source: ResolvedModel) -> Tokenizer:
    if source.format == "hf":
        return tokenizer_from_hf_dir(source.path)

    return tokenizer_from_gguf(source.path, GGUFFile(source.path).metadata, cache_dir())


def load(name_or_path: str, dtype: torch.dtype | None = None, device: str = "cpu",
         quiet: bool = False, weights: str = "fp32") -> LoadedModel:
    """weights: how the big linears are stored (yggdrasil.models.quant.WEIGHT_FORMATS); activations keep
    dtype. A GGUF's Q4_0/Q4_1 tensors become int4 directly, without a float round trip."""
    started = time.perf_counter()
    check_weight_format(weights, device)
    source = resolve_model(name_or_path, progress=None if quiet else _join_progress())
    dtype = dtype or default_dtype(device)
    if source.format == "hf":
        bar = _weights_progress(source, read_hf_config(Path(source.path)), quiet)
        model = load_hf_model(Path(source.path), dtype, device, progress=bar)
        apply_weight_format(model, weights)
        tokenizer = tokenizer_from_hf_dir(Path(source.path))
    else:
        gguf_file = GGUFFile(Path(source.path))
        bar = _weights_progress(source, read_gguf_config(gguf_file), quiet)
        model = load_gguf_model(gguf_file, dtype, device, progress=bar)
        apply_weight_format(model, weights, gguf=gguf_file)
        tokenizer = tokenizer_from_gguf(Path(source.path), gguf_file.metadata, cache_dir())
    if bar is not None:
        stored = "" if weights == "fp32" else f", {weights} weights"
        bar.close(f"{model.config.n_params / 1e6:.0f}M parameters, {dtype}{stored}".replace("torch.", ""))
    return LoadedModel(source, model, tokenizer, time.perf_counter() - started)


def _weights_progress(source: ResolvedModel, cfg: ModelConfig, quiet: bool) -> Progress | None:
    return None if quiet else Progress(f"loading {source.name}", tensor_count(cfg))


def check_same_vocabulary(target: LoadedModel, draft: LoadedModel) -> None:
    """Draft and target must share token ids, or the tree means nothing to the target."""
    if target.tokenizer.fingerprint() != draft.tokenizer.fingerprint() or \
            target.config.vocab_size != draft.config.vocab_size:
        raise InvalidRequestError(
            f"draft {draft.source.name} and target {target.source.name} do not share a tokenizer "
            f"(vocabularies of {draft.tokenizer.vocab_size} and {target.tokenizer.vocab_size} tokens "
            "differ); pick a draft from the same model family, or use --draft lookup")
