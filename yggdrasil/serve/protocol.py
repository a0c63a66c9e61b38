"""The OpenAI request shapes `serve` speaks, validated by hand so every bad field gets an
OpenAI-style 400 that names it and says what is allowed (fields.py holds the fields past plain
sampling: tools, response_format, logprobs, penalties). OpenAI parameters the server does not
implement are refused by name unless they hold their default, and so are names OpenAI does not
have: nothing a client asks for is silently ignored."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from yggdrasil.errors import InvalidRequestError
from yggdrasil.sampling import SamplingParams
from yggdrasil.models.tokenizer import Tokenizer
from yggdrasil.structured.grammar import GrammarEngine, Matcher
from yggdrasil.structured.tools import ToolSetup, grammar_for, prompt_messages
from .fields import parse_logprobs, parse_messages, parse_penalties, parse_response_format, parse_tool_setup
from .requests import GenerationRequest
from .validation import BadRequest, error_body, number, same, shown

MAX_STOPS = 4
SAMPLING = {"model", "max_tokens", "temperature", "top_p", "seed", "stop", "n", "stream", "stream_options",
            "response_format", "logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty"}
# the fields each route implements, and those it accepts and ignores (they change no output)
SUPPORTED = {
    "chat": SAMPLING | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice",
                        "parallel_tool_calls"},
    "completion": SAMPLING | {"prompt"},
}
IGNORED = {"user", "metadata", "store", "service_tier"}
# OpenAI parameters not implemented here: accepted only with these (default) values
UNSUPPORTED = {
    "functions": (None, []), "function_call": (None, "none", "auto"), "logit_bias": (None, {}), "best_of": (None, 1),
    "echo": (None, False), "suffix": (None, ""), "modalities": (None, ["text"]), "audio": (None,),
    "prediction": (None,), "web_search_options": (None,), "reasoning_effort": (None,),
}
__all__ = ["BadRequest", "ParsedRequest", "error_body", "parse_request"]


@dataclass(frozen=True)
class ParsedRequest:
    kind: str  # "chat" or "completion"
    generation: GenerationRequest
    stream: bool
    include_usage: bool
    model: str
    tools: ToolSetup | None = None  # the functions offered and the format the reply is read in
    matcher: Matcher | None = None  # the grammar's parse state for this reply (built off the event loop)


def _refuse_unsupported(kind: str, body: dict) -> None:
    """A 400 naming the first field that is not implemented (unless at its default) or not known."""
    for name, value in body.items():
        if name in SUPPORTED[kind] or name in IGNORED:
            continue
        if name not in UNSUPPORTED:
            raise BadRequest(f"unrecognized request argument supplied: {name!r}; "
                             f"{'chat' if kind == 'chat' else 'completion'} requests take "
                             f"{', '.join(sorted(SUPPORTED[kind]))}", name, code="unsupported_parameter")
        if not any(same(value, default) for default in UNSUPPORTED[name]):
            defaults = " or ".join(json.dumps(d) for d in UNSUPPORTED[name])
            raise BadRequest(f"{name!r} is not supported by this server (yggdrasil serve), got {shown(value)}; "
                             f"leave it out (or send {defaults})", name, code="unsupported_parameter")


def _stops(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops) or len(stops) > MAX_STOPS:
        raise BadRequest(f"'stop' must be a string or a list of up to {MAX_STOPS} strings", "stop")
    return tuple(stops)


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


def _chat_ids(body: dict, tokenizer: Tokenizer, tools: ToolSetup | None) -> list[int]:
    """The conversation rendered by the model's template (with the tools, in their format)."""
    messages = parse_messages(body)
    template_tools = None
    if tools is not None:
        messages, template_tools = prompt_messages(messages, tools)
    try:  # as Tokenizer.encode_chat: the template spells out the special tokens
        return _encode(tokenizer, tokenizer.render_chat(messages, tools=template_tools), add_special_tokens=False)
    except InvalidRequestError as exc:
        raise BadRequest(str(exc), "messages") from None


def parse_request(kind: str, body: Any, tokenizer: Tokenizer, model_name: str, max_context: int,
                  limit_text: str | None = None, grammars: GrammarEngine | None = None) -> ParsedRequest:
    """Validate an OpenAI chat or completion request body into what the engine runs."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    model = body.get("model", model_name)
    if model != model_name:
        raise BadRequest(f"model {shown(model)} is not served here; this server serves {model_name!r} "
                         "(GET /v1/models)", "model", status=404, code="model_not_found")
    _refuse_unsupported(kind, body)
    if body.get("n") is not None and not same(body["n"], 1):
        raise BadRequest(f"'n' must be 1 (this server returns one choice per request), got {shown(body['n'])}",
                         "n", code="unsupported_parameter")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("'stream' must be true or false", "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise BadRequest("'stream_options' must be an object", "stream_options")
    grammars = grammars or GrammarEngine(tokenizer)
    tools = parse_tool_setup(body, tokenizer) if kind == "chat" else None
    ids = _chat_ids(body, tokenizer, tools) if kind == "chat" else _prompt_ids(body, tokenizer)
    limit_text = limit_text or f"the context holds {max_context}"  # or the KV budget, when smaller
    if len(ids) >= max_context:
        raise BadRequest(f"the prompt has {len(ids)} tokens but {limit_text}; shorten the prompt", "messages" if kind == "chat" else "prompt",
                         code="context_length_exceeded")
    room = max_context - len(ids)
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = number(body, name, room, 1, 1 << 31, integer=True)
    if max_tokens > room:
        raise BadRequest(f"{name}={max_tokens} plus the prompt's {len(ids)} tokens exceeds the limit: "
                         f"{limit_text}; ask for at most {room}", name, code="context_length_exceeded")
    seed = number(body, "seed", None, -(1 << 63), (1 << 63) - 1, integer=True)
    try:  # SamplingParams holds the rules the ranges above do not (top_p > 0)
        sampling = SamplingParams(temperature=float(number(body, "temperature", 1.0, 0.0, 2.0)),
                                  top_p=float(number(body, "top_p", 1.0, 0.0, 1.0)), seed=seed)
    except InvalidRequestError as exc:
        raise BadRequest(str(exc)) from None
    logprobs, penalties = parse_logprobs(kind, body), parse_penalties(body)
    grammar = parse_response_format(body, grammars)
    if tools is not None and (tools.forced or tools.format == "generic" and tools.active):
        grammar = grammar_for(tools, grammars)  # a forced call (or the generic format's JSON) wins
    matcher = grammars.matcher(grammar) if grammar is not None else None
    generation = GenerationRequest(tuple(ids), max_tokens, sampling, _stops(body), grammar, penalties, logprobs)
    return ParsedRequest(kind, generation, stream, bool(options.get("include_usage", False)), model_name,
                         tools if tools is not None and tools.active else None, matcher)
