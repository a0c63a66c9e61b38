"""One request inside the server's engine: what it asked for, what it holds, how it ends.

Sampling draws the n-th generated token with the n-th number of the request's own seeded stream
(inverse CDF of the target distribution), whatever the speculation length, the batch or the
step it lands in: a reply depends only on the request, never on the load around it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol

import torch

from yggdrasil.sampling import SamplingParams, target_probs
from yggdrasil.models.tokenizer import TextStream, Tokenizer
from yggdrasil.runtime.logits import LogitsControl, Penalties, token_logprobs
from yggdrasil.structured.grammar import Grammar, Matcher
from .goodput import AcceptanceRate

FINISH_REASONS = ("stop", "length", "cancelled", "error")


@dataclass(frozen=True)
class GenerationRequest:
    prompt_ids: tuple[int, ...]
    max_tokens: int
    sampling: SamplingParams = SamplingParams()
    stop: tuple[str, ...] = ()  # strings that end the reply (not included in it)
    grammar: Grammar | None = None  # the reply follows it (response_format, a forced tool call)
    penalties: Penalties = Penalties()
    logprobs: int | None = None  # alternatives per token's log-probability (None: no logprobs)


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class TokenLogprob:
    """A committed token's log-probability under the verified target's (processed) distribution,
    with the most likely alternatives."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


class Sink(Protocol):
    """Where a request's output goes (the HTTP layer); called on the engine thread. tokens gets
    logprobs (one per id) when the request asked for them."""

    def tokens(self, ids: list[int], text: str, logprobs: list[TokenLogprob] | None = None) -> None: ...
    def finish(self, reason: str, usage: Usage) -> None: ...
    def fail(self, message: str) -> None: ...


class StopText:
    """Cuts the reply at the first stop string, holding back text that may be the start of one."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = tuple(s for s in stops if s)
        self.pending = ""

    def push(self, text: str) -> tuple[str, bool]:
        """(text safe to emit now, whether a stop string was reached)."""
        self.pending += text
        if not self.stops:
            out, self.pending = self.pending, ""
            return out, False
        hits = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            out, self.pending = self.pending[:min(hits)], ""
            return out, True
        hold = max((n for s in self.stops for n in range(min(len(s) - 1, len(self.pending)), 0, -1)
                    if self.pending.endswith(s[:n])), default=0)
        cut = len(self.pending) - hold
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


class RequestState:
    """A request the engine holds: its tokens, its progress, its output channel."""

    def __init__(self, rid: int, request: GenerationRequest, sink: Sink, tokenizer: Tokenizer,
                 max_context: int, acceptance_prior: float = 0.6, matcher: Matcher | None = None,
                 mask_worker=None) -> None:
        """matcher: the request's grammar state (request.grammar's); mask_worker: the executor its
        node masks are computed in while a step's forward runs."""
        self.rid, self.request, self.sink = rid, request, sink
        self.history = list(request.prompt_ids)
        self.prefilled = 0  # prompt tokens whose K/V the target cache holds
        self.draft_cached = 0  # history tokens whose K/V the draft cache holds
        self.resume_goal: int | None = None  # preempted by recompute: history tokens to prefill again
        self.max_context = max_context
        self.stop_ids = tokenizer.stop_ids
        self.acceptance = AcceptanceRate(acceptance_prior)
        self.arrived = time.perf_counter()
        self.scheduled_at: float | None = None  # first admitted to the running batch
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self.finish_reason: str | None = None
        self.reported = False  # the sink has been told how the request ended
        self._text = TextStream(tokenizer)
        self._stop_text = StopText(request.stop)
        self._generator = request.sampling.generator() if not request.sampling.greedy else None
        self._uniforms: list[float] = []
        self.cached_tokens = 0  # prompt tokens the prefix cache supplied
        if request.grammar is not None and matcher is None:
            raise ValueError("a request with a grammar needs its matcher")
        control = LogitsControl(request.prompt_ids, request.penalties, matcher, mask_worker,
                                needs_rows=request.logprobs is not None)
        self.control = control if control.active else None

    # progress ----------------------------------------------------------------------------
    @property
    def prompt_length(self) -> int:
        return len(self.request.prompt_ids)

    @property
    def generated(self) -> int:
        return len(self.history) - self.prompt_length

    @property
    def prefill_goal(self) -> int:
        """History tokens the target cache must hold before the request decodes."""
        return self.prompt_length if self.resume_goal is None else self.resume_goal

    @property
    def prefilling(self) -> bool:
        return self.prefilled < self.prefill_goal

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def room(self) -> int:
        """Proposals a chain may carry: its rows must stay inside the context, and more than the
        tokens still wanted is wasted work."""
        return max(min(self.max_context - len(self.history), self.request.max_tokens - self.generated - 1), 0)

    # sampling ----------------------------------------------------------------------------
    def _uniform(self, index: int) -> float:
        while len(self._uniforms) <= index:
            self._uniforms.extend(torch.rand(64, generator=self._generator, dtype=torch.float64).tolist())
        return self._uniforms[index]

    def start(self, tokens: list[int]) -> None:
        """The rows the next forward verifies for this request: its last token and a chain of
        proposals (their penalties and grammar masks are prepared while the forward runs)."""
        if self.control is not None:
            self.control.start(tokens, list(range(-1, len(tokens) - 1)))

    def logprobs(self, logits: torch.Tensor, tokens: list[int]) -> list[TokenLogprob] | None:
        """Row j's log-probability of tokens[j] (processed logits), if the request asked."""
        if self.request.logprobs is None:
            return None
        rows = token_logprobs(logits[:len(tokens)], tokens, self.request.logprobs)
        return [TokenLogprob(t, lp, tuple(top)) for t, (lp, top) in zip(tokens, rows)]

    def choose(self, logits: torch.Tensor, first_index: int) -> tuple[list[int], torch.Tensor]:
        """The target's token for each row of logits [n, vocab] (row j draws generated token
        number first_index + j), the rows on the accepted path made under the request's
        penalties and grammar; and the logits with those rows processed."""
        pick = lambda rows, nodes: self._pick(rows, [first_index + j for j in nodes])  # noqa: E731
        if self.control is None:
            return pick(logits, list(range(logits.shape[0]))), logits
        return self.control.choose(logits, pick, self.request.sampling.greedy)

    def _pick(self, logits: torch.Tensor, indexes: list[int]) -> list[int]:
        params = self.request.sampling
        if params.greedy:
            return logits.argmax(-1).tolist()
        cdf = target_probs(logits, params).double().cumsum(-1)
        uniforms = torch.tensor([self._uniform(i) for i in indexes], dtype=torch.float64, device=cdf.device)
        picked = torch.searchsorted(cdf, (uniforms * cdf[:, -1]).unsqueeze(-1)).squeeze(-1)
        return picked.clamp(max=logits.shape[-1] - 1).tolist()

    # output ------------------------------------------------------------------------------
    def append(self, tokens: list[int], logprobs: list[TokenLogprob] | None = None) -> None:
        """Commit new tokens (stop tokens end the reply unemitted; a completed grammar ends it
        after its last token) and emit their text."""
        if self.control is not None:
            tokens = tokens[:self.control.commit(tokens)]
        kept: list[int] = []
        for token in tokens:
            if token in self.stop_ids:
                self.finish_reason = "stop"
                break
            kept.append(token)
            if self.generated + len(kept) >= self.request.max_tokens \
                    or len(self.history) + len(kept) >= self.max_context:
                self.finish_reason = "length"
                break
        now = time.perf_counter()
        if self.first_token_at is None:
            self.first_token_at = now
        self.last_token_at = now
        self.history.extend(kept)
        if self.control is not None and self.control.finished and not self.done:
            self.finish_reason = "stop"
        text, stopped = self._stop_text.push(self._text.push(kept))
        if stopped:
            self.finish_reason = "stop"
        elif self.done:
            text += self._stop_text.push(self._text.finish())[0] + self._stop_text.flush()
        if logprobs is not None:
            self.sink.tokens(kept, text, logprobs[:len(kept)])
        elif kept or text:
            self.sink.tokens(kept, text)

    def usage(self) -> Usage:
        return Usage(self.prompt_length, self.generated, self.cached_tokens)
