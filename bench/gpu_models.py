"""The GPU session's models (bench/gpu_session.py, step `models`): random-weight bf16 models of
Qwen2.5-Coder-1.5B's shape on the device, saved as HF folders our loader reads, with a byte-level
tokenizer. The target keeps its first `layers` layers; the draft is the target's first
`draft_layers` (the target's later layers are scaled down, so drafts are mostly accepted)."""

from __future__ import annotations

from pathlib import Path

import torch

# Qwen2.5-Coder-1.5B's shape; the target keeps its first --layers layers, the draft fewer
QWEN_1_5B = dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                 num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=32768,
                 rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True)
TINY = {**QWEN_1_5B, "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512}


def byte_tokenizer(directory: Path) -> None:
    """A byte-level tokenizer.json (ids 0..255), enough to encode any prompt."""
    # tokenizers ships with transformers, which only this step needs (slow to import)
    from tokenizers import Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tokenizer = Tokenizer(BPE(vocab={ch: i for i, ch in enumerate(sorted(alphabet))}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.save(str(directory / "tokenizer.json"))


def random_qwen(shape: dict, device: str):
    import transformers  # slow to import; only the models step needs it

    config = transformers.Qwen2Config(**shape)
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.Qwen2ForCausalLM(config).to(torch.bfloat16)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() > 1:
                param.normal_(0, 0.02 if not name.endswith("embed_tokens.weight") else 1.0)
        for layer in model.model.layers[1:]:  # later layers add little: the draft agrees often
            layer.self_attn.o_proj.weight.mul_(0.05)
            layer.mlp.down_proj.weight.mul_(0.05)
    return model.eval()


def save_draft(target, shape: dict, layers: int, directory: Path, device: str) -> None:
    """The target's first `layers` layers, with its embeddings, norm and head."""
    import transformers  # see random_qwen

    config = transformers.Qwen2Config(**{**shape, "num_hidden_layers": layers})
    with torch.device(device):
        model = transformers.Qwen2ForCausalLM(config).to(torch.bfloat16)
    keep = {k: v for k, v in target.state_dict().items()
            if not k.startswith("model.layers.") or int(k.split(".")[2]) < layers}
    model.load_state_dict(keep)
    model.save_pretrained(directory, safe_serialization=True)


def save_models(out: Path, shape: dict, draft_layers: int | None, device: str) -> None:
    """out/target (and out/draft unless draft_layers is None), each with its tokenizer."""
    target = random_qwen(shape, device)
    for name in ("target", "draft")[:1 if draft_layers is None else 2]:
        directory = out / name
        directory.mkdir(parents=True, exist_ok=True)
        if name == "target":
            target.save_pretrained(directory, safe_serialization=True)
        else:
            save_draft(target, shape, draft_layers, directory, device)
        byte_tokenizer(directory)
