"""The OpenAI request and response shapes `serve` speaks, validated by hand so every bad field
gets an OpenAI-style 400 that names it and says what is allowed. OpenAI parameters the server does
not implement (tools, logprobs, penalties, ...) are refused by name unless they hold their default,
and so are names OpenAI does not have: nothing a client asks for is silently ignored."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

from yggdrasil.errors import InvalidRequestError
from yggdrasil.sampling import SamplingParams
from yggdrasil.models.tokenizer import Message, Tokenizer
from .requests import GenerationRequest, Usage

ROLES = ("system", "user", "assistant")
MAX_STOPS = 4
SHOWN_CHARACTERS = 80  # of a bad value, echoed in its error

# the fields each route implements, and those it accepts and ignores (they change no output)
SUPPORTED = {
    "chat": {"model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "seed", "stop",
             "n", "stream", "stream_options"},
    "completion": {"model", "prompt", "max_tokens", "temperature", "top_p", "seed", "stop", "n", "stream",
                   "stream_options"},
}
IGNORED = {"user", "metadata", "store", "service_tier", "parallel_tool_calls"}
# OpenAI parameters not implemented here: accepted only with these (default) values
UNSUPPORTED = {
    "tools": (None, []), "tool_choice": (None, "none", "auto"), "functions": (None, []),
    "function_call": (None, "none", "auto"), "logprobs": (None, False), "top_logprobs": (None, 0),
    "response_format": (None, {"type": "text"}), "presence_penalty": (None, 0), "frequency_penalty": (None, 0),
    "logit_bias": (None, {}), "best_of": (None, 1), "echo": (None, False), "suffix": (None, ""),
    "modalities": (None, ["text"]), "audio": (None,), "prediction": (None,), "web_search_options": (None,),
    "reasoning_effort": (None,),
}


class BadRequest(Exception):
    """A request the server refuses: HTTP status, OpenAI error type, message, offending field."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 kind: str = "invalid_request_error", code: str | None = None) -> None:
        super().__init__(message)
        self.message, self.param, self.status, self.kind, self.code = message, param, status, kind, code

    def body(self) -> dict:
        return error_body(self.message, self.kind, self.param, self.code)


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


@dataclass(frozen=True)
class ParsedRequest:
    kind: str  # "chat" or "completion"
    generation: GenerationRequest
    stream: bool
    include_usage: bool
    model: str


def _shown(value: Any) -> str:
    """A bad value as JSON for an error message, cut short."""
    text = json.dumps(value)
    return text if len(text) <= SHOWN_CHARACTERS else text[:SHOWN_CHARACTERS] + "..."


def _same(value: Any, default: Any) -> bool:
    """JSON equality that keeps false apart from 0 and 1 apart from true."""
    if isinstance(value, bool) or isinstance(default, bool):
        return value is default
    if isinstance(value, (int, float)) and isinstance(default, (int, float)):
        return value == default
    return type(value) is type(default) and value == default


def _refuse_unsupported(kind: str, body: dict) -> None:
    """A 400 naming the first field that is not implemented (unless at its default) or not known."""
    for name, value in body.items():
        if name in SUPPORTED[kind] or name in IGNORED:
            continue
        if name not in UNSUPPORTED:
            raise BadRequest(f"unrecognized request argument supplied: {name!r}; "
                             f"{'chat' if kind == 'chat' else 'completion'} requests take "
                             f"{', '.join(sorted(SUPPORTED[kind]))}", name, code="unsupported_parameter")
        if not any(_same(value, default) for default in UNSUPPORTED[name]):
            defaults = " or ".join(json.dumps(d) for d in UNSUPPORTED[name])
            raise BadRequest(f"{name!r} is not supported by this server (yggdrasil serve), got {_shown(value)}; "
                             f"leave it out (or send {defaults})", name, code="unsupported_parameter")


def _number(body: dict, name: str, default, low: float, high: float, integer: bool = False):
    value = body.get(name, default)
    if value is None:
        return default
    valid_type = isinstance(value, int) if integer else isinstance(value, (int, float))
    if isinstance(value, bool) or not valid_type:
        raise BadRequest(f"'{name}' must be {'an integer' if integer else 'a number'}, got {_shown(value)}", name)
    if not low <= value <= high:
        raise BadRequest(f"'{name}' must be between {low:g} and {high:g}, got {_shown(value)}", name)
    return value


def _stops(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops) or len(stops) > MAX_STOPS:
        raise BadRequest(f"'stop' must be a string or a list of up to {MAX_STOPS} strings", "stop")
    return tuple(stops)


def _messages(body: dict) -> list[Message]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' is required: a non-empty list of {role, content} objects", "messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise BadRequest(f"{where} needs a 'role' of {', '.join(ROLES)}", where)
        content = m.get("content")
        if isinstance(content, list):  # content parts: only text is supported
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise BadRequest(f"{where}.content parts must all be {{type: text, text: str}}", f"{where}.content")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise BadRequest(f"{where}.content must be a string", f"{where}.content")
        out.append(Message(m["role"], content))
    return out


def _encode(tokenizer: Tokenizer, text: str, add_special_tokens: bool) -> list[int]:
    """Tokenizer.encode without holding the GIL: the tokenizers library's encode_batch releases
    it and its encode does not, so a long prompt (a second for a megabyte) would stop the event
    loop and the engine, though it is tokenized in a worker thread."""
    return tokenizer.inner.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids


def _prompt_ids(body: dict, tokenizer: Tokenizer) -> list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise BadRequest("'prompt' is empty", "prompt")
        return _encode(tokenizer, prompt, add_special_tokens=True)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if not all(0 <= t < tokenizer.vocab_size for t in prompt):
            raise BadRequest(f"'prompt' token ids must be within 0..{tokenizer.vocab_size - 1}", "prompt")
        return list(prompt)
    raise BadRequest("'prompt' is required: a string, a list of one string, or a list of token ids", "prompt")


def parse_request(kind: str, body: Any, tokenizer: Tokenizer, model_name: str, max_context: int,
                  limit_text: str | None = None) -> ParsedRequest:
    """Validate an OpenAI chat or completion request body into what the engine runs."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    model = body.get("model", model_name)
    if model != model_name:
        raise BadRequest(f"model {_shown(model)} is not served here; this server serves {model_name!r} "
                         "(GET /v1/models)", "model", code="model_not_found")
    _refuse_unsupported(kind, body)
    if body.get("n") is not None and not _same(body["n"], 1):
        raise BadRequest(f"'n' must be 1 (this server returns one choice per request), got {_shown(body['n'])}",
                         "n", code="unsupported_parameter")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("'stream' must be true or false", "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise BadRequest("'stream_options' must be an object", "stream_options")
    if kind == "chat":
        try:  # as Tokenizer.encode_chat: the template spells out the special tokens
            ids = _encode(tokenizer, tokenizer.render_chat(_messages(body)), add_special_tokens=False)
        except InvalidRequestError as exc:
            raise BadRequest(str(exc), "messages") from None
    else:
        ids = _prompt_ids(body, tokenizer)
    limit_text = limit_text or f"the context holds {max_context}"  # or the KV budget, when smaller
    if len(ids) >= max_context:
        raise BadRequest(f"the prompt has {len(ids)} tokens but {limit_text}; shorten the prompt", "messages" if kind == "chat" else "prompt",
                         code="context_length_exceeded")
    room = max_context - len(ids)
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _number(body, name, room, 1, 1 << 31, integer=True)
    if max_tokens > room:
        raise BadRequest(f"{name}={max_tokens} plus the prompt's {len(ids)} tokens exceeds the limit: "
                         f"{limit_text}; ask for at most {room}", name, code="context_length_exceeded")
    seed = _number(body, "seed", None, -(1 << 63), (1 << 63) - 1, integer=True)
    try:  # SamplingParams holds the rules the ranges above do not (top_p > 0)
        sampling = SamplingParams(temperature=float(_number(body, "temperature", 1.0, 0.0, 2.0)),
                                  top_p=float(_number(body, "top_p", 1.0, 0.0, 1.0)), seed=seed)
    except InvalidRequestError as exc:
        raise BadRequest(str(exc)) from None
    return ParsedRequest(kind, GenerationRequest(tuple(ids), max_tokens, sampling, _stops(body)), stream,
                         bool(options.get("include_usage", False)), model_name)


# ---- responses ---------------------------------------------------------------------------------
def new_id(kind: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]


def _usage(usage: Usage | None) -> dict | None:
    if usage is None:
        return None
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.total_tokens}


def full_response(req: ParsedRequest, rid: str, text: str, reason: str, usage: Usage) -> dict:
    created = int(time.time())
    if req.kind == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": reason,
                  "logprobs": None}
        return {"id": rid, "object": "chat.completion", "created": created, "model": req.model,
                "choices": [choice], "usage": _usage(usage)}
    choice = {"index": 0, "text": text, "finish_reason": reason, "logprobs": None}
    return {"id": rid, "object": "text_completion", "created": created, "model": req.model,
            "choices": [choice], "usage": _usage(usage)}


def chunk(req: ParsedRequest, rid: str, text: str | None, reason: str | None,
          usage: Usage | None = None, first: bool = False) -> dict:
    """One streamed chunk; usage-only chunks (stream_options.include_usage) have no choices."""
    created = int(time.time())
    if req.kind == "chat":
        delta = {} if text is None else {"content": text}
        if first:
            delta = {"role": "assistant", "content": text or ""}
        choices = [{"index": 0, "delta": delta, "finish_reason": reason, "logprobs": None}]
        body = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": req.model,
                "choices": choices}
    else:
        choices = [{"index": 0, "text": text or "", "finish_reason": reason, "logprobs": None}]
        body = {"id": rid, "object": "text_completion", "created": created, "model": req.model,
                "choices": choices}
    if usage is not None:
        body["choices"], body["usage"] = [], _usage(usage)
    return body
