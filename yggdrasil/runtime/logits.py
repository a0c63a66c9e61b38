"""One reply's logits processing at every node the target verifies: repetition penalties, then
a grammar's mask (docs/cli.md, "Structured output").

The draft proposes; the processed target decides. Node j of a verified tree gets exactly what
plain decoding would apply at that point of the reply: the penalties count the tokens on its
path, the grammar's state is the one after them. A drafted token the grammar forbids is then
rejected like any other mismatch, greedy speculative output stays the plain greedy output token
for token, and sampling draws from the processed target distribution at every node.

Only the nodes the walk visits decide anything (the root, then from each node the first child
holding its choice), so `choose` follows that path and processes its rows alone: one grammar
mask per committed token, as plain decoding computes, however large the tree. Greedy decoding
that needs no distribution keeps a node's own argmax when the mask allows it (the masked argmax
is then the same token) and masks the row only when it does not. Where a core is free beyond
torch's threads (`spare_core`), the masks of every node are computed in a worker while the
forward runs (they depend only on the drafted tokens) and the walk looks them up. `MaskCost`
records what all this costs.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np
import torch

from yggdrasil.errors import InvalidRequestError
from yggdrasil.host_reads import staged
from yggdrasil.structured.grammar import Matcher

# the decoder's rule for rows of logits: (rows [m, vocab], their node indices) -> a token each
# (the argmax, or the draw with each node's own pre-drawn random)
Pick = Callable[[torch.Tensor, list[int]], list[int]]


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
    """Host seconds the grammar and penalties cost: computing masks (in the worker during the
    forward, or inline after it), waiting for the worker after the forward, and the walk that
    applies masks and penalties to the rows on the path."""

    compute_seconds: float = 0.0
    wait_seconds: float = 0.0
    apply_seconds: float = 0.0
    masks: int = 0  # grammar masks computed
    masked_rows: int = 0  # path rows whose choice the mask changed or had to decide
    steps: int = 0

    def merge(self, other: "MaskCost") -> None:
        for name in ("compute_seconds", "wait_seconds", "apply_seconds", "masks", "masked_rows", "steps"):
            setattr(self, name, getattr(self, name) + getattr(other, name))


@dataclass
class LogitsControl:
    """Penalties and a grammar for one reply. start(nodes) before a forward, choose(logits, ...)
    after it, commit(tokens) once they are the reply's."""

    prompt_ids: Sequence[int] = ()
    penalties: Penalties = Penalties()
    matcher: Matcher | None = None
    executor: Executor | None = None  # computes every node's mask while the forward runs (None: on the path, after)
    needs_rows: bool = False  # the processed rows are read (logprobs): mask every path row
    cost: MaskCost = field(default_factory=MaskCost)

    def __post_init__(self) -> None:
        self.counts: dict[int, int] = {}  # generated token -> times
        self.prompt_seen = sorted(set(int(t) for t in self.prompt_ids)) if self.penalties.repetition != 1 else []
        self._nodes: tuple[list[int], list[int]] | None = None
        self._masks: Future | None = None
        self.finished = False  # the grammar is complete: nothing may follow

    @property
    def active(self) -> bool:
        return self.matcher is not None or self.penalties.active

    # ---- a step ---------------------------------------------------------------------------
    def start(self, tokens: Sequence[int], parents: Sequence[int]) -> None:
        """The nodes the next forward verifies: node 0 the root (the last committed token),
        parents before children."""
        self._nodes = (list(map(int, tokens)), list(map(int, parents)))
        self.cost.steps += 1
        if self.matcher is not None and self.executor is not None and len(tokens) > 1:
            self._masks = self.executor.submit(self._tree_masks, *self._nodes)

    def _tree_masks(self, tokens: list[int], parents: list[int]) -> np.ndarray:
        started = time.perf_counter()
        masks = self.matcher.node_masks(tokens, parents)
        self.cost.compute_seconds += time.perf_counter() - started
        self.cost.masks += len(tokens)
        return masks

    def choose(self, logits: torch.Tensor, pick: Pick, greedy: bool) -> tuple[list[int], torch.Tensor]:
        """Every started node's choice (pick's rule), those on the walk's path made on processed
        rows; and the logits with those rows processed (the others as they were)."""
        if self._nodes is None:
            raise RuntimeError("LogitsControl.choose before start")
        tokens, parents = self._nodes
        self._nodes = None
        choices = pick(logits, list(range(len(tokens))))
        if not self.active:
            return choices, logits
        waited = time.perf_counter()
        masks = self._masks.result() if self._masks is not None else None
        self._masks = None
        started, computed = time.perf_counter(), self.cost.compute_seconds
        self.cost.wait_seconds += started - waited
        children: dict[tuple[int, int], int] = {}
        for j in range(1, len(tokens)):
            children.setdefault((parents[j], tokens[j]), j)
        processed: dict[int, torch.Tensor] = {}
        node, path = 0, []
        while True:
            row, decided = self._process_row(logits[node], path, node, masks, choices[node], greedy)
            if row is not None:
                processed[node] = row
                if not decided:
                    choices[node] = pick(row[None], [node])[0]
            child = children.get((node, choices[node]))
            if child is None or (self.matcher is not None and not self.matcher.inner.consume_token(choices[node])):
                break
            path.append(choices[node])
            node = child
        if self.matcher is not None and path:
            self.matcher.inner.rollback(len(path))
        self.cost.apply_seconds += time.perf_counter() - started - (self.cost.compute_seconds - computed)
        if not processed:
            return choices, logits
        out = logits.float().clone()
        for node, row in processed.items():
            out[node] = row
        return choices, out

    def _process_row(self, row: torch.Tensor, path: list[int], node: int, masks: np.ndarray | None,
                     choice: int, greedy: bool) -> tuple[torch.Tensor | None, bool]:
        """(the processed row, or None when it needs nothing; whether `choice` still stands)."""
        if self.penalties.active:
            row = self._penalize(row.float(), path)
        if self.matcher is None:
            return row, False
        if masks is not None:
            mask = masks[node]
        else:
            mask = np.empty(self.matcher.words, dtype=np.int32)
            compute = time.perf_counter()
            self.matcher.fill(mask)
            self.cost.compute_seconds += time.perf_counter() - compute
            self.cost.masks += 1
        if not mask.any():  # nothing may follow (the grammar is complete): the row stays
            return (row if self.penalties.active else None), False
        if greedy and not self.penalties.active and not self.needs_rows and _allows(mask, choice):
            return None, True  # the masked argmax is the argmax itself
        self.cost.masked_rows += 1
        return _masked(row[None], mask[None])[0], False

    def _penalize(self, row: torch.Tensor, path: list[int]) -> torch.Tensor:
        """One node's penalties over the committed tokens and those on its path."""
        counts = dict(self.counts)
        for token in path:
            counts[token] = counts.get(token, 0) + 1
        p, vocab = self.penalties, row.shape[-1]
        out = row.clone()
        if counts:
            ids = torch.tensor([t for t in counts if t < vocab], dtype=torch.long)
            times = torch.tensor([counts[t] for t in counts if t < vocab], dtype=torch.float32)
            ids, times = staged((ids, times), row.device)
            out[ids] -= p.frequency * times + p.presence
        if p.repetition != 1:
            seen = sorted(set(self.prompt_seen) | set(counts))
            ids = staged((torch.tensor([t for t in seen if t < vocab], dtype=torch.long),), row.device)[0]
            values = out[ids]
            out[ids] = torch.where(values > 0, values / p.repetition, values * p.repetition)
        return out

    def commit(self, tokens: Sequence[int]) -> int:
        """The reply's new tokens, in order; how many of them count (those up to the one that
        completes the grammar: nothing may follow it)."""
        for i, token in enumerate(tokens):
            token = int(token)
            if self.matcher is not None and not self.matcher.consume(token):
                raise RuntimeError(f"the grammar refused committed token {token}: {self.matcher.failed[:200]}")
            self.counts[token] = self.counts.get(token, 0) + 1
            if self.matcher is not None and self.matcher.finished:
                self.finished = True
                return i + 1
        return len(tokens)


def _allows(mask: np.ndarray, token: int) -> bool:
    return bool((int(mask[token >> 5]) >> (token & 31)) & 1) if token >> 5 < mask.shape[0] else False


def _masked(logits: torch.Tensor, masks: np.ndarray) -> torch.Tensor:
    """logits [n, vocab] with -inf where masks [n, words] (bit t of word t // 32) forbid; ids
    past the tokenizer's vocabulary are never allowed."""
    vocab = logits.shape[-1]
    allowed = np.unpackbits(masks.view(np.uint8), axis=1, count=vocab, bitorder="little").view(bool)
    allowed = staged((torch.from_numpy(allowed),), logits.device)[0]
    return torch.where(allowed, logits.float(), float("-inf"))


def spare_core() -> bool:
    """Whether a core is free beyond torch's threads (a mask worker then runs beside the forward;
    on a machine without one it would only slow the forward down)."""
    return (os.cpu_count() or 1) > torch.get_num_threads()


def mask_worker() -> Executor | None:
    """A worker thread for tree masks where a core is free for it, else None (masks on the path)."""
    return ThreadPoolExecutor(1, thread_name_prefix="yggdrasil-masks") if spare_core() else None


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
