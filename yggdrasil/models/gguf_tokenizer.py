"""Build a Hugging Face `tokenizers.Tokenizer` from the tokenizer a GGUF file describes.

A GGUF carries no `tokenizer.json`; llama.cpp stores the vocabulary, merges and special token ids as
metadata instead. We rebuild the tokenizer from those keys so that it encodes exactly like
transformers' GGUF loader (`AutoTokenizer.from_pretrained(dir, gguf_file=name)`), without needing
transformers at run time.

    tokenizer = build_tokenizer(GGUFFile(path).metadata)
"""

from __future__ import annotations

from functools import lru_cache


from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from yggdrasil.errors import UnsupportedModelError

# llama.cpp's token types (tokenizer.ggml.token_type).
TOKEN_CONTROL = 3
TOKEN_USER_DEFINED = 4

# GPT-2's own split; `pre_tokenizers.ByteLevel(use_regex=True)` applies it. SmolLM2's original
# tokenizer splits digits one by one first, but its vocabulary has no token of two digits or a
# digit after a space, so the plain GPT-2 split gives the same ids (and is what transformers uses).
_GPT2_SPLIT = None

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Qwen2 is Llama-3's split with digits taken one at a time.
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")

# tokenizer.ggml.pre -> the regex that cuts text into words before BPE (None: GPT-2's).
PRE_TOKENIZER_SPLITS: dict[str, str | None] = {
    "default": _GPT2_SPLIT,
    "gpt2": _GPT2_SPLIT,
    "smollm": _GPT2_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
}

SUPPORTED_TOKENIZER_MODELS = ("gpt2",)


# --------------------------------------------------------------------------------------------
# Tokenizer


def build_tokenizer(meta: dict) -> Tokenizer:
    """A `tokenizers.Tokenizer` for the `tokenizer.ggml.*` keys of a GGUF's metadata."""
    kind = meta.get("tokenizer.ggml.model")
    if kind not in SUPPORTED_TOKENIZER_MODELS:
        raise UnsupportedModelError(
            f"GGUF tokenizer model {kind!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_TOKENIZER_MODELS)} (byte-level BPE)."
        )
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZER_SPLITS:
        raise UnsupportedModelError(
            f"GGUF pre-tokenizer {pre!r} is not supported; "
            f"supported: {', '.join(sorted(PRE_TOKENIZER_SPLITS))}."
        )
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    special_ids = _special_ids(meta, types)
    user_ids = sorted({i for i, t in enumerate(types) if t == TOKEN_USER_DEFINED} - set(special_ids))

    tokenizer = Tokenizer(_byte_level_bpe(meta, tokens, {*special_ids, *user_ids}))
    tokenizer.pre_tokenizer = _pre_tokenizer(PRE_TOKENIZER_SPLITS[pre])
    tokenizer.decoder = decoders.ByteLevel()
    # Special: matched whole in text and dropped by decode(skip_special_tokens=True).
    # User-defined (like `<tool_call>`): matched whole, but kept on decode.
    tokenizer.add_special_tokens([_added(tokens[i], special=True) for i in special_ids])
    tokenizer.add_tokens([_added(tokens[i], special=False) for i in user_ids])
    tokenizer.post_processor = _post_processor(meta, tokens)
    return tokenizer


def _special_ids(meta: dict, types: list[int]) -> list[int]:
    """Control tokens, plus the bos/eos/unk/pad tokens even where the file does not mark them."""
    ids = {i for i, t in enumerate(types) if t == TOKEN_CONTROL}
    for key in ("bos", "eos", "unknown", "padding"):
        token_id = meta.get(f"tokenizer.ggml.{key}_token_id")
        if token_id is not None and 0 <= token_id < len(types):
            ids.add(token_id)
    return sorted(ids)


def _byte_level_bpe(meta: dict, tokens: list[str], added_ids: set[int]) -> models.BPE:
    spell = _byte_spelling()
    alphabet = set(spell.values())
    vocab = {}
    for i, token in enumerate(tokens):
        # Ordinary tokens are stored in GPT-2's byte alphabet; respell the odd one stored as raw
        # text. Added tokens are matched as raw text, so they keep their spelling.
        if i not in added_ids and not set(token) <= alphabet:
            token = "".join(spell[b] for b in token.encode("utf-8"))
        vocab[token] = i
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    return models.BPE(vocab=vocab, merges=merges, fuse_unk=False)


@lru_cache(maxsize=1)
def _byte_spelling() -> dict[int, str]:
    """GPT-2's byte -> printable character map: printable bytes stand for themselves, the rest
    (space, control bytes, ...) are moved up to code points from 256 on, in byte order."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)]
    spelling = {b: chr(b) for b in kept}
    moved = (b for b in range(256) if b not in spelling)
    spelling.update({b: chr(256 + n) for n, b in enumerate(moved)})
    return spelling


def _pre_tokenizer(split: str | None) -> pre_tokenizers.PreTokenizer:
    if split is None:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def _added(content: str, special: bool) -> AddedToken:
    # normalized=False: match the text as written, before any byte-level respelling.
    return AddedToken(content, special=special, normalized=False)


def _post_processor(meta: dict, tokens: list[str]) -> processors.TemplateProcessing:
    """Add BOS/EOS around each sequence only where the file asks for it."""
    before, after, specials = "", "", []
    if meta.get("tokenizer.ggml.add_bos_token", False):
        before, bos = _flagged_token(meta, tokens, "bos")
        specials.append(bos)
    if meta.get("tokenizer.ggml.add_eos_token", False):
        after, eos = _flagged_token(meta, tokens, "eos")
        specials.append(eos)

    def seq(name: str, type_id: int) -> str:
        return " ".join(f"{piece}:{type_id}" for piece in (before, f"${name}", after) if piece)

    return processors.TemplateProcessing(
        single=seq("A", 0), pair=f"{seq('A', 0)} {seq('B', 1)}", special_tokens=list(dict.fromkeys(specials))
    )


def _flagged_token(meta: dict, tokens: list[str], key: str) -> tuple[str, tuple[str, int]]:
    token_id = meta.get(f"tokenizer.ggml.{key}_token_id")
    if token_id is None or not 0 <= token_id < len(tokens):
        raise UnsupportedModelError(f"GGUF asks to add a {key} token but gives no valid {key}_token_id")
    return tokens[token_id], (tokens[token_id], token_id)
