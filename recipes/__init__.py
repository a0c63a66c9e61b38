"""Shipped compile recipes (YAML), installed as yggdrasil.recipes so `yggdrasil chat` finds its
default recipe wherever the package is installed."""
