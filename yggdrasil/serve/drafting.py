"""Chain proposals for a batch of requests: a draft model over the shared pool, or prompt lookup.

The server speculates with chains (one proposal per position, SmartSpec's setting): every
request in a step carries root + k proposals, and the target verifies all of them in the one
batched forward. Proposals never change results, only how many tokens a step yields.
"""

from __future__ import annotations

from yggdrasil.runtime.drafters import LookupDrafter
from yggdrasil.models.model import Transformer
from yggdrasil.models.vocab import head_token_ids
from .pool import PoolForward, Segment, SlotPool
from .requests import RequestState


class ModelProposer:
    """Greedy chains from a draft model whose cache mirrors the target's blocks.

    The draft feeds what it has not seen of each request (its catch-up: tokens committed while
    the batch did not speculate, and the root) in the step's first draft forward, together with
    the prompt chunk the target prefills in the same step, so long prompts never pile up here.
    """

    kind = "model"

    def __init__(self, model: Transformer, pool: SlotPool, graph=None) -> None:
        """graph: the bundle's compiled serve graph for the draft (None: eager forwards)."""
        self.model, self.pool = model, pool
        self.forward = PoolForward(model, pool.new_cache(model), graph)
        self.cache = self.forward.cache
        ids = head_token_ids(model)  # a trimmed draft vocabulary: logit column -> token id
        self._token = (lambda column: column) if ids is None else (lambda column, ids=ids.tolist(): ids[column])

    def propose(self, states: list[RequestState], ks: dict[int, int],
                prefill: Segment | None) -> dict[int, list[int]]:
        speculating = [s for s in states if ks.get(s.rid, 0) > 0]
        segments = [Segment(s.rid, tuple(s.history[s.draft_cached:]), s.draft_cached, "last")
                    for s in speculating]
        if prefill is not None:
            segments.append(Segment(prefill.owner, prefill.tokens, prefill.start, "none"))
        logits = self.forward.run(self.pool, segments)
        proposals = {s.rid: [self._token(int(row[-1].argmax()))] for s, row in zip(speculating, logits)}
        for s in speculating:
            s.draft_cached = len(s.history)
        for depth in range(1, max((ks[s.rid] for s in speculating), default=0)):
            growing = [s for s in speculating if ks[s.rid] > depth]
            segments = [Segment(s.rid, (proposals[s.rid][-1],), len(s.history) + depth - 1, "last")
                        for s in growing]
            for s, row in zip(growing, self.forward.run(self.pool, segments)):
                proposals[s.rid].append(self._token(int(row[-1].argmax())))
        return proposals

    def feed(self, segment: Segment) -> None:
        """Put a segment's K/V into the draft cache (a recomputed request's tokens)."""
        self.forward.run(self.pool, [segment])

    @staticmethod
    def after_verify(state: RequestState, history_before: int, proposed: int, accepted: int) -> None:
        """The draft fed the root and proposals 1..k-1; the accepted ones among them stay valid."""
        if proposed > 0:
            state.draft_cached = history_before + min(accepted, proposed - 1)

    def prefilled(self, prefill: Segment, state: RequestState) -> None:
        state.draft_cached = prefill.end


class LookupProposer:
    """Prompt lookup (no model): the most specific, most recent earlier continuation."""

    kind = "lookup"

    def __init__(self, max_ngram: int = 3) -> None:
        self.lookup = LookupDrafter(depth=1, width=1, max_ngram=max_ngram)

    def propose(self, states: list[RequestState], ks: dict[int, int],
                prefill: Segment | None) -> dict[int, list[int]]:
        out = {}
        for s in states:
            k = ks.get(s.rid, 0)
            found = self.lookup.continuations(s.history, depth=k, width=1) if k > 0 else []
            out[s.rid] = found[0][0] if found else []
        return out

    def feed(self, segment: Segment) -> None:
        pass

    @staticmethod
    def after_verify(state: RequestState, history_before: int, proposed: int, accepted: int) -> None:
        pass

    def prefilled(self, prefill: Segment, state: RequestState) -> None:
        pass
