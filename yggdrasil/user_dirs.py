"""Where yggdrasil keeps what it downloads and builds for this user (models, kernels, work caches)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """$YGGDRASIL_CACHE_DIR, else $XDG_CACHE_HOME/yggdrasil, else ~/.cache/yggdrasil."""
    if os.environ.get("YGGDRASIL_CACHE_DIR"):
        return Path(os.environ["YGGDRASIL_CACHE_DIR"]).expanduser().absolute()
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]).expanduser().absolute() / "yggdrasil"
    return Path.home() / ".cache" / "yggdrasil"
