"""Load a Hugging Face checkpoint directory: config.json + (sharded) safetensors."""

from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from yggdrasil.config import ModelConfig, config_from_hf
from yggdrasil.errors import ModelFileError
from yggdrasil.models.model import Transformer
from yggdrasil.progress import Progress
from yggdrasil.models.weights import build_model

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ModelFileError(f"{path} is missing") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelFileError(f"{path} is not valid JSON ({exc}); re-export the checkpoint") from None


def read_hf_config(directory: Path) -> ModelConfig:
    return config_from_hf(read_json(directory / "config.json"))


def weight_map(directory: Path) -> dict[str, Path]:
    """Tensor name → shard file, from the index file or the single safetensors file."""
    index = directory / INDEX_FILE
    if index.exists():
        entries = read_json(index).get("weight_map")
        if not isinstance(entries, dict):
            raise ModelFileError(f"{index} has no weight_map; re-export the checkpoint")
        return {name: directory / shard for name, shard in entries.items()}
    single = directory / SINGLE_FILE
    if not single.exists():
        raise ModelFileError(
            f"{directory} has no {SINGLE_FILE} or {INDEX_FILE}; only safetensors checkpoints are "
            "supported (convert with transformers: model.save_pretrained(dir, safe_serialization=True))"
        )
    with _open_shard(single) as handle:
        return {name: single for name in handle.keys()}


def _open_shard(path: Path):
    if not path.exists():
        raise ModelFileError(f"safetensors shard {path} is missing; re-download or re-export it")
    try:
        return safe_open(str(path), framework="pt", device="cpu")
    except (SafetensorError, OSError, ValueError) as exc:
        raise ModelFileError(
            f"{path} is not a readable safetensors file ({exc}); it may be truncated or corrupt — "
            "re-download or re-export it"
        ) from None


def load_hf_model(directory: Path, dtype: torch.dtype, device: str = "cpu",
                  progress: Progress | None = None) -> Transformer:
    cfg = read_hf_config(directory)
    shards = weight_map(directory)
    with ExitStack() as stack:
        handles: dict[Path, Any] = {}

        def get(name: str) -> torch.Tensor:
            shard = shards.get(name)
            if shard is None:
                raise ModelFileError(f"{directory}: checkpoint has no tensor {name}")
            if shard not in handles:
                handles[shard] = stack.enter_context(_open_shard(shard))
            try:
                return handles[shard].get_tensor(name)
            except (SafetensorError, OSError, ValueError) as exc:
                raise ModelFileError(f"{shard}: cannot read {name} ({exc}); the file is corrupt") from None

        return build_model(cfg, get, dtype, device, source=str(directory), progress=progress)
