"""A multi-turn chat over a bundle (the logic behind `yggdrasil chat`; no terminal I/O here).

Each turn renders the whole conversation with the model's chat template and tokenizes it, then
prefills only what the caches do not already hold: the common prefix of the new prompt and the
tokens whose K/V the last turn left in the cache (docs/design.md §3.7). Re-rendering text, rather than
splicing token ids, keeps every reply exactly what a fresh run on the same conversation would
give; the prefix match makes it cheap. When the conversation outgrows the context, the oldest
turns are dropped and what remains is prefilled again.

A session may constrain every reply to a JSON schema (the grammar masks the target's logits at
every verified node, runtime/logits.py) and offer tools: they are rendered with the model's own
template (or described in the system message, for a template without tools), and calls in the
reply are shown as calls, not as the raw text that carries them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Callable

from yggdrasil.errors import InvalidRequestError
from yggdrasil.sampling import SamplingParams
from yggdrasil.runtime.logits import LogitsControl, MaskCost, mask_worker
from yggdrasil.runtime.speculative import SpecStats, generate_with
from yggdrasil.models.tokenizer import Message, TextStream
from yggdrasil.structured.grammar import GrammarEngine
from yggdrasil.structured.tools import Function, ToolCall, ToolSetup, ToolStream, grammar_for, prompt_messages, \
    tool_format

TextCallback = Callable[[str], None]


@dataclass(frozen=True)
class ChatSettings:
    sampling: SamplingParams = SamplingParams()
    max_new_tokens: int = 512
    system: str | None = None
    json_schema: dict | None = None  # every reply is JSON matching it
    tools: tuple[Function, ...] = ()  # functions the model may call (tool_choice auto)


@dataclass(frozen=True)
class TurnStats:
    """One reply: what was prefilled, what came out, how fast."""

    prompt_tokens: int
    prefilled_tokens: int  # the rest came from the cache
    new_tokens: int
    first_token_seconds: float
    decode_seconds: float
    stop_reason: str
    spec: SpecStats | None  # None: plain decoding (the bundle does not speculate)
    dropped_turns: int = 0  # oldest turns dropped to make this one fit

    @property
    def time_per_output_token(self) -> float:
        steps = self.new_tokens - 1
        return self.decode_seconds / steps if steps > 0 else float("nan")


@dataclass
class SessionTotals:
    turns: int = 0
    new_tokens: int = 0
    decode_seconds: float = 0.0
    decode_steps: int = 0  # output tokens after each reply's first
    prefilled_tokens: int = 0
    spec: SpecStats = field(default_factory=SpecStats)

    def add(self, turn: TurnStats) -> None:
        self.turns += 1
        self.new_tokens += turn.new_tokens
        self.decode_seconds += turn.decode_seconds
        self.decode_steps += max(turn.new_tokens - 1, 0)
        self.prefilled_tokens += turn.prefilled_tokens
        if turn.spec is not None:
            self.spec.merge(turn.spec)

    @property
    def time_per_output_token(self) -> float:
        return self.decode_seconds / self.decode_steps if self.decode_steps else float("nan")


@dataclass(frozen=True)
class Reply:
    text: str
    stats: TurnStats
    calls: tuple[ToolCall, ...] = ()  # tool calls the reply made (with --tools)


def describe_call(call: ToolCall) -> str:
    """A tool call as chat shows it."""
    return f"[tool call] {call.name}({call.arguments})"


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class ChatSession:
    """The conversation, the settings and what the caches hold; one reply per `send`."""

    def __init__(self, runtime, settings: ChatSettings = ChatSettings()) -> None:
        if settings.max_new_tokens < 1:
            raise InvalidRequestError(f"max_new_tokens must be >= 1, got {settings.max_new_tokens}")
        self.tokenizer = runtime.target.tokenizer
        self.runner = runtime.runner
        self.speculator = runtime.speculator()  # None: the bundle decodes plainly
        self.settings = settings
        self.turns: list[tuple[str, str]] = []  # (user, assistant) pairs, oldest first
        self.cached_ids: list[int] = []  # tokens whose K/V the caches hold, in order
        self.last: TurnStats | None = None
        self.totals = SessionTotals()
        self.tokenizer.render_chat([Message("user", "hi")])  # no template: fail now, not on turn 1
        self.grammars = GrammarEngine(self.tokenizer)
        self.tools = ToolSetup(settings.tools, "auto", format=tool_format(self.tokenizer)) if settings.tools else None
        self.grammar = (self.grammars.json_schema(settings.json_schema, "--json-schema")
                        if settings.json_schema is not None else None)
        if self.tools is not None and self.tools.format == "generic":  # its replies are JSON by construction
            self.grammar = grammar_for(self.tools, self.grammars)
        self.calls: dict[int, tuple[ToolCall, ...]] = {}  # turn index (in self.turns) -> its calls
        self.mask_cost = MaskCost()  # what the grammar cost over the session
        self._mask_worker = mask_worker() if self.grammar else None

    # settings -----------------------------------------------------------------------------
    def set_temperature(self, value: float) -> None:
        self.settings = replace(self.settings, sampling=replace(self.settings.sampling, temperature=value))

    def set_system(self, text: str | None) -> None:
        """A new system message starts the conversation over (it is the first thing rendered)."""
        self.settings = replace(self.settings, system=text or None)
        self.reset()

    def reset(self) -> None:
        self.turns = []  # the cache keeps its K/V: a new conversation still shares the prefix

    # prompts -------------------------------------------------------------------------------
    def _messages(self, turns: list[tuple[str, str]], user: str) -> list[Message]:
        messages = [Message("system", self.settings.system)] if self.settings.system else []
        first = len(self.turns) - len(turns)
        for index, (asked, answered) in enumerate(turns, first):
            calls = tuple(c.openai() | {"function": {"name": c.name, "arguments": _arguments(c)}}
                          for c in self.calls.get(index, ()))
            messages += [Message("user", asked), Message("assistant", answered, tool_calls=calls)]
        return messages + [Message("user", user)]

    def _encode(self, messages: list[Message]) -> list[int]:
        if self.tools is None:
            return self.tokenizer.encode_chat(messages)
        messages, tools = prompt_messages(messages, self.tools)
        return self.tokenizer.encode_chat(messages, tools=tools)

    @property
    def _reply_room(self) -> int:
        """Tokens a prompt must leave free: the reply (up to a quarter of the context) plus one
        speculation tree beyond the committed tokens."""
        tree = self.speculator.drafter.capacity if self.speculator is not None else 1
        return min(self.settings.max_new_tokens, self.runner.max_context // 4) + tree

    def _fit(self, user: str) -> tuple[list[int], int]:
        """The prompt ids for this turn and how many oldest turns were dropped to fit them."""
        limit = self.runner.max_context - self._reply_room
        for dropped in range(len(self.turns) + 1):
            ids = self._encode(self._messages(self.turns[dropped:], user))
            if len(ids) <= limit:
                return ids, dropped
        raise InvalidRequestError(
            f"this message makes a {len(ids)}-token prompt, but the {self.runner.max_context}-token "
            f"context must keep {self._reply_room} tokens free for the reply; shorten the message"
            + (" or the system message (/system)" if self.settings.system else ""))

    # one turn ------------------------------------------------------------------------------
    def send(self, user: str, on_text: TextCallback | None = None,
             on_notice: TextCallback | None = None) -> Reply:
        """Reply to `user`, streaming text as tokens are committed. Raises InvalidRequestError
        (empty or too long a message) with the conversation unchanged. A KeyboardInterrupt
        while replying keeps the partial reply as the turn, and the caches stay consistent."""
        if not user.strip():
            raise InvalidRequestError("empty message; type something, or /help for commands")
        prompt_ids, dropped = self._fit(user)
        if dropped:
            self.turns = self.turns[dropped:]
            self.calls = {i - dropped: c for i, c in self.calls.items() if i >= dropped}
            if on_notice is not None:
                on_notice(f"[context full: dropped the oldest {dropped} turn{'s' * (dropped > 1)}; "
                          f"prefilling the remaining {len(prompt_ids)}-token conversation again]")
        reuse = common_prefix(self.cached_ids, prompt_ids)
        stream, pieces = TextStream(self.tokenizer), []
        emitted = False
        shown = _Shown(on_text, self.tools.format if self.tools is not None else None)

        def on_tokens(ids) -> None:
            nonlocal emitted
            emitted = True
            text = stream.push(ids)
            pieces.append(text)
            shown.push(text)

        sampling = self.settings.sampling
        if sampling.seed is not None:  # reproducible, but not the same draws every turn
            sampling = replace(sampling, seed=(sampling.seed + self.totals.turns) % 2**64)  # torch's seed range
        control = None
        if self.grammar is not None:
            control = LogitsControl(prompt_ids, matcher=self.grammars.matcher(self.grammar), executor=self._mask_worker)
        try:
            result = generate_with(self.runner, self.speculator, prompt_ids, self.settings.max_new_tokens,
                                   sampling, self.tokenizer.stop_ids, on_tokens, reuse=reuse, control=control)
        except KeyboardInterrupt:
            # the prompt's K/V is complete once a token came out; before that only the reused part
            self.cached_ids = prompt_ids if emitted else prompt_ids[:reuse]
            if self.speculator is not None:
                self.speculator.drafter.truncate(len(self.cached_ids))
            self.turns.append((user, "".join(pieces) + stream.finish()))
            raise
        if control is not None:
            self.mask_cost.merge(control.cost)
        tail = stream.finish()
        shown.push(tail)
        calls = shown.finish()
        text = "".join(pieces) + tail
        self.cached_ids = result.cached_ids
        if calls:
            self.calls[len(self.turns)] = tuple(calls)
        self.turns.append((user, shown.content if self.tools is not None else text))
        stats = result.stats
        self.last = TurnStats(len(prompt_ids), stats.prefilled_tokens, stats.new_tokens,
                              stats.first_token_seconds, stats.decode_seconds, result.stop_reason,
                              getattr(result, "spec", None), dropped)
        self.totals.add(self.last)
        return Reply(shown.content if self.tools is not None else text, self.last, tuple(calls))


def _arguments(call: ToolCall) -> dict:
    return json.loads(call.arguments)


class _Shown:
    """What the user sees of a reply: its text, or with tools its content and calls (read as
    they stream, ToolStream), each call on a line of its own."""

    def __init__(self, on_text: TextCallback | None, tool_format: str | None) -> None:
        self.on_text, self.reader = on_text, ToolStream(tool_format) if tool_format else None
        self.content, self.calls = "", []

    def _show(self, events) -> None:
        for kind, value in events:
            text = value if kind == "content" else f"\n{describe_call(value)}\n"
            if kind == "content":
                self.content += value
            else:
                self.calls.append(value)
            if self.on_text is not None and text:
                self.on_text(text)

    def push(self, text: str) -> None:
        self._show([("content", text)] if self.reader is None else self.reader.push(text))

    def finish(self) -> list[ToolCall]:
        if self.reader is not None:
            self._show(self.reader.finish())
        return self.calls


def describe_stats(session: ChatSession) -> str:
    """The /stats text: the last reply and the whole session."""
    lines = []
    last = session.last
    if last is None:
        lines.append("no replies yet")
    else:
        lines.append(f"last reply: {last.new_tokens} tokens ({last.stop_reason}) | prompt {last.prompt_tokens} "
                     f"tokens, prefilled {last.prefilled_tokens} (cached {last.prompt_tokens - last.prefilled_tokens}) "
                     f"| first token {last.first_token_seconds * 1e3:.0f} ms | "
                     f"time per output token {_ms(last.time_per_output_token)}")
        if last.spec is not None and last.spec.iterations:
            lines.append(f"  {last.spec.summary()}")
            lines.append(f"  {last.spec.prediction_summary()}")
    totals = session.totals
    lines.append(f"session: {totals.turns} replies, {totals.new_tokens} tokens, prefilled {totals.prefilled_tokens} "
                 f"| time per output token {_ms(totals.time_per_output_token)} | "
                 f"{len(session.turns)} turns in context, {len(session.cached_ids)} tokens cached "
                 f"of {session.runner.max_context}")
    if totals.spec.iterations:
        lines.append(f"  {totals.spec.summary()}")
        lines.append(f"  {totals.spec.prediction_summary()}")
    elif session.speculator is None:
        lines.append("  plain decoding: this bundle's plan does not speculate")
    return "\n".join(lines)


def _ms(seconds: float) -> str:
    return "n/a" if seconds != seconds else f"{seconds * 1e3:.1f} ms"
