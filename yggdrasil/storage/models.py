"""Model identity for bundles: the sha256 a bundle records for each model file it was built for."""

from __future__ import annotations

import hashlib
from pathlib import Path


def model_digest(source) -> str:
    """The catalog's verified sha256, or for a user path the sha256 over its weight and config
    files (a bundle must notice when a user's model changes too)."""
    if source.sha256:
        return source.sha256
    path = Path(source.path)
    files = [path] if path.is_file() else sorted(
        p for p in path.iterdir() if p.suffix in (".safetensors", ".json", ".gguf", ".bin"))
    digest = hashlib.sha256()
    for file in files:
        digest.update(file.name.encode())
        with open(file, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()
