"""Shipped compile recipes (YAML), installed as yggdrasil.recipes so `yggdrasil chat` finds its
default recipe wherever the package is installed."""

from importlib.resources import files
from pathlib import Path


def shipped_recipe(name: str) -> Path:
    """The installed recipe file of this name (which may not exist)."""
    return Path(str(files(__name__) / f"{name}.yaml"))
