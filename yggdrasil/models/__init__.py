"""The models: the transformer with its static KV cache, the weight formats (quant*), loaders from
GGUF files and HF folders, tokenizers, and the catalog of models the tool knows (docs/design.md §2)."""
