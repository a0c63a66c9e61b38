"""Structured output: grammars over a tokenizer (llguidance), JSON schemas, tool calls.

Below the runtime (which masks the target's logits at every node of a verified tree with these
grammars) and above the models (whose tokenizers and chat templates it reads)."""
