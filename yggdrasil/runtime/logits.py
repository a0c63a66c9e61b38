"""One reply's logits processing at every node the target verifies: repetition penalties, then
a grammar's mask (docs/cli.md, "Structured output").

The draft proposes; the processed target decides. Node j of a verified tree gets exactly what
plain decoding would apply at that point of the reply (the penalties count the tokens on its
path, the grammar's state is the one after them), so a drafted token the grammar forbids is
rejected like any other mismatch, greedy speculative output stays the plain greedy output token
for token, and sampling draws from the processed target distribution at every node.

The masks of a step's nodes depend only on tokens known before its forward (the tree is drafted
first), so `start` computes them in a worker thread while the forward runs (llguidance releases
the GIL) and `process` waits for them after it; `MaskCost` records what that costs.
"""

from __future__ import annotations

import time
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

from yggdrasil.errors import InvalidRequestError
from yggdrasil.host_reads import staged
from yggdrasil.structured.grammar import Matcher


@dataclass(frozen=True)
class Penalties:
    """OpenAI's presence and frequency penalties (over the generated tokens, subtracted from the
    logits) and the multiplicative repetition penalty llama.cpp's server and vLLM offer (over the
    prompt and the generated tokens: a positive logit is divided by it, a negative one multiplied)."""

    presence: float = 0.0
    frequency: float = 0.0
    repetition: float = 1.0

    def __post_init__(self) -> None:
        for name in ("presence", "frequency"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise InvalidRequestError(f"{name}_penalty must be between -2 and 2, got {value}")
        if not 0.0 < self.repetition <= 10.0:
            raise InvalidRequestError(f"repetition_penalty must be in (0, 10] (1 = off), got {self.repetition}")

    @property
    def active(self) -> bool:
        return self.presence != 0 or self.frequency != 0 or self.repetition != 1


@dataclass
class MaskCost:
    """Host seconds the grammar cost: computing masks (in the worker), waiting for them after
    the forward (what the overlap did not hide), and applying masks and penalties."""

    compute_seconds: float = 0.0
    wait_seconds: float = 0.0
    apply_seconds: float = 0.0
    rows: int = 0  # node masks computed
    steps: int = 0

    def merge(self, other: "MaskCost") -> None:
        for name in ("compute_seconds", "wait_seconds", "apply_seconds", "rows", "steps"):
            setattr(self, name, getattr(self, name) + getattr(other, name))


@dataclass
class LogitsControl:
    """Penalties and a grammar for one reply. start(nodes) before a forward, process(logits)
    after it, commit(tokens) once they are the reply's."""

    prompt_ids: Sequence[int] = ()
    penalties: Penalties = Penalties()
    matcher: Matcher | None = None
    executor: Executor | None = None  # where masks are computed while the forward runs (None: inline)
    cost: MaskCost = field(default_factory=MaskCost)

    def __post_init__(self) -> None:
        self.counts: dict[int, int] = {}  # generated token -> times
        self.prompt_seen = set(int(t) for t in self.prompt_ids) if self.penalties.repetition != 1 else set()
        self._nodes: tuple[list[int], list[int]] | None = None
        self._masks: Future | np.ndarray | None = None
        self.finished = False  # the grammar is complete: nothing may follow

    @property
    def active(self) -> bool:
        return self.matcher is not None or self.penalties.active

    # ---- a step ---------------------------------------------------------------------------
    def start(self, tokens: Sequence[int], parents: Sequence[int]) -> None:
        """The nodes the next forward verifies: node 0 the root (the last committed token),
        parents before children."""
        self._nodes = (list(map(int, tokens)), list(map(int, parents)))
        if self.matcher is None:
            return
        self.cost.steps += 1
        self.cost.rows += len(tokens)
        if self.executor is None:
            self._masks = self._compute(*self._nodes)
        else:
            self._masks = self.executor.submit(self._compute, *self._nodes)

    def _compute(self, tokens: list[int], parents: list[int]) -> np.ndarray:
        started = time.perf_counter()
        masks = self.matcher.node_masks(tokens, parents)
        self.cost.compute_seconds += time.perf_counter() - started
        return masks

    def process(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [n, vocab] of the started nodes, processed (float32; the input when nothing applies)."""
        if self._nodes is None:
            raise RuntimeError("LogitsControl.process before start")
        tokens, parents = self._nodes
        self._nodes = None
        if not self.active:
            return logits
        waited = time.perf_counter()
        masks = self._masks.result() if isinstance(self._masks, Future) else self._masks
        self._masks = None
        started = time.perf_counter()
        self.cost.wait_seconds += started - waited
        out = logits.float().clone()
        if self.penalties.active:
            out = self._penalize(out, tokens, parents)
        if masks is not None:
            allowed = np.unpackbits(masks.view(np.uint8), axis=1, bitorder="little").view(bool)
            allowed = _fit(torch.from_numpy(allowed), out.shape[-1])
            out.masked_fill_(~staged((allowed,), out.device)[0], float("-inf"))
        self.cost.apply_seconds += time.perf_counter() - started
        return out

    def _penalize(self, logits: torch.Tensor, tokens: list[int], parents: list[int]) -> torch.Tensor:
        """Each node's penalties over the committed tokens and those on its own path."""
        n, vocab = logits.shape
        counts = torch.zeros(n, vocab)
        if self.counts:
            ids = torch.tensor(list(self.counts), dtype=torch.long)
            counts[:, ids] = torch.tensor(list(self.counts.values()), dtype=torch.float32)
        rows, cols = [], []
        paths: list[list[int]] = [[] for _ in range(n)]
        for j in range(1, n):
            paths[j] = paths[parents[j]] + [tokens[j]]
            rows += [j] * len(paths[j])
            cols += paths[j]
        if rows:
            counts.index_put_((torch.tensor(rows), torch.tensor(cols)), torch.ones(len(rows)), accumulate=True)
        counts = staged((counts,), logits.device)[0]
        p = self.penalties
        logits = logits - p.frequency * counts - p.presence * (counts > 0).float()
        if p.repetition != 1:
            seen = counts > 0
            if self.prompt_seen:
                seen[:, torch.tensor(sorted(t for t in self.prompt_seen if t < vocab), dtype=torch.long)] = True
            scaled = torch.where(logits > 0, logits / p.repetition, logits * p.repetition)
            logits = torch.where(seen, scaled, logits)
        return logits

    def commit(self, tokens: Sequence[int]) -> int:
        """The reply's new tokens, in order; how many of them count (those up to the one that
        completes the grammar: nothing may follow it)."""
        for i, token in enumerate(tokens):
            token = int(token)
            if self.matcher is not None:
                if not self.matcher.consume(token):
                    raise RuntimeError(f"the grammar refused committed token {token}: {self.matcher.failed[:200]}")
            self.counts[token] = self.counts.get(token, 0) + 1
            if self.matcher is not None and self.matcher.finished:
                self.finished = True
                return i + 1
        return len(tokens)


def _fit(allowed: torch.Tensor, vocab: int) -> torch.Tensor:
    """A mask over the tokenizer's vocabulary to the logits' width (ids past the tokenizer's
    are never allowed)."""
    if allowed.shape[-1] >= vocab:
        return allowed[:, :vocab]
    pad = torch.zeros(allowed.shape[0], vocab - allowed.shape[-1], dtype=torch.bool)
    return torch.cat([allowed, pad], dim=-1)


def token_logprobs(logits: torch.Tensor, chosen: Sequence[int], top: int) -> list[tuple[float, list[tuple[int, float]]]]:
    """Per row: the chosen token's log-probability under softmax(logits) and the `top` most
    likely tokens with theirs (the verified target's distribution, processed, at temperature 1)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    picked = logp.gather(-1, torch.tensor(list(chosen), dtype=torch.long, device=logp.device)[:, None])[:, 0]
    best = logp.topk(top, dim=-1) if top > 0 else None
    out = []
    for i, value in enumerate(picked.tolist()):
        alternatives = list(zip(best.indices[i].tolist(), best.values[i].tolist())) if best is not None else []
        out.append((value, alternatives))
    return out
