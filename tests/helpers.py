"""Shared test utilities: tiny random HF checkpoints and plain reference decoding."""

from __future__ import annotations

from pathlib import Path

import torch

TINY_LLAMA = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False)
TINY_QWEN2 = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True)


def tiny_profile(draft=((1, 0.02), (2, 0.025), (4, 0.03)), verify=((1, 1.0), (2, 1.1), (4, 1.3))):
    """Fixed CPU-like step times for the tiny recipe's builds (cheap drafting, verify cost growing
    with rows): what speculation pays, and so what a tiny bundle runs, is the same on every machine."""
    from yggdrasil.runtime.latency import LatencyProfile

    return LatencyProfile(draft=draft, verify=verify)


def tiny_piece_seconds(runner) -> dict[str, float]:
    """Fixed CPU-like forward times for a tiny bundle's graphs (a fixed cost plus one per row),
    in place of measure_piece_seconds: which graphs prefill a prompt is then the same on every
    machine (a 5-token prompt: verify_w4 and decode_w1 rather than the 16-row chunk)."""
    return {key.name: 0.002 + 0.001 * key.rows for key in runner.graphs.keys
            if key.stage in ("prefill", "decode", "verify", "draft_head", "draft_step")}

def save_random_hf_model(directory: Path, arch: str, seed: int = 0, **overrides):
    """Write a random-weight HF checkpoint (config.json + safetensors) and return the HF model."""
    import transformers

    torch.manual_seed(seed)
    if arch == "llama":
        config = transformers.LlamaConfig(**{**TINY_LLAMA, **overrides})
        model = transformers.LlamaForCausalLM(config)
    elif arch == "qwen2":
        config = transformers.Qwen2Config(**{**TINY_QWEN2, **overrides})
        model = transformers.Qwen2ForCausalLM(config)
    else:
        raise ValueError(arch)
    # random init gives tiny weights; widen the spread so logits are not all near-equal
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    model.eval()
    model.save_pretrained(directory, safe_serialization=True)
    save_byte_tokenizer(directory)
    return model


def save_byte_tokenizer(directory: Path) -> None:
    """A 256-token byte-level tokenizer.json (one id per byte), enough to drive the CLI."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.save(str(Path(directory) / "tokenizer.json"))


def hf_greedy(model, prompt_ids: list[int], n: int) -> list[int]:
    """Greedy continuation with the HF model, one token at a time, no stop tokens."""
    ids = torch.tensor([prompt_ids])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                         do_sample=False, pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt_ids):].tolist()


def save_tiny_pair(directory: Path, target_layers: int = 2, later_layers_scale: float = 0.04, **overrides) -> None:
    """A target and a cheap draft that agrees with it: the target's layers after the first add
    almost nothing to the residual stream, and the draft is that first layer alone (same
    embeddings, norm and head). Speculation then pays even on a tiny model: the draft costs a
    fraction of a target step and nearly every drafted token is accepted. Two layers by default:
    every compiled graph's cost grows with the layers (about 3 s a layer on a 2-core Xeon), and
    the suite compiles the pair's graphs many times. The second layer's scale keeps the draft as
    right as the 8 layers at 0.02 that the suite's tests were written on: measured, the draft's
    greedy argmax agrees with the target's on 91.5 % of positions (8 layers at 0.02: 91.4 %)."""
    import transformers

    target = save_random_hf_model(directory / "tiny-random", "llama", num_hidden_layers=target_layers, **overrides)
    with torch.no_grad():
        for layer in target.model.layers[1:]:
            layer.self_attn.o_proj.weight.mul_(later_layers_scale)
            layer.mlp.down_proj.weight.mul_(later_layers_scale)
    target.save_pretrained(directory / "tiny-random", safe_serialization=True)
    draft = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**TINY_LLAMA, **overrides, "num_hidden_layers": 1}))
    draft.load_state_dict({k: v for k, v in target.state_dict().items()
                           if not k.startswith("model.layers.") or k.startswith("model.layers.0.")})
    draft.save_pretrained(directory / "tiny-draft", safe_serialization=True)
    save_byte_tokenizer(directory / "tiny-draft")


# the 8-layer pair the eager tests of outputs (serve scheduling, tool calls, format verdicts) were
# written on: eager only, where layers cost no compile time
EIGHT_LAYER_PAIR = dict(target_layers=8, later_layers_scale=0.02)

TINY_RECIPE = Path(__file__).parent.parent / "recipes" / "tiny-random-cpu.yaml"
TINY_WORDS = ["alpha", "beta", "gamma", "delta", "tree", "leaf", "root", "graph"]


def write_tiny_recipe_dir(directory: Path, prompts: list[str] | None = None, **overrides) -> Path:
    """The tiny recipe with its random model pair and calibration prompt file next to it
    (overrides: of the models' config, e.g. vocab_size)."""
    import json
    import shutil

    directory.mkdir(parents=True, exist_ok=True)
    save_tiny_pair(directory, **overrides)
    prompts = prompts or [" ".join(TINY_WORDS[(i * 3 + k) % 8] for k in range(3 + i % 4)) for i in range(40)]
    with open(directory / "tiny-prompts.jsonl", "w") as f:
        for prompt in prompts:
            f.write(json.dumps({"prompt": prompt}) + "\n")
    shutil.copy(TINY_RECIPE, directory / "tiny.yaml")
    return directory / "tiny.yaml"


def write_formats_recipe(root: Path, name: str, weights: str, **quality) -> Path:
    """The tiny target (from write_tiny_recipe_dir(root)) with prompt lookup, few graphs (prefill,
    decode, verify 4; no serve graph: nothing serves these bundles), the weight format named and
    short quality measurements."""
    import yaml

    raw = yaml.safe_load((root / "tiny.yaml").read_text())
    raw.update(weights=weights, draft="lookup", quality={"agreement_tokens": 64, "heldout_tokens": 64, **quality},
               serve_graphs=False)
    raw["buckets"].update(draft_widths=[1, 2], verify_widths=[4])
    raw["calibration"].update(num_prompts=6, max_new_tokens=16)
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def format_profile():
    """Fixed CPU-like step times for the formats phase (as the tiny_bundle fixture uses): what is
    chosen does not depend on how busy this machine is; timing belongs to bench/formats.py."""
    return tiny_profile(draft=((1, 0.0),), verify=((1, 1.0), (2, 1.1), (4, 1.3), (16, 2.0)))


def write_tiny_chat_recipe_dir(directory: Path, name: str, max_context: int) -> Path:
    """The tiny recipe (named `name`, `max_context` long) over the tiny pair with a word-level
    chat tokenizer, whose <|end|> (id 2) never wins greedily: reply lengths are the test's."""
    import yaml
    from safetensors.torch import load_file, save_file

    prompts = [" ".join(f"w{5 + (i * 7 + k * 3) % 60}" for k in range(4 + i % 5)) for i in range(40)]
    recipe_path = write_tiny_recipe_dir(directory, prompts)
    for model in ("tiny-random", "tiny-draft"):
        save_word_chat_tokenizer(directory / model)
        path = directory / model / "model.safetensors"
        weights = load_file(path)
        weights["lm_head.weight"][2] = 0.0
        save_file(weights, path, metadata={"format": "pt"})
    recipe = yaml.safe_load(recipe_path.read_text())
    recipe.update(name=name, max_context=max_context)
    recipe_path.write_text(yaml.safe_dump(recipe))
    return recipe_path


CHAT_SPECIALS = ["[UNK]", "<|system|>", "<|end|>", "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|> {{ m.content }} <|end|> {% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|> {% endif %}")


def save_word_chat_tokenizer(directory: Path, vocab_size: int = 256) -> list[str]:
    """A word-level tokenizer whose every id sequence decodes to text that encodes back to the
    same ids (words joined by spaces), with a chat template and <|end|> (id 2, the Llama
    default eos) ending a turn. Returns the plain words (ids 5..)."""
    import json

    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    words = [f"w{i}" for i in range(len(CHAT_SPECIALS), vocab_size)]
    vocab = {token: i for i, token in enumerate(CHAT_SPECIALS + words)}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens([AddedToken(t, special=True) for t in CHAT_SPECIALS])
    tokenizer.save(str(Path(directory) / "tokenizer.json"))
    config = {"chat_template": CHAT_TEMPLATE, "eos_token": "<|end|>", "bos_token": None}
    (Path(directory) / "tokenizer_config.json").write_text(json.dumps(config))
    return words


class FakeResult:
    """A generate result carrying only its tokens (what bench's harness reads)."""

    def __init__(self, tokens):
        self.tokens = tokens


def forbid_model_conversion(monkeypatch) -> None:
    """Make every way of reading a model file, converting, quantizing or packing weights fail:
    opening a bundle that carries its deployed weights must do none of them (issue 41)."""
    import yggdrasil.bundle as bundle
    import yggdrasil.models.gguf_file as gguf_file
    import yggdrasil.models.hf_loader as hf_loader
    import yggdrasil.kernels as kernels
    import yggdrasil.kernels.pack as pack
    import yggdrasil.models.quant as quant
    import yggdrasil.kernels.pack_k as pack_k
    import yggdrasil.models.quant_blocks as quant_blocks
    import yggdrasil.models.quant_gguf as quant_gguf
    import yggdrasil.models.quant_q4 as quant_q4

    def refuse(what):
        def call(*args, **kwargs):
            raise AssertionError(f"opening a bundle called {what}")
        return call

    for module, names in ((bundle, ("load",)), (hf_loader, ("load_hf_model",)),
                          (quant, ("apply_weight_format", "packed_linear", "quantize_int8", "quantize_int4")),
                          (quant_gguf, ("decode_q4_blocks", "decode_q4_dm", "decode_q8_0")),
                          (quant_q4, ("q4_modules",)),
                          *((m, ("pack_q4", "pack_q8", "quantize_q4", "quantize_q8", "pack_gguf_q4", "pack_gguf_q8_0"))
                            for m in (kernels, pack)),
                          *((m, ("pack_q4_0", "pack_q4_k", "pack_q6_k", "pack_gguf_q4_0", "pack_gguf_q4_k",
                                 "pack_gguf_q6_k", "quantize_q6_k")) for m in (kernels, pack_k)),
                          (pack_k, ("decode_q4_k", "decode_q6_k"))):
        for name in names:
            monkeypatch.setattr(module, name, refuse(f"{module.__name__}.{name}"))
    monkeypatch.setattr(gguf_file.GGUFFile, "__init__", refuse("GGUFFile"))
    for cls in (quant.BF16Linear, quant.Int8Linear, quant.Int4Linear, quant_blocks.MixedLinear,
                *quant_blocks.BLOCK_CLASSES.values()):
        monkeypatch.setattr(cls, "__init__", refuse(f"{cls.__name__}() (packing)"))


# A byte-level vocabulary (any text, JSON included) with ChatML's markers and Qwen2.5's tool-call
# tokens after the 256 bytes, and a chat template that renders tools, tool calls and tool results
# as Qwen2.5's does (shortened)
JSON_CHAT_SPECIALS = ["<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"]
JSON_CHAT_VOCAB = 256 + len(JSON_CHAT_SPECIALS)
QWEN_LIKE_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n{% if messages[0].role == 'system' %}{{ messages[0].content }}\n{% endif %}"
    "# Tools\n<tools>{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools>\nCall a function as "
    "<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n"
    "{%- elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n{%- endif %}"
    "{%- for m in messages %}{%- if m.role == 'user' or (m.role == 'assistant' and not m.tool_calls) %}"
    "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
    "{%- elif m.role == 'assistant' %}<|im_start|>assistant{% if m.content %}\n{{ m.content }}{% endif %}"
    "{%- for call in m.tool_calls %}\n<tool_call>\n{\"name\": \"{{ call.function.name }}\", \"arguments\": "
    "{{ call.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{%- elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{%- endif %}{%- endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def save_json_chat_tokenizer(directory: Path, template: str | None = QWEN_LIKE_TEMPLATE) -> None:
    """save_byte_tokenizer plus the specials above (ids 256..259), <|im_end|> ending a turn and
    a Qwen-like template (None: no template)."""
    import json

    from tokenizers import AddedToken, Tokenizer

    save_byte_tokenizer(directory)
    tokenizer = Tokenizer.from_file(str(Path(directory) / "tokenizer.json"))
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) if "tool" in t
                          else AddedToken(t, special=True, normalized=False) for t in JSON_CHAT_SPECIALS])
    tokenizer.save(str(Path(directory) / "tokenizer.json"))
    config = {"eos_token": "<|im_end|>", "bos_token": None, **({"chat_template": template} if template else {})}
    (Path(directory) / "tokenizer_config.json").write_text(json.dumps(config))


def write_tiny_json_recipe_dir(directory: Path, name: str, max_context: int = 512,
                               template: str | None = QWEN_LIKE_TEMPLATE) -> Path:
    """The tiny recipe (named `name`) over the tiny pair with the byte-level ChatML vocabulary
    above: it can write any JSON, and its replies end with <|im_end|>."""
    import yaml

    recipe_path = write_tiny_recipe_dir(directory, vocab_size=JSON_CHAT_VOCAB)
    for model in ("tiny-random", "tiny-draft"):
        save_json_chat_tokenizer(directory / model, template)
    recipe = yaml.safe_load(recipe_path.read_text())
    recipe.update(name=name, max_context=max_context)
    recipe["calibration"].update(num_prompts=8, max_new_tokens=24)
    recipe_path.write_text(yaml.safe_dump(recipe))
    return recipe_path
