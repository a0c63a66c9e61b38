"""The graph bundle format and the per-bucket graph registry (imported as yggdrasil.graphs)."""
