"""Tool calling: the functions a request offers, the format the model writes calls in, the
grammar that forces a call, and the parser that reads calls back out of the reply (streamed too).

Formats (`tool_format`):
- qwen: the chat template takes `tools` and the model writes `<tool_call>\n{"name": ..., "arguments":
  {...}}\n</tool_call>` blocks (Qwen2.5, Hermes-style templates);
- llama3: the template takes `tools` and the model writes `{"name": ..., "parameters": {...}}`
  (Llama 3.1-3.3; several separated by `;`);
- generic: the template knows nothing of tools (SmolLM2): as llama.cpp's server does, the tools are
  described in a system message and the reply is constrained to a JSON object, either
  {"tool_calls": [{"name", "arguments"}]} or {"response": "text"}.
`required` and a named function are enforced by a grammar in every format, so their arguments always
parse and match the function's schema; `auto` leaves a native template's model free (a block that
does not parse stays text).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from yggdrasil.errors import InvalidRequestError
from yggdrasil.models.tokenizer import Message, Tokenizer
from .grammar import Grammar, GrammarEngine

FORMATS = ("qwen", "llama3", "generic")
CHOICES = ("none", "auto", "required")
NAME_PATTERN = re.compile(r"[a-zA-Z0-9_-]{1,64}")
QWEN_OPEN, QWEN_CLOSE = "<tool_call>", "</tool_call>"
# tool calls are written on one line, as the templates show them: at most a space between tokens
CALL_JSON = {"whitespace_flexible": True, "whitespace_pattern": r"\x20?"}
GENERIC_PROMPT = ("You can call these tools (JSON Schema of each function's arguments):\n{tools}\n"
                  "Reply with one JSON object only: {{\"tool_calls\": [{{\"name\": <function name>, \"arguments\": "
                  "<arguments object>}}]}} to call tools, or {{\"response\": <your answer>}} to answer directly.")


@dataclass(frozen=True)
class Function:
    name: str
    description: str
    parameters: dict  # JSON Schema of the arguments object

    def openai(self) -> dict:
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object, as OpenAI sends it

    def openai(self, index: int | None = None) -> dict:
        body = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return body if index is None else {"index": index, **body}


@dataclass(frozen=True)
class ToolSetup:
    """What a request asks of tools: the functions, tool_choice and the format that runs."""

    functions: tuple[Function, ...]
    choice: str  # none | auto | required | named
    named: str | None = None
    parallel: bool = True
    format: str = "generic"

    @property
    def active(self) -> bool:
        return bool(self.functions) and self.choice != "none"

    @property
    def forced(self) -> bool:
        """A call must come (required or a named function)."""
        return self.choice in ("required", "named")


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


# ---- the request ---------------------------------------------------------------------------
def parse_tools(value: Any) -> tuple[Function, ...]:
    """OpenAI `tools` into Functions; InvalidRequestError naming the bad element."""
    if value is None:
        return ()
    if not isinstance(value, list):
        raise InvalidRequestError("'tools' must be a list of {type: function, function: {name, parameters}}")
    out, names = [], set()
    for i, tool in enumerate(value):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise InvalidRequestError(f"{where} must be {{\"type\": \"function\", \"function\": {{...}}}}")
        function = tool["function"]
        name = function.get("name")
        if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
            raise InvalidRequestError(f"{where}.function.name must be 1-64 letters, digits, _ or -, got {name!r}")
        if name in names:
            raise InvalidRequestError(f"{where}.function.name {name!r} is given twice")
        parameters = function.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(parameters, dict):
            raise InvalidRequestError(f"{where}.function.parameters must be a JSON Schema object")
        description = function.get("description", "")
        if not isinstance(description, str):
            raise InvalidRequestError(f"{where}.function.description must be a string")
        names.add(name)
        out.append(Function(name, description, parameters))
    return tuple(out)


def parse_tool_choice(value: Any, functions: tuple[Function, ...]) -> tuple[str, str | None]:
    """(choice, named function) from OpenAI `tool_choice` (default auto with tools, else none)."""
    if value is None:
        return ("auto" if functions else "none"), None
    if isinstance(value, str):
        if value not in CHOICES:
            raise InvalidRequestError(f"'tool_choice' must be none, auto, required or {{type: function, function: "
                                      f"{{name}}}}, got {json.dumps(value)[:80]}")
        if value != "none" and not functions:
            raise InvalidRequestError(f"'tool_choice' {value!r} needs 'tools'")
        return value, None
    name = value.get("function", {}).get("name") if isinstance(value, dict) and value.get("type") == "function" \
        and isinstance(value.get("function"), dict) else None
    if not isinstance(name, str):
        raise InvalidRequestError("'tool_choice' must be none, auto, required or {type: function, function: {name}}")
    if name not in {f.name for f in functions}:
        known = ", ".join(f.name for f in functions) or "none"
        raise InvalidRequestError(f"'tool_choice' names the function {name!r}, which is not in 'tools' (they are: {known})")
    return "named", name


def tool_format(tokenizer: Tokenizer) -> str:
    """The format this model writes tool calls in (see the module doc)."""
    template = tokenizer.chat_template or ""
    if not tokenizer.template_takes_tools:
        return "generic"
    if QWEN_OPEN in template:
        return "qwen"
    if "<|python_tag|>" in template or "<|eot_id|>" in template:
        return "llama3"
    return "generic"


def prompt_messages(messages: list[Message], setup: ToolSetup) -> tuple[list[Message], list[dict] | None]:
    """The messages and the `tools` argument the template is rendered with. A native template
    gets the tools; the generic format describes them in the system message and rewrites tool
    turns (and earlier calls) as text any template renders."""
    if not setup.functions or setup.choice == "none":
        return [_plain(m) for m in messages] if setup.format == "generic" else messages, None
    if setup.format != "generic":
        return messages, [f.openai() for f in setup.functions]
    described = GENERIC_PROMPT.format(tools="\n".join(json.dumps(f.openai()["function"], ensure_ascii=False)
                                                        for f in setup.functions))
    out = [_plain(m) for m in messages]
    if out and out[0].role == "system":
        return [Message("system", out[0].content + "\n\n" + described)] + out[1:], None
    return [Message("system", described)] + out, None


def _plain(message: Message) -> Message:
    """A message any template renders: tool turns as user turns, calls as the generic JSON."""
    if message.role == "tool":
        return Message("user", f"Result of tool call {message.tool_call_id}: {message.content}")
    if message.tool_calls:
        calls = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in message.tool_calls]
        return Message("assistant", json.dumps({"tool_calls": calls}, ensure_ascii=False))
    return message


# ---- the grammar -----------------------------------------------------------------------------
def _call_schema(function: Function, arguments_key: str) -> dict:
    return {"type": "object", "properties": {"name": {"const": function.name}, arguments_key: function.parameters},
            "required": ["name", arguments_key], "additionalProperties": False}


def _lark_json(schema: dict) -> str:
    """A %json body for a Lark grammar, its calls on one line."""
    return json.dumps({**schema, "x-guidance": CALL_JSON}, ensure_ascii=False)


def grammar_for(setup: ToolSetup, engine: GrammarEngine) -> Grammar | None:
    """The grammar a reply follows: a forced call in every format, and the generic format's JSON
    always; None for a native template's `auto` (the model may answer in text)."""
    if not setup.active or (setup.format != "generic" and not setup.forced):
        return None
    functions = [f for f in setup.functions if setup.choice != "named" or f.name == setup.named]
    if setup.format == "generic":
        calls = {"type": "array", "items": {"anyOf": [_call_schema(f, "arguments") for f in functions]}, "minItems": 1}
        if not setup.parallel:
            calls["maxItems"] = 1
        branches = [{"type": "object", "properties": {"tool_calls": calls}, "required": ["tool_calls"],
                     "additionalProperties": False}]
        if not setup.forced:
            branches.append({"type": "object", "properties": {"response": {"type": "string"}},
                             "required": ["response"], "additionalProperties": False})
        return engine.json_schema({"anyOf": branches, "x-guidance": CALL_JSON}, "tools")
    key = "parameters" if setup.format == "llama3" else "arguments"
    body = _lark_json({"anyOf": [_call_schema(f, key) for f in functions]})
    if setup.format == "llama3":
        call, separator = "body", '";" " "?'
    else:
        # an added token is named as one (<tool_call>); a vocabulary without it spells the text
        ends = [t if engine.special_token(t) else json.dumps(t) for t in (QWEN_OPEN, QWEN_CLOSE)]
        call, separator = f'{ends[0]} "\\n" body "\\n" {ends[1]}', '"\\n"'
    repeat = f" ({separator} call)*" if setup.parallel else ""
    return engine.lark(f"start: call{repeat}\ncall: {call}\nbody: %json {body}\n", "tool calls", "tools")


# ---- the reply --------------------------------------------------------------------------------
def _call(body: Any, arguments_key: str) -> ToolCall | None:
    """A ToolCall from a parsed {"name", arguments_key} object, or None if it is not one."""
    if not isinstance(body, dict) or not isinstance(body.get("name"), str):
        return None
    arguments = body.get(arguments_key, body.get("arguments", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(new_call_id(), body["name"], json.dumps(arguments, ensure_ascii=False))


class ToolStream:
    """Reads a reply as it is generated into events: ("content", text) and ("call", ToolCall).
    Text that may begin a call is held back until it is known; the whole-reply parse
    (`parse_reply`) is this same reader over all the text, so streamed and non-streamed replies
    agree."""

    def __init__(self, format: str) -> None:
        self.format, self.buffer, self.in_call, self.started = format, "", False, False

    def push(self, text: str) -> list[tuple[str, Any]]:
        self.buffer += text
        if self.format == "qwen":
            return self._qwen(final=False)
        if self.format == "llama3":
            return self._llama3(final=False)
        return []  # generic: one JSON object, read at the end

    def finish(self) -> list[tuple[str, Any]]:
        if self.format == "qwen":
            events = self._qwen(final=True)
        elif self.format == "llama3":
            events = self._llama3(final=True)
        else:
            events = self._generic(self.buffer)
        self.buffer = ""
        return events

    def _content(self, text: str) -> list[tuple[str, Any]]:
        if not self.started:
            text = text.lstrip()
        self.started = self.started or bool(text)
        return [("content", text)] if text else []

    def _qwen(self, final: bool) -> list[tuple[str, Any]]:
        events = []
        while True:
            if not self.in_call:
                at = self.buffer.find(QWEN_OPEN)
                if at < 0:
                    hold = 0 if final else _partial_suffix(self.buffer, QWEN_OPEN)
                    text = self.buffer[:len(self.buffer) - hold]
                    events += self._content(text if final else text.rstrip())
                    self.buffer = self.buffer[len(text if final else text.rstrip()):]
                    return events
                events += self._content(self.buffer[:at].rstrip())
                self.buffer, self.in_call = self.buffer[at + len(QWEN_OPEN):], True
            end = self.buffer.find(QWEN_CLOSE)
            if end < 0:
                if final:  # an unfinished call (the reply was cut) stays text
                    events += self._content(QWEN_OPEN + self.buffer)
                    self.buffer = ""
                return events
            block, self.buffer, self.in_call = self.buffer[:end], self.buffer[end + len(QWEN_CLOSE):].lstrip(), False
            try:
                call = _call(json.loads(block), "arguments")
            except ValueError:
                call = None
            events.append(("call", call) if call else ("content", QWEN_OPEN + block + QWEN_CLOSE))

    def _llama3(self, final: bool) -> list[tuple[str, Any]]:
        if not self.in_call:
            stripped = self.buffer.lstrip().removeprefix("<|python_tag|>").lstrip()
            if not stripped and not final:
                return []
            if not stripped.startswith("{"):
                text, self.buffer = self.buffer, ""
                return self._content(text)
            self.in_call = True
        if not final:
            return []
        calls = _json_sequence(self.buffer.lstrip().removeprefix("<|python_tag|>"), "parameters")
        return [("call", c) for c in calls] if calls else self._content(self.buffer)

    def _generic(self, text: str) -> list[tuple[str, Any]]:
        try:
            body = json.loads(text)
        except ValueError:
            return self._content(text)
        if isinstance(body, dict) and isinstance(body.get("tool_calls"), list):
            calls = [_call(c, "arguments") for c in body["tool_calls"]]
            if calls and all(calls):
                return [("call", c) for c in calls]
        if isinstance(body, dict) and isinstance(body.get("response"), str) and len(body) == 1:
            return self._content(body["response"])
        return self._content(text)


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of text that begins marker."""
    return max((n for n in range(min(len(marker) - 1, len(text)), 0, -1) if text.endswith(marker[:n])), default=0)


def _json_sequence(text: str, arguments_key: str) -> list[ToolCall]:
    """Calls written as JSON objects one after another (separated by ; or whitespace); [] unless
    the whole text is such calls."""
    decoder, calls, at = json.JSONDecoder(), [], 0
    text = text.strip()
    while at < len(text):
        try:
            body, at = decoder.raw_decode(text, at)
        except ValueError:
            return []
        call = _call(body, arguments_key)
        if call is None:
            return []
        calls.append(call)
        while at < len(text) and text[at] in "; \n\t\r":
            at += 1
    return calls


def parse_reply(text: str, format: str) -> tuple[str, list[ToolCall]]:
    """(content, calls) of a whole reply (the streamed reader over all of it)."""
    reader = ToolStream(format)
    events = reader.push(text) + reader.finish()
    content = "".join(value for kind, value in events if kind == "content")
    return content, [value for kind, value in events if kind == "call"]
