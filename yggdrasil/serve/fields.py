"""The OpenAI request fields past plain sampling: messages with tool turns, tools and tool_choice,
response_format, logprobs and the penalties. Each bad value is a 400 naming its field."""

from __future__ import annotations

import json
from typing import Any

from yggdrasil.errors import InvalidRequestError
from yggdrasil.models.tokenizer import Message, Tokenizer
from yggdrasil.runtime.logits import Penalties
from yggdrasil.structured.grammar import Grammar, GrammarEngine
from yggdrasil.structured.tools import ToolSetup, parse_tool_choice, parse_tools, tool_format
from .validation import BadRequest, number, shown

ROLES = ("system", "user", "assistant", "tool")
MAX_TOP_LOGPROBS = 20


def _text(content: Any, where: str, optional: bool = False) -> str:
    if content is None and optional:
        return ""
    if isinstance(content, list):  # content parts: only text is supported
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
            raise BadRequest(f"{where}.content parts must all be {{type: text, text: str}}", f"{where}.content")
        return "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise BadRequest(f"{where}.content must be a string", f"{where}.content")
    return content


def _tool_calls(calls: Any, where: str) -> tuple:
    """An assistant turn's tool_calls, with arguments parsed to objects (as templates read them)."""
    if not isinstance(calls, list):
        raise BadRequest(f"{where}.tool_calls must be a list", f"{where}.tool_calls")
    out = []
    for j, call in enumerate(calls):
        at = f"{where}.tool_calls[{j}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) \
                or not isinstance(call.get("id", ""), str):
            raise BadRequest(f"{at} must be {{id, type: function, function: {{name, arguments}}}}", at)
        try:
            arguments = json.loads(function.get("arguments") or "{}")
        except (TypeError, ValueError):
            raise BadRequest(f"{at}.function.arguments must be a JSON object in a string", f"{at}.function.arguments") from None
        out.append({"id": call.get("id", ""), "type": "function",
                    "function": {"name": function["name"], "arguments": arguments}})
    return tuple(out)


def parse_messages(body: dict) -> list[Message]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' is required: a non-empty list of {role, content} objects", "messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise BadRequest(f"{where} needs a 'role' of {', '.join(ROLES)}", where)
        role = m["role"]
        calls = _tool_calls(m["tool_calls"], where) if role == "assistant" and m.get("tool_calls") else ()
        content = _text(m.get("content"), where, optional=bool(calls))
        if role == "tool":
            call_id = m.get("tool_call_id")
            if not isinstance(call_id, str) or not call_id:
                raise BadRequest(f"{where} is a tool result and needs the 'tool_call_id' of the call it answers",
                                 f"{where}.tool_call_id")
            out.append(Message("tool", content, tool_call_id=call_id, name=m.get("name")))
        else:
            out.append(Message(role, content, tool_calls=calls))
    return out


def parse_tool_setup(body: dict, tokenizer: Tokenizer) -> ToolSetup | None:
    try:
        functions = parse_tools(body.get("tools"))
    except InvalidRequestError as exc:
        raise BadRequest(str(exc), "tools") from None
    try:
        choice, named = parse_tool_choice(body.get("tool_choice"), functions)
    except InvalidRequestError as exc:
        raise BadRequest(str(exc), "tool_choice") from None
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise BadRequest("'parallel_tool_calls' must be true or false", "parallel_tool_calls")
    if not functions:
        return None
    return ToolSetup(functions, choice, named, parallel, tool_format(tokenizer))


def parse_response_format(body: dict, grammars: GrammarEngine) -> Grammar | None:
    """response_format: text (None), json_object, or json_schema {name, schema, strict}."""
    value = body.get("response_format")
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    try:
        if kind == "json_object":
            return grammars.json_object()
        if kind == "json_schema":
            spec = value.get("json_schema")
            if not isinstance(spec, dict) or "schema" not in spec:
                raise BadRequest("'response_format.json_schema' must be {name, schema, strict}",
                                 "response_format.json_schema")
            schema = spec["schema"]
            if spec.get("strict") is True and isinstance(schema, dict):
                schema = strict_schema(schema)
            return grammars.json_schema(schema, "response_format.json_schema.schema")
    except InvalidRequestError as exc:
        raise BadRequest(str(exc), "response_format.json_schema.schema") from None
    raise BadRequest(f"'response_format.type' must be text, json_object or json_schema, got {shown(kind)}",
                     "response_format")


def strict_schema(schema: Any) -> Any:
    """OpenAI's strict mode: objects take no properties beyond those listed, unless they say so."""
    if isinstance(schema, list):
        return [strict_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict_schema(v) for k, v in schema.items()}
    if out.get("type") == "object" and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def parse_logprobs(kind: str, body: dict) -> int | None:
    """How many alternatives each token's log-probability comes with (None: no logprobs).
    chat: logprobs true/false and top_logprobs 0..20; completions: logprobs 0..20."""
    if kind == "completion":
        value = number(body, "logprobs", None, 0, MAX_TOP_LOGPROBS, integer=True)
        return value
    wanted = body.get("logprobs", False)
    if wanted is not None and not isinstance(wanted, bool):
        raise BadRequest("'logprobs' must be true or false", "logprobs")
    top = number(body, "top_logprobs", None, 0, MAX_TOP_LOGPROBS, integer=True)
    if top is not None and not wanted:
        raise BadRequest("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    return (top or 0) if wanted else None


def parse_penalties(body: dict) -> Penalties:
    return Penalties(float(number(body, "presence_penalty", 0.0, -2.0, 2.0)),
                     float(number(body, "frequency_penalty", 0.0, -2.0, 2.0)),
                     float(number(body, "repetition_penalty", 1.0, 0.01, 10.0)))
