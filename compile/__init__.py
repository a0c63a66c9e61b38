"""Ahead-of-time compilation of a recipe into a graph bundle (imported as yggdrasil.compile)."""
