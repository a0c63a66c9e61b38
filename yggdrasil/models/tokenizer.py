"""Tokenizer, chat template and stop tokens for a model, from an HF directory or a GGUF file."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Iterable, Sequence

import yaml
from tokenizers import Tokenizer as HFTokenizer

from yggdrasil.errors import InvalidRequestError, ModelFileError
from yggdrasil.models.gguf_tokenizer import build_tokenizer
from yggdrasil.yaml_files import parse_yaml

# end-of-turn markers used by the chat templates of the families we support
_END_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>", "</s>", "<|end|>")


@dataclass(frozen=True)
class Message:
    role: str
    content: str
    # an assistant turn's tool calls: {"id", "type": "function", "function": {"name", "arguments": dict}}
    tool_calls: tuple = ()
    tool_call_id: str | None = None  # a tool turn answers this call
    name: str | None = None  # a tool turn's function name

    def as_template_dict(self) -> dict:
        """The message as chat templates read it (transformers' apply_chat_template layout)."""
        out: dict = {"role": self.role, "content": self.content}
        if self.tool_calls:
            out["tool_calls"] = [dict(call) for call in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        return out


class Tokenizer:
    """Text ↔ ids, chat formatting and the set of ids that end a reply."""

    def __init__(self, tokenizer: HFTokenizer, *, bos_token: str | None, eos_token: str | None,
                 stop_ids: Iterable[int], chat_template: str | None) -> None:
        self.inner = tokenizer
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.stop_ids = frozenset(stop_ids)
        self.chat_template = chat_template
        self._compiled_template = None  # compiled at the first render: jinja2's import costs 0.1 s of start-up

    @property
    def _template(self):
        if self._compiled_template is None and self.chat_template:
            self._compiled_template = _compile_template(self.chat_template)
        return self._compiled_template

    @property
    def vocab_size(self) -> int:
        return self.inner.get_vocab_size(with_added_tokens=True)

    def fingerprint(self) -> str:
        """Hash of the vocabulary; two models can share a speculation tree only if these match."""
        vocab = sorted(self.inner.get_vocab(with_added_tokens=True).items(), key=lambda kv: kv[1])
        return hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest()[:16]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.inner.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.inner.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_id(self, token: str) -> int | None:
        return self.inner.token_to_id(token)

    @property
    def template_takes_tools(self) -> bool:
        """Whether the chat template renders a `tools` list itself (Qwen2.5, Llama 3.x)."""
        return bool(self.chat_template) and "tools" in self.chat_template

    def render_chat(self, messages: Sequence[Message], add_generation_prompt: bool = True,
                    tools: list[dict] | None = None) -> str:
        """The conversation as the model's template writes it; tools (OpenAI tool objects) are
        handed to the template as transformers' apply_chat_template(tools=...) does."""
        if self._template is None:
            raise InvalidRequestError(
                "this model has no chat template; run without --chat and give a plain prompt"
            )
        from jinja2 import TemplateError  # jinja2 only where a template runs: 0.1 s of every start-up

        try:
            return self._template.render(
                messages=[m.as_template_dict() for m in messages],
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "", eos_token=self.eos_token or "", tools=tools or None,
            )
        except TemplateError as exc:
            raise InvalidRequestError(f"the model's chat template rejected the conversation: {exc}") from None

    def encode_chat(self, messages: Sequence[Message], tools: list[dict] | None = None) -> list[int]:
        # the template already spells out BOS and role markers; adding specials would double them
        return self.encode(self.render_chat(messages, tools=tools), add_special_tokens=False)


def _raise_exception(message: str) -> None:
    from jinja2 import TemplateError  # called from a compiled template: jinja2 is loaded

    raise TemplateError(message)


def _compile_template(source: str):
    # jinja2 only where a template runs: 0.1 s of every start-up
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.filters["tojson"] = lambda value, indent=None: json.dumps(value, ensure_ascii=False, indent=indent)
    try:
        return env.from_string(source)
    except TemplateError as exc:
        raise ModelFileError(f"the model's chat template does not parse: {exc}") from None


def _stop_ids(tokenizer: HFTokenizer, eos_ids: Iterable[int]) -> set[int]:
    stops = {int(i) for i in eos_ids if i is not None}
    for token in _END_TOKENS:
        token_id = tokenizer.token_to_id(token)
        if token_id is not None:
            stops.add(token_id)
    return stops


def _token_text(value: Any) -> str | None:
    # tokenizer_config.json stores special tokens as strings or as {"content": ...} objects
    if isinstance(value, dict):
        return value.get("content")
    return value


def tokenizer_from_hf_dir(directory: Path) -> Tokenizer:
    path = directory / "tokenizer.json"
    if not path.exists():
        raise ModelFileError(f"{directory} has no tokenizer.json (only fast tokenizers are supported)")
    try:
        inner = HFTokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises a bare Exception on parse errors
        raise ModelFileError(f"{path} cannot be read ({exc}); re-export the tokenizer") from None
    tok_cfg = _read_optional_json(directory / "tokenizer_config.json")
    gen_cfg = _read_optional_json(directory / "generation_config.json")
    template = tok_cfg.get("chat_template")
    template_file = directory / "chat_template.jinja"
    if template is None and template_file.exists():
        template = template_file.read_text(encoding="utf-8")
    eos = _token_text(tok_cfg.get("eos_token"))
    eos_ids = gen_cfg.get("eos_token_id", [])
    eos_ids = list(eos_ids) if isinstance(eos_ids, list) else [eos_ids]
    if eos is not None:
        eos_ids.append(inner.token_to_id(eos))
    return Tokenizer(inner, bos_token=_token_text(tok_cfg.get("bos_token")), eos_token=eos,
                     stop_ids=_stop_ids(inner, eos_ids), chat_template=template)


def _read_optional_json(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ModelFileError(f"{path} is not valid JSON ({exc})") from None


def _gguf_cache_file(gguf_path: Path, cache_root: Path) -> Path:
    stat = gguf_path.stat()
    key = f"{gguf_path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"
    return cache_root / "tokenizers" / (hashlib.sha256(key.encode()).hexdigest()[:24] + ".json")


def tokenizer_from_gguf(gguf_path: Path, meta: dict[str, Any], cache_root: Path) -> Tokenizer:
    """Build (or reuse the cached) tokenizer for a GGUF; building a 150k vocab takes seconds."""

    cached = _gguf_cache_file(gguf_path, cache_root)
    inner = None
    if cached.exists():
        try:
            inner = HFTokenizer.from_file(str(cached))
        except Exception:  # a damaged cache entry is rebuilt, never trusted
            inner = None
    if inner is None:
        inner = build_tokenizer(meta)
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = cached.with_suffix(f".tmp{os.getpid()}")
        inner.save(str(tmp))
        os.replace(tmp, cached)
    tokens = meta.get("tokenizer.ggml.tokens", [])

    def token_at(key: str) -> str | None:
        idx = meta.get(key)
        return tokens[idx] if isinstance(idx, int) and 0 <= idx < len(tokens) else None

    eos_ids = [meta.get("tokenizer.ggml.eos_token_id"), meta.get("tokenizer.ggml.eot_token_id")]
    return Tokenizer(inner, bos_token=token_at("tokenizer.ggml.bos_token_id"),
                     eos_token=token_at("tokenizer.ggml.eos_token_id"),
                     stop_ids=_stop_ids(inner, eos_ids),
                     chat_template=meta.get("tokenizer.chat_template"))


SAVED_TOKENIZER, SAVED_SPECIALS = "tokenizer.json", "tokenizer.yaml"


def save_tokenizer(tokenizer: Tokenizer, directory: Path) -> None:
    """The tokenizer as a bundle carries it: its vocabulary and rules (tokenizers' JSON) and the
    specials and chat template, so that a bundle runs without its source model file."""
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.inner.save(str(directory / SAVED_TOKENIZER))
    specials = {"bos_token": tokenizer.bos_token, "eos_token": tokenizer.eos_token,
                "stop_ids": sorted(tokenizer.stop_ids), "chat_template": tokenizer.chat_template}
    (directory / SAVED_SPECIALS).write_text(yaml.safe_dump(specials, sort_keys=False), encoding="utf-8")


def load_saved_tokenizer(directory: Path, parsed: dict[bytes, HFTokenizer] | None = None) -> Tokenizer:
    """What save_tokenizer wrote (ModelFileError naming the file when it cannot be read).
    `parsed` maps a rules file's digest to its parsed rules: a pair whose draft shares the
    target's vocabulary (Qwen's 11 MB file: 0.5 s to parse) then parses it once per start."""
    try:
        rules = (directory / SAVED_TOKENIZER).read_bytes()
        digest = hashlib.blake2b(rules, digest_size=16).digest()
        inner = parsed.get(digest) if parsed is not None else None
        if inner is None:
            inner = HFTokenizer.from_str(rules.decode("utf-8"))
            if parsed is not None:
                parsed[digest] = inner
        specials = parse_yaml((directory / SAVED_SPECIALS).read_text(encoding="utf-8"))
        return Tokenizer(inner, bos_token=specials["bos_token"], eos_token=specials["eos_token"],
                         stop_ids=specials["stop_ids"], chat_template=specials["chat_template"])
    except Exception as exc:  # tokenizers raises bare Exceptions; a damaged yaml is no better
        raise ModelFileError(f"the tokenizer in {directory} cannot be read ({str(exc).splitlines()[0]})") from None


class TextStream:
    """Turns a growing list of token ids into text deltas, holding back partial UTF-8 sequences."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self._prefix = 0  # decode from here so merges at the boundary come out right
        self._read = 0  # ids up to here have been emitted as text

    def push(self, new_ids: Sequence[int]) -> str:
        self.ids.extend(new_ids)
        prefix_text = self.tokenizer.decode(self.ids[self._prefix:self._read])
        full_text = self.tokenizer.decode(self.ids[self._prefix:])
        if full_text.endswith("\ufffd") or len(full_text) <= len(prefix_text):
            return ""  # an incomplete multi-byte character: wait for the next token
        self._prefix, self._read = self._read, len(self.ids)
        return full_text[len(prefix_text):]

    def finish(self) -> str:
        """Whatever is still held back (e.g. a dangling partial character) at the end."""
        rest = self.tokenizer.decode(self.ids[self._prefix:])
        held = self.tokenizer.decode(self.ids[self._prefix:self._read])
        self._prefix = self._read = len(self.ids)
        return rest[len(held):]
