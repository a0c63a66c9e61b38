"""A bundle's deployed weights (issue 41): the models exactly as the graphs and kernels consume
them, so that opening a bundle maps a file instead of reading a GGUF, dequantizing its blocks and
packing them again.

compile writes, into the bundle's `weights/`:

    models.pt          every role's tensors (packed 4-/8-bit blocks and scales, norms, the
                       embedding as the deployed model looks its rows up), in torch's zip format,
                       whose tensors are 64-byte aligned and memory-map in place. Both roles go
                       in one file, so a tensor they share (a self-draft's layers) is stored once.
    models.yaml        per role: the model config, dtype, which linears are packed in which
                       format (their modules are rebuilt around the mapped tensors, nothing is
                       repacked), and whether the batch-invariant ops are on
    tokenizer-ROLE/    the tokenizer (yggdrasil/models/tokenizer.py's save_tokenizer); one the roles
                       share is written once, under the first role's name

Opening maps models.pt (torch.load(mmap=True)): the page cache holds the only copy, shared by
every process that opens the bundle, and pages are read as the first steps touch them. The
source GGUF is not needed; the manifest keeps its hash for provenance.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import torch
import yaml
from torch import nn

from yggdrasil.models.catalog import ResolvedModel
from yggdrasil.config import ModelConfig, RopeScaling
from yggdrasil.errors import ModelFileError
from yggdrasil.models.loader import LoadedModel, parse_dtype
from yggdrasil.models.model import Transformer
from yggdrasil.models.quant import BF16Linear, Int4Linear, Int8Linear
from yggdrasil.models.quant_base import PackedLinear
from yggdrasil.models.quant_embed import BlockEmbedding
from yggdrasil.models.quant_blocks import BLOCK_CLASSES, MixedLinear
from yggdrasil.models.tokenizer import load_saved_tokenizer, save_tokenizer
from yggdrasil.models.vocab import describe_head, prepare_trimmed_head
from yggdrasil.yaml_files import parse_yaml

MODELS_FILE, INDEX_FILE = "models.pt", "models.yaml"
PACKED_CLASSES = {cls.fmt: cls for cls in (BF16Linear, Int8Linear, Int4Linear, MixedLinear, *BLOCK_CLASSES.values())}


def save_deployed(directory: Path, models: dict[str, LoadedModel]) -> None:
    """Write the models (role -> loaded model, in its deployed format) into `directory`. A
    tokenizer the roles share is written once (the index names each role's): parsing a 150k
    vocabulary costs a quarter second of every start."""
    directory.mkdir(parents=True, exist_ok=True)
    torch.save({role: loaded.model.state_dict() for role, loaded in models.items()}, directory / MODELS_FILE)
    index, written = {}, {}
    for role, loaded in models.items():
        tokenizer = loaded.tokenizer
        content = (tokenizer.inner.to_str(), tokenizer.bos_token, tokenizer.eos_token, tuple(sorted(tokenizer.stop_ids)),
                   tokenizer.chat_template)
        if content not in written:
            written[content] = f"tokenizer-{role}"
            save_tokenizer(tokenizer, directory / written[content])
        index[role] = {**_describe(loaded), "tokenizer": written[content]}
    (directory / INDEX_FILE).write_text(yaml.safe_dump(index, sort_keys=False))


def _describe(loaded: LoadedModel) -> dict:
    model = loaded.model
    source = loaded.source  # provenance (and what bench's llama.cpp and HF rows read): never opened here
    return {"name": source.name, "path": str(source.path), "format": source.format, "sha256": source.sha256,
            "config": dataclasses.asdict(model.config), "dtype": str(model.dtype).removeprefix("torch."),
            "packed": {name: {"format": m.fmt, "in_features": m.in_features, "out_features": m.out_features,
                              **({"parts": list(m.kinds)} if isinstance(m, MixedLinear) else {})}
                       for name, m in model.named_modules() if isinstance(m, PackedLinear)},
            "invariant_ops": model.batch_invariant, "bytes": state_bytes(model.state_dict()),
            "embedding": "blocks" if isinstance(model.tok_embeddings, BlockEmbedding) else "dense",
            **describe_head(model)}


def state_bytes(state: dict[str, torch.Tensor]) -> int:
    """Bytes of the distinct storages (a tied tensor counted once)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in state.values()}
    return sum(storages.values())


def describe_weights(directory: Path) -> list[str]:
    """`inspect`'s lines: each role's deployed weights, as the index records them."""
    index = parse_yaml((directory / INDEX_FILE).read_text())
    size = (directory / MODELS_FILE).stat().st_size
    lines = [f"{'weights':<10} {directory.name}/{MODELS_FILE}, {size / 1e6:.1f} MB, memory-mapped at load"]
    for role, entry in index.items():
        formats = sorted({p["format"] for p in entry["packed"].values()})
        head = entry.get("trimmed_head")
        lines.append(f"{'':<10} {role}: {entry['name']}, {entry.get('bytes', 0) / 1e6:.1f} MB, linears "
                     f"{'/'.join(formats) or entry['dtype']}, embedding {entry.get('embedding', 'dense')}"
                     + (f", LM head trimmed to {head['kept']} of {head['vocab_size']} tokens" if head else ""))
    return lines


class DeployedWeights:
    """A bundle's weights directory, opened: the index read, the tensors mapped once for both
    roles; load(role) builds that role's model around them."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        try:
            self.index = parse_yaml((directory / INDEX_FILE).read_text())
            self.states = torch.load(directory / MODELS_FILE, mmap=True, weights_only=True, map_location="cpu")
        except Exception as exc:  # a truncated zip, a damaged pickle, a missing file: all one to the user
            raise ModelFileError(f"the deployed weights in {directory} cannot be read "
                                 f"({str(exc).splitlines()[0][:200]})") from None
        self._tokenizers: dict[str, object] = {}  # by directory: a tokenizer the roles share is loaded once
        self._rules: dict[bytes, object] = {}  # by content: a draft with the target's vocabulary parses it once

    def load(self, role: str, device: str) -> LoadedModel:
        started = time.perf_counter()
        entry = self.index.get(role) if isinstance(self.index, dict) else None
        if entry is None or role not in self.states:
            raise ModelFileError(f"the deployed weights in {self.directory} hold no {role} model")
        model = build_model(entry, dict(self.states[role]), device, f"{self.directory / MODELS_FILE} ({role})")
        name = entry.get("tokenizer", f"tokenizer-{role}")
        if name not in self._tokenizers:
            self._tokenizers[name] = load_saved_tokenizer(self.directory / name, self._rules)
        tokenizer = self._tokenizers[name]
        source = ResolvedModel(entry["name"], Path(entry["path"]), entry["format"], entry.get("sha256"))
        return LoadedModel(source, model, tokenizer, time.perf_counter() - started)


def model_config(body: dict) -> ModelConfig:
    scaling = body.get("rope_scaling")
    factors = body.get("rope_freq_factors")
    return ModelConfig(**{**body, "rope_scaling": RopeScaling(**scaling) if scaling else None,
                          "rope_freq_factors": tuple(factors) if factors is not None else None})


def build_model(entry: dict, state: dict[str, torch.Tensor], device: str, source: str) -> Transformer:
    """The Transformer around the mapped tensors: packed linears rebuilt from their buffers,
    everything else assigned; nothing converted or copied (on CPU)."""
    cfg = model_config(entry["config"])
    with torch.device("meta"):
        model = Transformer(cfg)
    prepare_trimmed_head(model, entry)  # a trimmed draft vocabulary's head (yggdrasil/models/vocab.py)
    for name, packed in entry["packed"].items():
        prefix = name + "."
        buffers = {key[len(prefix):]: state.pop(key) for key in list(state) if key.startswith(prefix)}
        parts = {"parts": packed["parts"]} if "parts" in packed else {}  # a MixedLinear's kinds, in order
        module = PACKED_CLASSES[packed["format"]].from_buffers(packed["in_features"], packed["out_features"], buffers,
                                                               **parts)
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr, module)
    if entry.get("embedding") == "blocks":
        buffers = {key.removeprefix("tok_embeddings."): state.pop(key) for key in list(state)
                   if key.startswith("tok_embeddings.")}
        model.tok_embeddings = BlockEmbedding.from_buffers(buffers)
    expected = set(model.state_dict()) - {f"{name}.{b}" for name in [*entry["packed"], "tok_embeddings"]
                                          for b, _ in model.get_submodule(name).named_buffers()}
    if set(state) != expected:
        missing, extra = sorted(expected - set(state)), sorted(set(state) - expected)
        raise ModelFileError(f"{source} does not match its index (missing {missing[:3]}, unexpected {extra[:3]})")
    model.load_state_dict(state, strict=False, assign=True)
    if cfg.tie_embeddings and isinstance(model.output, nn.Linear):
        model.output.weight = model.tok_embeddings.weight
    # non-persistent buffers are not in the file: computed, as a checkpoint load computes them
    model.inv_freq = torch.tensor(cfg.inv_freq(), dtype=torch.float32)
    if entry.get("invariant_ops"):
        model.use_batch_invariant_ops()
    if model.dtype != parse_dtype(entry["dtype"]):
        raise ModelFileError(f"{source} holds {model.dtype} norms, its index says {entry['dtype']}")
    if device != "cpu":
        model = model.to(device)
    return model.eval().requires_grad_(False)
