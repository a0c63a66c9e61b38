"""The OpenAI response shapes `serve` writes: whole replies and streamed chunks, with their
usage, log-probabilities and tool calls."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Callable

from yggdrasil.structured.tools import ToolCall, parse_reply
from .protocol import ParsedRequest
from .requests import TokenLogprob, Usage

TokenBytes = Callable[[int], bytes]  # a token id's exact bytes (llguidance's view of the vocabulary)


def new_id(kind: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]


def usage_body(usage: Usage | None) -> dict | None:
    if usage is None:
        return None
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.total_tokens, "prompt_tokens_details": {"cached_tokens": usage.cached_tokens}}


def _piece(token: int, token_bytes: TokenBytes) -> tuple[str, list[int]]:
    raw = token_bytes(token)
    return raw.decode("utf-8", errors="replace"), list(raw)


def logprobs_body(kind: str, entries: list[TokenLogprob], token_bytes: TokenBytes, offset: int = 0) -> dict | None:
    """Chat: {content: [{token, logprob, bytes, top_logprobs}]}; completions: the legacy
    {tokens, token_logprobs, top_logprobs, text_offset} (offset: characters before these tokens)."""
    if kind == "chat":
        content = []
        for entry in entries:
            text, raw = _piece(entry.token, token_bytes)
            top = [dict(zip(("token", "bytes"), _piece(t, token_bytes)), logprob=lp) for t, lp in entry.top]
            content.append({"token": text, "logprob": entry.logprob, "bytes": raw, "top_logprobs": top})
        return {"content": content, "refusal": None}
    tokens, offsets = [], []
    for entry in entries:
        offsets.append(offset)
        text = _piece(entry.token, token_bytes)[0]
        tokens.append(text)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{_piece(t, token_bytes)[0]: lp for t, lp in e.top} for e in entries],
            "text_offset": offsets}


@dataclass(frozen=True)
class Reply:
    """A whole reply as the route collected it."""

    text: str
    reason: str
    usage: Usage
    logprobs: list[TokenLogprob]


def full_response(req: ParsedRequest, rid: str, reply: Reply, token_bytes: TokenBytes) -> dict:
    created = int(time.time())
    logprobs = logprobs_body(req.kind, reply.logprobs, token_bytes) if req.generation.logprobs is not None else None
    if req.kind == "chat":
        message: dict = {"role": "assistant", "content": reply.text}
        reason = reply.reason
        if req.tools is not None:
            content, calls = parse_reply(reply.text, req.tools.format)
            message["content"] = content or None
            if calls:
                message["tool_calls"] = [c.openai() for c in calls]
                reason = "tool_calls" if reply.reason == "stop" else reply.reason
        choice = {"index": 0, "message": message, "finish_reason": reason, "logprobs": logprobs}
        body = {"id": rid, "object": "chat.completion", "created": created, "model": req.model,
                "choices": [choice], "usage": usage_body(reply.usage)}
        if req.tools is not None:
            body["tool_format"] = req.tools.format
        return body
    choice = {"index": 0, "text": reply.text, "finish_reason": reply.reason, "logprobs": logprobs}
    return {"id": rid, "object": "text_completion", "created": created, "model": req.model,
            "choices": [choice], "usage": usage_body(reply.usage)}


def chunk(req: ParsedRequest, rid: str, text: str | None, reason: str | None, usage: Usage | None = None,
          first: bool = False, logprobs: dict | None = None, tool_call: dict | None = None) -> dict:
    """One streamed chunk; usage-only chunks (stream_options.include_usage) have no choices.
    tool_call: one entry of delta.tool_calls (call_deltas)."""
    created = int(time.time())
    if req.kind == "chat":
        delta: dict = {} if text is None else {"content": text}
        if first:
            delta = {"role": "assistant", "content": text or ""}
        if tool_call is not None:
            delta["tool_calls"] = [tool_call]
        choices = [{"index": 0, "delta": delta, "finish_reason": reason, "logprobs": logprobs}]
        body = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": req.model,
                "choices": choices}
    else:
        choices = [{"index": 0, "text": text or "", "finish_reason": reason, "logprobs": logprobs}]
        body = {"id": rid, "object": "text_completion", "created": created, "model": req.model,
                "choices": choices}
    if usage is not None:
        body["choices"], body["usage"] = [], usage_body(usage)
    return body


def call_deltas(index: int, call: ToolCall) -> list[dict]:
    """A tool call as OpenAI streams it: its id and name with empty arguments, then the arguments."""
    return [{"index": index, "id": call.id, "type": "function", "function": {"name": call.name, "arguments": ""}},
            {"index": index, "function": {"arguments": call.arguments}}]
