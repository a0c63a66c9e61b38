"""Grammars and their token masks, through llguidance (docs/cli.md, "Structured output").

Why llguidance rather than xgrammar: it is one self-contained wheel with no dependency (xgrammar
pulls triton and a TVM runtime, and is built around torch tensors), its matcher computes a mask in
tens of microseconds for JSON schemas on a 150k vocabulary, and it rolls back consumed tokens, which
is what masking every node of a speculation tree needs (consume down a branch, roll back up).

A GrammarEngine belongs to one tokenizer: it builds llguidance's view of the vocabulary once
(0.2 s for SmolLM2, 1 s for Qwen's 150k tokens) and compiles grammars against it. A Matcher is
one reply's parse state. `node_masks` gives the allowed tokens at every node of a tree whose root
is the last committed token: node j's row is the state after the tokens on its path, so the
target's logits at node j are masked by exactly what plain decoding would mask them by there.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from typing import Any, Sequence

import llguidance
import numpy as np

from yggdrasil.errors import InvalidRequestError
from yggdrasil.models.tokenizer import Tokenizer

# whitespace between JSON tokens: flexible, but a bounded run, so a model cannot loop on it
JSON_OPTIONS = {"whitespace_flexible": True, "whitespace_pattern": r"[\x20\x0A\x0D\x09]{0,16}"}
ALL_ALLOWED = -1  # an int32 word with every bit set


@dataclass(frozen=True)
class Grammar:
    """A compiled-to-text llguidance grammar and what it came from (for messages)."""

    text: str
    source: str  # "json_schema", "json_object", "tool calls", "lark"


def read_json_file(path: str, flag: str):
    """A JSON file a flag names (--json-schema, --tools), or one clear InvalidRequestError."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except OSError as exc:
        raise InvalidRequestError(f"{flag} {path}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise InvalidRequestError(f"{flag} {path} is not valid JSON: {exc}") from None


def schema_of(document, flag: str = "--json-schema") -> dict:
    """A JSON Schema, given bare or as OpenAI's response_format.json_schema ({name, schema, strict})."""
    if isinstance(document, dict) and isinstance(document.get("schema"), dict) and "name" in document:
        return document["schema"]
    if not isinstance(document, dict):
        raise InvalidRequestError(f"{flag} must hold a JSON Schema object")
    return document


class GrammarEngine:
    """Grammars over one tokenizer; the vocabulary view is built on first use (thread-safe)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._ll = None
        self._lock = threading.Lock()

    @property
    def ll_tokenizer(self):
        with self._lock:
            if self._ll is None:
                stops = sorted(self.tokenizer.stop_ids)
                self._ll = llguidance.LLTokenizer(self.tokenizer.inner.to_str(), n_vocab=self.tokenizer.vocab_size,
                                                  eos_token=stops or None)
            return self._ll

    @property
    def words(self) -> int:
        """int32 words of one mask row."""
        return (self.ll_tokenizer.vocab_size + 31) // 32

    def _checked(self, text: str, source: str, field: str) -> Grammar:
        error = llguidance.LLMatcher.validate_grammar(text, self.ll_tokenizer)
        if error and not error.startswith("WARNING"):
            raise InvalidRequestError(f"{field}: {error.splitlines()[0][:300]}")
        return Grammar(text, source)

    def json_schema(self, schema: Any, field: str = "json_schema") -> Grammar:
        """A grammar for JSON matching `schema` (a dict); InvalidRequestError naming `field`."""
        if not isinstance(schema, dict):
            raise InvalidRequestError(f"{field} must be a JSON Schema object, got {json.dumps(schema)[:80]}")
        try:
            text = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=dict(JSON_OPTIONS))
        except (ValueError, TypeError) as exc:
            raise InvalidRequestError(f"{field} is not a usable JSON Schema: {exc}") from None
        return self._checked(text, "json_schema", field)

    def json_object(self) -> Grammar:
        """Any JSON object (response_format json_object)."""
        return self.json_schema({"type": "object"}, "response_format")

    def lark(self, text: str, source: str, field: str) -> Grammar:
        return self._checked(llguidance.LLMatcher.grammar_from_lark(text), source, field)

    def special_token(self, text: str) -> bool:
        """Whether `text` is one added token of this vocabulary (a grammar then names it <text>)."""
        token = self.tokenizer.token_id(text)
        return token is not None and self.ll_tokenizer.is_special_token(token)

    def matcher(self, grammar: Grammar) -> "Matcher":
        inner = llguidance.LLMatcher(self.ll_tokenizer, grammar.text, log_level=0)
        if inner.is_error():
            raise InvalidRequestError(f"{grammar.source}: {inner.get_error().splitlines()[0][:300]}")
        return Matcher(inner, self.words)


class Matcher:
    """One reply's parse state: consume committed tokens, mask the next one."""

    def __init__(self, inner, words: int) -> None:
        self.inner, self.words = inner, words

    def consume(self, token: int) -> bool:
        """Advance by a committed token; False if the grammar forbids it (the state is then broken)."""
        return bool(self.inner.consume_token(int(token)))

    @property
    def finished(self) -> bool:
        """Nothing more can follow (but the end of the reply)."""
        return self.inner.is_stopped()

    @property
    def failed(self) -> str:
        return self.inner.get_error() if self.inner.is_error() else ""

    def fill(self, row: np.ndarray) -> None:
        """The allowed next tokens into row (int32 [words], bit t of word t // 32)."""
        self.inner.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)

    def node_masks(self, tokens: Sequence[int], parents: Sequence[int]) -> np.ndarray:
        """[n, words] the allowed next token at each node of a tree (node 0 the root, whose state
        is this matcher's; parents before children). A node whose own token its parent's mask
        forbids can never be reached by the walk: its row (and its subtree's) allows everything,
        as does a row with nothing allowed (past the end of the grammar), so that logits stay finite."""
        n = len(tokens)
        out = np.full((n, self.words), ALL_ALLOWED, dtype=np.int32)
        children: list[list[int]] = [[] for _ in range(n)]
        for j in range(1, n):
            children[parents[j]].append(j)
        self._visit(0, tokens, children, out)
        return out

    def _visit(self, node: int, tokens: Sequence[int], children: list[list[int]], out: np.ndarray) -> None:
        row = out[node]
        self.fill(row)
        if not row.any():
            row[:] = ALL_ALLOWED
            return
        for child in children[node]:
            token = int(tokens[child])
            if (row[token >> 5] >> (token & 31)) & 1 and self.inner.consume_token(token):
                self._visit(child, tokens, children, out)
                self.inner.rollback(1)
