"""The read side of a graph bundle, what an edge box needs to open one: its file layout, the
manifest's schema and checks, the per-bucket graph registry, Inductor's saved steps, CUDA-graph
capture and model digests. Writing a bundle is graphs/ (yggdrasil.graphs), a layer above."""
